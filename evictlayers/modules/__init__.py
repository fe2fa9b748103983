"""What stays in the cache: protections by position and selectors by score."""

from evictlayers.modules.heavy_hitter import HeavyHitterSelector
from evictlayers.modules.protection import Protection
from evictlayers.modules.recent_window import RecentWindow
from evictlayers.modules.sink_tokens import SinkTokens

__all__ = ["HeavyHitterSelector", "Protection", "RecentWindow", "SinkTokens"]
