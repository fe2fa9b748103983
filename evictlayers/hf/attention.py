"""The attention function transformers calls while ``evictlayers.apply`` is active.

Registered in ``AttentionInterface`` under ``ATTENTION_NAME`` together with a mask function of the
same name: transformers would otherwise silently hand over no causal mask at prefill. The mask
function builds nothing, because the slot store masks by each slot's original position (slots are
unordered after eviction, so an index-based causal mask would be wrong).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from evictlayers.compose import Policy, SlotStore
from evictlayers.hf.support import REFUSED_KEYWORDS, UnsupportedModelError, original_class

ATTENTION_NAME = "evictlayers"
FULL, ROLLING_FULL = Policy(), Policy(positions="rolling")  # what a call without a cache attends with


def no_index_mask(*args, **kwargs) -> None:
    """Mask function paired with the attention function: masking happens by slot position instead."""
    return None


def evicting_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``(attn_output [B, Q, H_q, D_v], None)`` as transformers' attention functions return."""
    run = getattr(module, "_evictlayers_run", None)
    if run is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} reached {type(module).__name__}, which "
            "evictlayers.apply did not patch; use `with evictlayers.apply(model, policy):`"
        )
    if dropout and module.training:
        raise ValueError("evictlayers runs inference only: attention dropout is not supported (call model.eval())")
    _refuse_unserved(run, module, kwargs)
    if run.recording:
        # the rolling probe: each layer's queries and keys are recorded and its output is zero, so what
        # the next layer receives does not depend on positions and every layer can be checked alone
        run.record(module.layer_idx, query, key)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is not None and run.replaced_implementation == "sdpa":
        raise UnsupportedModelError(
            f"{_where(run, module)} soft-caps its attention logits, which transformers' sdpa attention does not "
            "apply (older releases ignore it): the unmodified model is not defined; load the model with "
            "attn_implementation='eager'"
        )
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # learned sinks: GPT-OSS's s_aux, others' sinks
    options = {"scaling": scaling, "softcap": softcap, "sliding_window": sliding_window}
    layer = run.staged_layer(module.layer_idx)
    if layer is not None:
        staged_key, staged_value = layer.staged
        if key is not staged_key or value is not staged_value:
            # the slot store attends over the keys the cache received; a model that changes them after
            # cache.update (repeats them per expert, re-projects them) would be served other keys
            raise UnsupportedModelError(
                f"{_where(run, module)} changes its keys or values between the cache update and the attention "
                "call (MLA models cache a compressed latent and expand it into keys afterwards), so the keys "
                "evictlayers holds are not the ones it attends over"
            )
        real = run.real_tokens(layer.store.seq_len, query.shape[2])
        out = layer.attend(query, real, **options, sinks=sinks, sentence_ends=run.sentence_ends)
    else:
        # no cache (use_cache=False): a full slot store used for this call only, so positions, rotation
        # and masking are the ones every cached step uses
        table = run.rotary[module.layer_idx] if run.rotary is not None else None
        store = SlotStore(ROLLING_FULL if table is not None else FULL, module.layer_idx, rotary=table)
        out = store.step(query, key, value, run.real_tokens(0, query.shape[2]), **options, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _refuse_unserved(run, module: torch.nn.Module, kwargs: dict) -> None:
    """Arguments of this call that would change the result and that evictlayers does not implement
    (``model_support`` refuses the models whose attention passes them; this catches them per call)."""
    if kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"{_where(run, module)}: the attention call is not causal (is_causal=False)")
    if kwargs.get("output_attentions"):
        raise UnsupportedModelError(
            f"{_where(run, module)}: output_attentions=True asks for the attention weights over the whole "
            "sequence, which an eviction cache does not hold; run without output_attentions"
        )
    packed = [name for name in ("cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(name) is not None]
    if packed:
        raise UnsupportedModelError(
            f"{_where(run, module)}: packed sequences ({', '.join(packed)}) are not supported; pad instead"
        )
    for name, meaning in REFUSED_KEYWORDS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{_where(run, module)}: the attention call passes {name}= ({meaning}), which evictlayers does "
                "not implement"
            )


def _where(run, module: torch.nn.Module) -> str:
    """``model_type=..., <Class> (layer i)``: where a refusal at run time happened."""
    return f"model_type={run.support.model_type!r}, {original_class(module).__name__} (layer {module.layer_idx})"


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, evicting_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_index_mask)
