"""The Hugging Face side: attention replacement, the eviction Cache, what a model needs to be served."""

from evictlayers.hf.cache import EvictionCache, EvictionLayer
from evictlayers.hf.patch import EvictionRun, apply
from evictlayers.hf.support import ModelSupport, UnsupportedModelError, model_support

__all__ = [
    "EvictionCache", "EvictionLayer", "EvictionRun", "ModelSupport", "UnsupportedModelError", "apply", "model_support",
]
