"""Attention of a KV-sharing layer: its own queries over what another layer's step attended over.

Gemma 3n and Gemma 4's small models compute keys and values in some layers only; each later "reuse" layer
attends with its own queries over the keys and values its source layer's cache update returned, in the same
forward. Under eviction the rule is the same: the reuse layer reads exactly the slots and tokens the source
layer's step attended over (``SlotStore.attended``, kept before the source evicts), so with nothing evicted
it computes the unmodified model's attention, and the source's policy alone decides what either layer
sees at the next step. The reusing layer holds no keys, scores nothing and evicts nothing.
"""

from __future__ import annotations

import torch

from evictlayers.kernels import apply_attention_sinks, decode_attention, prefill_attention


def attend_shared(
    attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    query: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, H_q, Q, D_v]``: each query's attention over the source step's slots.

    Args:
        attended: ``(keys [B, H_kv, N, D], values [B, H_kv, N, D_v], pos [B, H_kv, N], query_pos [B, Q])`` as the
            source layer's step kept them (``pos`` ``-1``: an empty slot; ``query_pos`` ``-1``: a padding query).
        query: ``[B, H_q, Q, D]`` the reusing layer's queries for the last ``Q`` of the step's tokens.
        sinks: ``[H_q]`` learned attention-sink logits of the reusing layer, or ``None``.
    """
    keys, values, pos, query_pos = attended
    if query.shape[2] > query_pos.shape[1] or query.shape[0] != keys.shape[0]:
        raise ValueError(
            f"a KV-sharing layer's queries {tuple(query.shape)} do not match its source layer's step "
            f"({query_pos.shape[0]} rows of {query_pos.shape[1]} tokens): the two layers did not run in one forward"
        )
    # Gemma 4 runs its reusing layers for the step's last tokens only (those whose logits are kept)
    query_pos = query_pos[:, query_pos.shape[1] - query.shape[2] :]
    if query.shape[1] % keys.shape[1]:
        raise ValueError(
            f"a KV-sharing layer has {query.shape[1]} query heads, not a multiple of its source layer's "
            f"{keys.shape[1]} key/value heads"
        )
    options = dict(scaling=scaling, softcap=softcap, sliding_window=sliding_window, need_mass=False)
    if query.shape[2] == 1:
        attention = decode_attention(query[:, :, 0], keys, values, query_pos[:, 0], pos, **options)
        out, lse = attention.out[:, :, None], attention.lse[:, :, None]
    else:
        lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device) if sinks is not None else None
        out = prefill_attention(query, keys, values, query_pos, pos, lse_out=lse, **options).out
    if sinks is not None:
        out = apply_attention_sinks(out, lse, sinks)
    return out
