"""evictlayers: bounded KV caches for Hugging Face decoders, with eviction policies from the literature."""

from evictlayers.compose import Policy, RecipeError, SlotStore, dump_recipe, load_recipe
from evictlayers.hf import EvictionCache, UnsupportedModelError, apply
from evictlayers.modules import HeavyHitterSelector, RecentWindow, SinkTokens
from evictlayers.scoring import Averaged, Cumulative

__all__ = [
    "Averaged",
    "Cumulative",
    "EvictionCache",
    "HeavyHitterSelector",
    "Policy",
    "RecipeError",
    "RecentWindow",
    "SinkTokens",
    "SlotStore",
    "UnsupportedModelError",
    "apply",
    "dump_recipe",
    "load_recipe",
]
