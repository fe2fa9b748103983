"""evictlayers: bounded KV caches for Hugging Face decoders, with eviction policies from the literature."""

from evictlayers import models
from evictlayers.compose import ByLayerKind, CompileError, Induction, Policy, PolicyError, Pyramid, Ramp, RecipeError, SlotStore, Uniform, dump_recipe, load_recipe
from evictlayers.hf import EvictionCache, UnsupportedModelError, apply
from evictlayers.core import Component
from evictlayers.modules import (
    ClusterSketch, DenseKV, HeavyHitterSelector, KCenterSelector, QuantizedKV, RecentWindow, SinkTokens,
)
from evictlayers.scoring import (
    Averaged, CrossLayer, Cumulative, KeyDiff, KeyNorm, LowScoreCounter, RecentThenCumulative, StepGainSoftmax,
    ValuePrior, Windowed,
)

__all__ = [
    "Averaged",
    "ByLayerKind",
    "Induction",
    "CompileError",
    "CrossLayer",
    "ClusterSketch",
    "Component",
    "Cumulative",
    "DenseKV",
    "EvictionCache",
    "HeavyHitterSelector",
    "KCenterSelector",
    "KeyDiff",
    "KeyNorm",
    "LowScoreCounter",
    "Policy",
    "PolicyError",
    "Pyramid",
    "QuantizedKV",
    "Ramp",
    "RecipeError",
    "RecentThenCumulative",
    "RecentWindow",
    "SinkTokens",
    "SlotStore",
    "StepGainSoftmax",
    "Uniform",
    "UnsupportedModelError",
    "ValuePrior",
    "Windowed",
    "apply",
    "dump_recipe",
    "load_recipe",
    "models",
]
