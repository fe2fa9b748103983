"""evictlayers: bounded KV caches for Hugging Face decoders, with eviction policies from the literature."""

from evictlayers import models
from evictlayers.compose import Policy, Pyramid, Ramp, RecipeError, SlotStore, Uniform, dump_recipe, load_recipe
from evictlayers.hf import EvictionCache, UnsupportedModelError, apply
from evictlayers.modules import HeavyHitterSelector, RecentWindow, SinkTokens
from evictlayers.scoring import Averaged, Cumulative

__all__ = [
    "Averaged",
    "Cumulative",
    "EvictionCache",
    "HeavyHitterSelector",
    "Policy",
    "Pyramid",
    "Ramp",
    "RecipeError",
    "RecentWindow",
    "SinkTokens",
    "SlotStore",
    "Uniform",
    "UnsupportedModelError",
    "apply",
    "dump_recipe",
    "load_recipe",
    "models",
]
