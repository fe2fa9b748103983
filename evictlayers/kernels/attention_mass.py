"""Attention over unordered KV slots that also returns the probability mass each slot received.

This is the reference implementation (pure PyTorch). It is what every eviction policy scores with:
H2O's accumulated attention (Algorithm 1, lines 8-9) is the sum of these column masses over steps.
The query axis is processed in chunks, so a long prefill never materialises an ``[H, n, n]`` matrix:
the peak extra memory is ``B * H_q * chunk * N`` floats (``max_chunk_elements`` bounds it).
"""

from __future__ import annotations

import torch

GQA_REDUCTIONS = ("sum", "mean", "max")


def attention_with_mass(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    max_chunk_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over slots addressed by original position.

    Args:
        query: ``[B, H_q, Q, D]`` post-RoPE queries.
        key: ``[B, H_kv, N, D]`` slot keys (post-RoPE); ``H_q`` must be a multiple of ``H_kv`` (GQA).
        value: ``[B, H_kv, N, D_v]`` slot values.
        query_pos: ``[B, Q]`` int64 original position of each query; ``-1`` marks a padding query,
            whose output and mass are zero.
        key_pos: ``[B, H_kv, N]`` int64 original position held by each slot; ``-1`` marks an empty slot.
        scaling: logit scale (``1/sqrt(D)`` for most models).
        softcap: Gemma2-style logit soft-capping ``tanh(x / c) * c``, applied after scaling.
        sliding_window: a key is visible only if ``query_pos - key_pos < sliding_window``.
        gqa_reduce: how the query heads sharing one KV head combine their column masses:
            ``"sum"``, ``"mean"`` or ``"max"`` (max of the per-head column sums).
        max_chunk_elements: bound on the logits held at once; sets the query chunk size.

    Returns:
        ``(out, mass)``: ``out`` is ``[B, H_q, Q, D_v]`` in the query dtype; ``mass`` is
        ``[B, H_kv, N]`` float32, the attention probability each slot received, summed over the
        queries (and reduced over each GQA group).
    """
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce={gqa_reduce!r} is not one of {GQA_REDUCTIONS}")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, n_slots = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
    groups = q_heads // kv_heads

    keys = key.float()
    values = value.float()
    grouped_query = query.float().view(batch, kv_heads, groups, q_len, head_dim)
    key_valid = (key_pos >= 0)[:, :, None, None, :]
    key_pos_b = key_pos[:, :, None, None, :]

    out = torch.empty(batch, kv_heads, groups, q_len, value.shape[-1], dtype=torch.float32, device=query.device)
    per_head_mass = torch.zeros(batch, kv_heads, groups, n_slots, dtype=torch.float32, device=query.device)
    chunk = max(1, max_chunk_elements // max(1, batch * q_heads * n_slots))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        q_pos = query_pos[:, None, None, start:stop, None]
        # slots past the last one any query of the chunk can see are skipped: at prefill the slots are
        # in position order, so this halves the work of a causal prompt
        seen_by_chunk = (key_pos >= 0) & (key_pos <= query_pos[:, start:stop].amax())
        limit = int(seen_by_chunk.any(0).any(0).nonzero().max()) + 1 if bool(seen_by_chunk.any()) else 1
        logits = torch.einsum("bhgqd,bhnd->bhgqn", grouped_query[:, :, :, start:stop], keys[:, :, :limit])
        logits *= scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        hidden = ~(key_valid[..., :limit] & (key_pos_b[..., :limit] <= q_pos) & (q_pos >= 0))
        if sliding_window is not None:
            hidden |= q_pos - key_pos_b[..., :limit] >= sliding_window
        probs = torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1)
        # a query that sees no key (padding) gives a NaN row: it contributes nothing instead
        probs.nan_to_num_(0.0)
        out[:, :, :, start:stop] = torch.einsum("bhgqn,bhnd->bhgqd", probs, values[:, :, :limit])
        per_head_mass[..., :limit] += probs.sum(dim=3)

    if gqa_reduce == "sum":
        mass = per_head_mass.sum(dim=2)
    elif gqa_reduce == "mean":
        mass = per_head_mass.mean(dim=2)
    else:
        mass = per_head_mass.amax(dim=2)
    return out.view(batch, q_heads, q_len, -1).to(query.dtype), mass
