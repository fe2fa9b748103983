"""What stays in the cache (protections by position, selectors by score) and how it is stored."""

from evictlayers.modules.cluster_sketch import ClusterSketch, SketchState
from evictlayers.modules.dense_kv import DenseKV, DenseSlots
from evictlayers.modules.heavy_hitter import HeavyHitterSelector
from evictlayers.modules.kcenter_selector import KCenterSelector
from evictlayers.modules.protection import Protection
from evictlayers.modules.quantized_kv import QuantizedKV, QuantizedSlots
from evictlayers.modules.recent_window import RecentWindow
from evictlayers.modules.selector import Selector
from evictlayers.modules.sink_tokens import SinkTokens

__all__ = [
    "ClusterSketch",
    "DenseKV",
    "DenseSlots",
    "HeavyHitterSelector",
    "KCenterSelector",
    "Protection",
    "QuantizedKV",
    "QuantizedSlots",
    "RecentWindow",
    "Selector",
    "SinkTokens",
    "SketchState",
]
