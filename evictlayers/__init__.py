"""evictlayers: bounded KV caches for Hugging Face decoders, with eviction policies from the literature."""

from evictlayers import models
from evictlayers.compose import ByLayerKind, CompileError, Induction, Policy, PolicyError, Pyramid, Ramp, RecipeError, SlotStore, Uniform, dump_recipe, load_recipe
from evictlayers.hf import EvictionCache, UnsupportedModelError, apply
from evictlayers.core import Component
from evictlayers.modules import (
    ClusterSketch, DenseKV, HeavyHitterSelector, KCenterSelector, QuantizedKV, RecentWindow, SinkTokens,
)
from evictlayers.scoring import (
    Averaged, ChunkScores, ContextReconstruction, CrossLayer, Cumulative, ExpectedAttention, KeyDiff, KeyNorm,
    LayerScope, LowScoreCounter,
    PooledScores, RecentThenCumulative, SentenceScores, StepGainSoftmax, ValuePrior, Windowed,
)

__all__ = [
    "Averaged",
    "ByLayerKind",
    "ChunkScores",
    "Induction",
    "CompileError",
    "ContextReconstruction",
    "CrossLayer",
    "ClusterSketch",
    "Component",
    "Cumulative",
    "DenseKV",
    "EvictionCache",
    "ExpectedAttention",
    "HeavyHitterSelector",
    "KCenterSelector",
    "KeyDiff",
    "KeyNorm",
    "LayerScope",
    "LowScoreCounter",
    "Policy",
    "PolicyError",
    "PooledScores",
    "Pyramid",
    "QuantizedKV",
    "Ramp",
    "RecipeError",
    "RecentThenCumulative",
    "RecentWindow",
    "SentenceScores",
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
