"""Prefill attention with per-slot mass, the plain PyTorch reference every other backend is tested against.

It is what every eviction policy scores with: H2O's accumulated attention (Algorithm 1, lines 8-9) is
the sum of these column masses over steps; AhaKV's recent accumulation (Eq. 5) and Scissorhands'
low-score counter (Algorithm 2) read the last query rows individually (``keep_rows``); AhaKV's
SG-softmax (Eq. 9) scores with re-scaled logits (``score_gain``) while the output keeps the model's
own softmax. The query axis is processed in chunks, so a long prefill never materialises an
``[H, n, n]`` matrix: the peak extra memory is about ``B * H_q * chunk * N`` floats
(``max_chunk_elements`` bounds it).
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import AttentionMass, check_inputs, reduce_group


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
    score_gain: torch.Tensor | None = None,
    keep_rows: int = 0,
    max_chunk_elements: int = 1 << 24,
    lse_out: torch.Tensor | None = None,
    need_mass: bool = True,
) -> AttentionMass:
    """Causal attention over slots addressed by original position (the prefill signature of every backend).

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
        gqa_reduce: how the query heads sharing one KV head combine their probabilities:
            ``"sum"``, ``"mean"`` or ``"max"`` (for ``mass``: max of the per-head column sums).
        score_gain: ``[B, Q]`` factor on the model's (scaled, soft-capped) logits for the scoring
            softmax only; ``None`` scores with the model's own probabilities. A gain of 0 scores
            uniformly over the visible slots.
        keep_rows: also return the scoring probabilities of the last ``keep_rows`` queries.
        max_chunk_elements: bound on the logits held at once; sets the query chunk size.
        lse_out: optional ``[B, H_q, Q]`` float32 tensor, filled in place with each query's log-sum-exp
            of the model's (scaled, soft-capped) logits over the slots it sees, ``-inf`` when it sees
            none. An out-argument so that the return value stays what every caller unpacks; the slot
            store uses it to merge a ``ClusterSketch`` into a multi-token step, and to apply learned
            attention sinks.
        need_mass: ``False`` when the caller reads no summed mass: ``mass`` comes back as zeros and
            the scoring probabilities are computed only for the chunks holding a kept row.
    """
    groups = check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain,
                          lse_out=lse_out, keep_rows=keep_rows, max_chunk_elements=max_chunk_elements)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, n_slots = key.shape[1], key.shape[2]
    n_rows = min(keep_rows, q_len)
    first_kept_row = q_len - n_rows

    keys = key.float()
    values = value.float()
    grouped_query = query.float().view(batch, kv_heads, groups, q_len, head_dim)
    key_valid = (key_pos >= 0)[:, :, None, None, :]
    key_pos_b = key_pos[:, :, None, None, :]

    out = torch.empty(batch, kv_heads, groups, q_len, value.shape[-1], dtype=torch.float32, device=query.device)
    per_head_mass = torch.zeros(batch, kv_heads, groups, n_slots, dtype=torch.float32, device=query.device)
    rows = torch.zeros(batch, kv_heads, n_rows, n_slots, dtype=torch.float32, device=query.device)
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
        score_logits = None
        if score_gain is not None:
            score_logits = logits * score_gain[:, None, None, start:stop, None].float()
        probs = torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1)
        if lse_out is not None:
            lse_out[:, :, start:stop] = torch.logsumexp(logits, dim=-1).view(batch, q_heads, stop - start)
        # a query that sees no key (padding) gives a NaN row: it contributes nothing instead
        probs.nan_to_num_(0.0)
        out[:, :, :, start:stop] = torch.einsum("bhgqn,bhnd->bhgqd", probs, values[:, :, :limit])
        keeps_rows = stop > first_kept_row
        if not (need_mass or keeps_rows):
            continue
        if score_logits is not None:
            probs = torch.softmax(score_logits.masked_fill_(hidden, float("-inf")), dim=-1).nan_to_num_(0.0)
        if need_mass:
            per_head_mass[..., :limit] += probs.sum(dim=3)
        if keeps_rows:
            lo = max(start, first_kept_row)
            rows[:, :, lo - first_kept_row : stop - first_kept_row, :limit] = reduce_group(
                probs[:, :, :, lo - start :], gqa_reduce
            )

    mass = reduce_group(per_head_mass, gqa_reduce)
    return AttentionMass(out.view(batch, q_heads, q_len, -1).to(query.dtype), mass, rows)
