"""Which transformers model types evictlayers can patch, and the attention classes it replaces.

Every listed class computes attention through transformers' ``AttentionInterface`` with post-RoPE
queries and un-expanded keys/values, so one attention function serves them all. A model type not
listed here is refused with the names of its attention classes: never silent full attention.
"""

from __future__ import annotations

from torch import nn

ATTENTION_CLASSES: dict[str, str] = {
    "llama": "LlamaAttention",
    "mistral": "MistralAttention",
    "qwen2": "Qwen2Attention",
    "qwen3": "Qwen3Attention",
    "gemma2": "Gemma2Attention",
    "phi3": "Phi3Attention",
    "gpt2": "GPT2Attention",
    "opt": "OPTAttention",
    "gpt_neox": "GPTNeoXAttention",
}


class UnsupportedModelError(TypeError):
    """The model's attention cannot be replaced by evictlayers."""


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that evictlayers replaces, ordered by ``layer_idx``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    expected = ATTENTION_CLASSES.get(model_type)
    if expected is None:
        found = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        raise UnsupportedModelError(
            f"evictlayers cannot replace the attention of {type(model).__name__} (model_type={model_type!r}, "
            f"attention classes: {', '.join(found) or 'none found'}); supported model types: "
            f"{', '.join(sorted(ATTENTION_CLASSES))}"
        )
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"evictlayers supports decoder-only self-attention; {type(model).__name__} has cross-attention"
        )
    modules = [m for m in model.modules() if type(m).__name__ == expected]
    if not modules:
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={model_type!r}) has no {expected} modules to replace"
        )
    indices = [getattr(m, "layer_idx", None) for m in modules]
    if sorted(indices) != list(range(len(modules))):
        raise UnsupportedModelError(
            f"{expected} modules of {type(model).__name__} have layer_idx {indices}; expected 0..{len(modules) - 1}"
        )
    return sorted(modules, key=lambda m: m.layer_idx)
