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

from evictlayers.compose.positions import rotate_at, rotate_queries
from evictlayers.kernels import prefill_attention

ATTENTION_NAME = "evictlayers"


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
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    options = {"scaling": scaling, "softcap": softcap, "sliding_window": sliding_window}
    layer = run.staged_layer(module.layer_idx)
    if layer is not None:
        out = layer.attend(query, run.real_tokens(layer.store.seq_len, query.shape[2]), **options)
    else:
        # no cache (use_cache=False): plain causal attention, nothing to keep
        real = run.real_tokens(0, query.shape[2])
        if real is None:
            real = torch.ones(query.shape[0], query.shape[2], dtype=torch.bool, device=query.device)
        pos = torch.where(real, real.long().cumsum(1) - 1, -1)
        key_pos = pos[:, None, :].expand(-1, key.shape[1], -1)
        if run.rotary is not None:  # rolling positions: nothing is evicted, so each rank is its position
            table = run.rotary.rows(key.shape[2], key.device, key.dtype)
            ranks = key_pos.clamp(min=0)
            query, key = rotate_queries(query, ranks, table), rotate_at(key, ranks, table)
        out = prefill_attention(query, key, value, pos, key_pos, **options, need_mass=False).out
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, evicting_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_index_mask)
