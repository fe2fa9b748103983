"""CPU prefill attention with per-slot mass, built on PyTorch's fused flash attention for CPU.

Same signature and result as ``prefill/naive.py`` (the reference). Per query chunk,
``aten._scaled_dot_product_flash_attention_for_cpu`` returns the output and each row's log-sum-exp
``LSE_i`` without materialising the probabilities; only the column sums
``sum_i exp(x_ij - LSE_i)`` (H2O Algorithm 1 lines 8-9 accumulate exactly these) are then recomputed
from one logits matmul, so the reference's softmax and probabilities-times-values matmul are not
paid for the mass. With a score gain, a second flash call on the gained queries gives the scoring
softmax its own normaliser ``LSE^s_i``. Peak extra memory is about ``B * H_q * chunk * N`` floats, as
in the reference (``max_chunk_elements`` bounds it).

GQA: the op has no grouped heads, so the queries are viewed as ``[B * H_kv, G, Q, D]`` against keys
and values expanded over the group with stride 0 (nothing is copied), and the mask is one
``[B * H_kv, 1, chunk, N]`` additive tensor broadcast over the group.
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import AttentionMass, check_inputs, reduce_group
from evictlayers.kernels.prefill.naive import attention_with_mass

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# rows of the recompute are taken a few at a time so that each thread's share of their logits stays
# in cache (~4 MB); scaled by the thread count so that more threads do not mean more, smaller ops
# (each op is a parallel region ending in a barrier, costly when the cores are shared)
_BLOCK_ELEMENTS_PER_THREAD = 1 << 20
# exp() of -inf or of a result below float32's normal range (x < -87) takes a slow scalar path in
# PyTorch's CPU kernel, ~10x slower: logits are clamped to +-80 and hidden slots zeroed afterwards.
# A visible probability below e^-80 = 1.8e-35 is read as e^-80, far under float32 resolution of a sum.
_EXP_RANGE = 80.0

def attention_with_mass_cpu(
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
    """Flash-CPU twin of ``prefill/naive.py``'s ``attention_with_mass``; see it for the arguments and shapes.

    ``need_mass=False`` (a policy whose scorers read no summed mass: key-geometry scores, windows of
    rows, no scorer at all) leaves the mass at zeros and recomputes probabilities only for the chunks
    holding one of the last ``keep_rows`` queries, so a prefill with nothing to score costs the flash
    op alone. ``lse_out`` is filled from the flash op's own log-sum-exp.

    Runs the reference when ``softcap`` is set (the flash op has no soft-capping, and a capped logit
    cannot be expressed through its additive mask) or when the value head size differs from the key's
    (the op requires equal head sizes). A float16/bfloat16 cache is converted to float32 once per call,
    as the reference does; a float32 cache is used as it is.
    """
    groups = check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain,
                          lse_out=lse_out, keep_rows=keep_rows, max_chunk_elements=max_chunk_elements)
    if softcap is not None or value.shape[-1] != key.shape[-1]:
        return attention_with_mass(
            query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap, sliding_window=sliding_window,
            gqa_reduce=gqa_reduce, score_gain=score_gain, keep_rows=keep_rows, max_chunk_elements=max_chunk_elements,
            lse_out=lse_out, need_mass=need_mass,
        )
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, n_slots = key.shape[1], key.shape[2]
    rows_of = batch * kv_heads
    n_rows = min(keep_rows, q_len)
    first_kept_row = q_len - n_rows

    queries = query.float().reshape(rows_of, groups, q_len, head_dim)
    keys = key.float().reshape(rows_of, n_slots, head_dim)
    values = value.float().reshape(rows_of, 1, n_slots, head_dim)
    # an empty slot gets a position no query reaches, so "visible" is one comparison (a padding
    # query, at -1, then sees nothing either)
    slot_pos = key_pos.masked_fill(key_pos < 0, torch.iinfo(key_pos.dtype).max).reshape(rows_of, 1, 1, n_slots)
    batch_of = torch.arange(batch, device=query.device).repeat_interleave(kv_heads)  # row -> batch index

    out = torch.empty(rows_of, groups, q_len, head_dim, dtype=torch.float32, device=query.device)
    per_head_mass = torch.zeros(rows_of, groups, n_slots, dtype=torch.float32, device=query.device)
    rows = torch.zeros(batch, kv_heads, n_rows, n_slots, dtype=torch.float32, device=query.device)
    chunk = max(1, max_chunk_elements // max(1, batch * q_heads * n_slots))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        q_pos = query_pos[batch_of, None, start:stop, None]  # [B * H_kv, 1, c, 1]
        # as in the reference: slots past the last one any query of the chunk can see are skipped
        seen_by_chunk = (key_pos >= 0) & (key_pos <= query_pos[:, start:stop].amax())
        limit = int(seen_by_chunk.any(0).any(0).nonzero().max()) + 1 if bool(seen_by_chunk.any()) else 1
        k_pos = slot_pos[..., :limit]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        bias = torch.where(visible, 0.0, float("-inf"))  # [B * H_kv, 1, c, limit], broadcast over the group
        slot_keys = keys[:, None, :limit].expand(-1, groups, -1, -1)
        slot_values = values[:, :, :limit].expand(-1, groups, -1, -1)
        chunk_queries = queries[:, :, start:stop]
        out[:, :, start:stop], lse = _FLASH(chunk_queries, slot_keys, slot_values, attn_mask=bias, scale=scaling)
        if lse_out is not None:
            # the op reports 0 for a row that sees nothing; the contract is -inf (no probability mass)
            seen = visible.any(-1).expand(-1, groups, -1)
            lse_out[:, :, start:stop] = lse.masked_fill(~seen, float("-inf")).view(batch, q_heads, stop - start)
        # without the mass, only the kept rows of the chunk are scored (none: the output is all it needs)
        skip = 0 if need_mass else max(0, first_kept_row - start)
        if start + skip >= stop:
            continue
        chunk_queries, lse, bias, visible = (t[:, :, skip:] for t in (chunk_queries, lse, bias, visible))
        if score_gain is not None:
            # gain * logit is the logit of the gained query: the op's LSE is the scoring normaliser
            chunk_queries = chunk_queries * score_gain[batch_of, None, start + skip : stop, None].float()
            _, lse = _FLASH(chunk_queries, slot_keys, slot_values, attn_mask=bias, scale=scaling)
        probs_of = _scoring_probs(chunk_queries * scaling, keys[:, :limit], lse, visible.float())
        for offset, probs in probs_of:  # [B * H_kv, G, r, limit] for the chunk's rows offset, offset + 1, ...
            if need_mass:
                per_head_mass[..., :limit] += probs.sum(dim=2)
            lo = start + skip + offset
            hi = lo + probs.shape[2]
            if hi > first_kept_row:
                kept = probs[:, :, max(0, first_kept_row - lo) :].view(batch, kv_heads, groups, -1, limit)
                rows[:, :, max(lo, first_kept_row) - first_kept_row : hi - first_kept_row, :limit] = reduce_group(
                    kept, gqa_reduce
                )

    summed = reduce_group(per_head_mass.view(batch, kv_heads, groups, n_slots), gqa_reduce)
    return AttentionMass(out.view(batch, q_heads, q_len, head_dim).to(query.dtype), summed, rows)


def _scoring_probs(queries: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor):
    """Yield ``(first row, probabilities)`` for blocks of rows: ``exp(q . k - LSE)`` on visible slots, else 0.

    Args:
        queries: ``[R, G, c, D]`` scaled (and gained) queries; keys: ``[R, n, D]``, read in place.
        lse: ``[R, G, c]`` row normalisers (whatever the op reports for a row that sees nothing: the
            clamp keeps it finite and ``visible`` zeroes the row).
        visible: ``[R, 1, c, n]`` float 0/1.
    """
    rows_of, groups, q_len, head_dim = queries.shape
    n_slots = keys.shape[1]
    step = max(1, _BLOCK_ELEMENTS_PER_THREAD * torch.get_num_threads() // (rows_of * groups * n_slots))
    for lo in range(0, q_len, step):
        hi = min(q_len, lo + step)
        logits = torch.bmm(queries[:, :, lo:hi].reshape(rows_of, -1, head_dim), keys.transpose(1, 2))
        logits = logits.view(rows_of, groups, hi - lo, n_slots).sub_(lse[:, :, lo:hi, None])
        yield lo, logits.clamp_(-_EXP_RANGE, _EXP_RANGE).exp_().mul_(visible[:, :, lo:hi])
