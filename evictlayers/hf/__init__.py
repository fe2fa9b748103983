"""The Hugging Face side: attention replacement, the eviction Cache, model-family dispatch."""

from evictlayers.hf.cache import EvictionCache, EvictionLayer
from evictlayers.hf.families import ATTENTION_CLASSES, UnsupportedModelError
from evictlayers.hf.patch import EvictionRun, apply

__all__ = ["ATTENTION_CLASSES", "EvictionCache", "EvictionLayer", "EvictionRun", "UnsupportedModelError", "apply"]
