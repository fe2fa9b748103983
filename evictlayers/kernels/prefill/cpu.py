"""CPU prefill attention with per-slot mass: one logits matmul per block of queries, for output and mass.

Same signature and result as ``prefill/naive.py`` (the reference). Three paths, by what a row needs:

- Rows whose mass is read, on slots holding their positions in order (a whole prompt, the common case),
  go to ``mass_cpu.py``'s C++ kernel: flash-style tiles whose probabilities are kept until the rows'
  normalisers are final, then summed per slot (with or without a score gain).
- Every other scored row (softcap, padding, unordered slots, the kept rows) goes through
  blocks: the queries are cut into blocks of ``r`` rows; each block takes every slot its rows can see at
  once (the causal range: slots past the last visible one are skipped), so its softmax rows are complete
  and their normalisers final. From the one ``[B * H_kv, G, r, L]`` logits block come the probabilities
  (one fused softmax), the output ``P @ V``, the column sums of ``P`` (H2O Algorithm 1 lines 8-9
  accumulate exactly these) and the kept rows; with a score gain, the scoring softmax of ``gain * logits``
  from the same logits. ``r`` is sized so that a block stays in each thread's share of the cache, and so
  that ``max_chunk_elements`` bounds the logits held at once.
- Queries whose probabilities nobody reads (``need_mass=False``, outside the last ``keep_rows``) need
  only the output: they go through PyTorch's fused flash attention for CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu``), which also reports each row's log-sum-exp,
  unless softcap or a value head size other than the key's (which the op cannot express) keeps them on
  the blocked path. A whole unpadded prompt on an empty cache takes one call with the op's own causal
  mask (as transformers' SDPA path does); any other layout (padding, older slots, a window shorter than
  the prompt) an additive mask, chunk by chunk.

The logits are never computed twice, and the peak extra memory is a few blocks: ``O(r * N)``, never
``N x N``.

GQA: the ``G`` query heads of a KV head are one ``[G * r, D]`` matrix against that head's ``[L, D]``
keys, so each key block is multiplied once per group and nothing is copied; the visibility mask is one
additive tensor broadcast over the group. It covers only the slots after those every row of the block
sees (without a sliding window, the leading slots that hold positions up to the block's lowest query
at every head), so a causal prompt masks its diagonal band, not the square left of it.
"""

from __future__ import annotations

import bisect

import torch

from evictlayers.kernels.common import AttentionMass, check_inputs, in_order, reduce_group
from evictlayers.kernels.prefill import mass_cpu

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# logits per block and thread: 2**20 float32 (4 MiB). Measured on one core at 2k-8k tokens: smaller
# blocks pay more in per-op overhead and thinner matmuls than they save in cache misses, larger ones
# fall out of the cache while the softmax, the column sums and P @ V read the block again
_BLOCK_ELEMENTS_PER_THREAD = 1 << 20


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
    """CPU twin of ``prefill/naive.py``'s ``attention_with_mass``; see it for the arguments and shapes.

    Shapes: query ``[B, H_q, Q, D]``, key ``[B, H_kv, N, D]``, value ``[B, H_kv, N, D_v]``, query_pos
    ``[B, Q]``, key_pos ``[B, H_kv, N]``, score_gain ``[B, Q]``, lse_out ``[B, H_q, Q]``. Returns out
    ``[B, H_q, Q, D_v]``, mass ``[B, H_kv, N]`` (zeros with ``need_mass=False``) and rows
    ``[B, H_kv, R, N]``. A float16/bfloat16 cache is converted to float32 once per call, as the
    reference does; a float32 cache is read in place.
    """
    groups = check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain,
                          lse_out=lse_out, keep_rows=keep_rows, max_chunk_elements=max_chunk_elements)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, n_slots, v_dim = key.shape[1], key.shape[2], value.shape[-1]
    rows_of = batch * kv_heads
    n_rows = min(keep_rows, q_len)
    first_kept_row = q_len - n_rows
    first_scored_row = 0 if need_mass else first_kept_row
    device = query.device

    queries = query.float().reshape(rows_of, groups, q_len, head_dim)
    keys = key.float().reshape(rows_of, n_slots, head_dim)
    values = value.float().reshape(rows_of, n_slots, v_dim)
    # an empty slot gets a position no query reaches, so "visible" is one comparison (a padding
    # query, at -1, then sees nothing either)
    slot_pos = key_pos.masked_fill(key_pos < 0, torch.iinfo(key_pos.dtype).max).reshape(rows_of, 1, 1, n_slots)
    row_pos = query_pos.repeat_interleave(kv_heads, dim=0)[:, None, :, None]  # [B * H_kv, 1, Q, 1]
    limits = _causal_limits(key_pos, query_pos)

    def bias_of(lo: int, hi: int, start: int, limit: int) -> torch.Tensor:
        """``[B * H_kv, 1, hi - lo, limit - start]``: 0 where query row sees slot, else -inf."""
        k_pos, q_pos = slot_pos[..., start:limit], row_pos[:, :, lo:hi]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        return torch.where(visible, 0.0, float("-inf"))

    out = torch.empty(rows_of, groups, q_len, v_dim, dtype=torch.float32, device=device)
    lse = None  # per KV head: a view of lse_out, or a buffer copied into it at the end when it is strided
    strided = lse_out is not None and not lse_out.is_contiguous()
    if strided:
        lse = torch.empty(rows_of, groups, q_len, dtype=torch.float32, device=device)
    elif lse_out is not None:
        lse = lse_out.view(rows_of, groups, q_len)
    per_head_mass = torch.zeros(rows_of, groups, n_slots, dtype=torch.float32, device=device)  # stays 0 unless needed
    rows = torch.zeros(batch, kv_heads, n_rows, n_slots, dtype=torch.float32, device=device)

    # rows nobody scores: the output (and LSE) alone, from the fused op in large chunks
    flash_rows = first_scored_row if softcap is None and v_dim == head_dim else 0
    if flash_rows and _plain_causal(query_pos, key_pos, sliding_window):
        # a whole unpadded prompt: the op's own causal mask is the slot mask, so one call without a mask
        # tensor covers every such row (the op skips the blocks above the diagonal; no row sees nothing)
        out[:, :, :flash_rows], row_lse = _FLASH(
            queries[:, :, :flash_rows], keys[:, None, :flash_rows].expand(-1, groups, -1, -1),
            values[:, None, :flash_rows].expand(-1, groups, -1, -1), is_causal=True, scale=scaling,
        )
        if lse is not None:
            lse[:, :, :flash_rows] = row_lse
        first_masked = flash_rows
    else:
        first_masked = 0
    chunk = max(1, max_chunk_elements // max(1, batch * q_heads * n_slots))
    for lo in range(first_masked, flash_rows, chunk):
        hi = min(flash_rows, lo + chunk)
        limit = limits[hi - 1]
        bias = bias_of(lo, hi, 0, limit)
        out[:, :, lo:hi], row_lse = _FLASH(
            queries[:, :, lo:hi], keys[:, None, :limit].expand(-1, groups, -1, -1),
            values[:, None, :limit].expand(-1, groups, -1, -1), attn_mask=bias, scale=scaling,
        )
        if lse is not None:
            # the op reports 0 for a row that sees nothing; the contract is -inf (no probability mass)
            lse[:, :, lo:hi] = row_lse.masked_fill(bias.amax(-1) < 0, float("-inf"))

    # each (batch, KV head) row's score gain [B * H_kv, Q], for the kernel and the blocks alike
    gains = None if score_gain is None else score_gain.float().repeat_interleave(kv_heads, dim=0)
    # rows whose mass is read, on in-order slots: the one-pass C++ kernel
    fused_rows = first_kept_row if need_mass and mass_cpu.serves(
        query_pos, key_pos, softcap=softcap, score_gain=score_gain, max_chunk_elements=max_chunk_elements) else 0
    if fused_rows:
        seen = fused_rows + n_slots - q_len  # the last fused row's slots: the prefix up to its own
        mass_cpu.prefill_mass(
            _last_dim_dense(queries[:, :, :fused_rows]), _last_dim_dense(keys[:, :seen]),
            _last_dim_dense(values[:, :seen]), gain=None if gains is None else gains[:, :fused_rows].contiguous(),
            scaling=scaling, window=sliding_window, need_mass=True,
            rows=mass_cpu.block_rows(seen, max_chunk_elements), out=out[:, :, :fused_rows],
            lse=lse[:, :, :fused_rows] if lse is not None else out.new_empty(rows_of, groups, fused_rows),
            mass=per_head_mass[..., :seen],
        )

    # every other row: one logits block per r rows, for the output, the LSE and the probabilities;
    # cap: rows x slots per block, so that a block's logits fit the cache and max_chunk_elements
    cap = max(1, min(_BLOCK_ELEMENTS_PER_THREAD * torch.get_num_threads(), max_chunk_elements) // (rows_of * groups))
    row_gain = None if gains is None else gains[:, None, :, None]
    # with a window a row's leading slots may be out of its reach: every slot is masked then
    seen_by_all = _seen_by_all(key_pos) if sliding_window is None else None
    lowest = query_pos.amin(dim=0).tolist()  # per query index, the lowest position over the batch
    lo = max(flash_rows, fused_rows)
    while lo < q_len:
        # the most rows whose block, up to the last row's limit, stays under the cap (at least one); a
        # block never straddles the first kept row, so the kept rows get the same blocks, and the same
        # bits, whether the mass is computed or not
        end = first_kept_row if lo < first_kept_row else q_len
        hi = lo + max(1, bisect.bisect_right(range(lo + 1, end + 1), cap, key=lambda h: (h - lo) * limits[h - 1]))
        limit = limits[hi - 1]
        # the leading slots every row of the block sees need no mask (a causal prompt's square left of
        # the block's diagonal)
        start = min(limit, seen_by_all(min(lowest[lo:hi]))) if seen_by_all is not None else 0
        block_out, probs = _block(
            queries[:, :, lo:hi] * scaling, keys[:, :limit], values[:, :limit], bias_of(lo, hi, start, limit),
            softcap=softcap, gain=row_gain[:, :, lo:hi] if row_gain is not None else None,
            lse_out=lse[:, :, lo:hi] if lse is not None else None,
            scored=hi > first_scored_row,
        )
        out[:, :, lo:hi] = block_out
        if probs is not None:
            if need_mass:
                per_head_mass[..., :limit] += probs.sum(dim=2)
            if hi > first_kept_row:
                kept = probs[:, :, max(0, first_kept_row - lo) :].view(batch, kv_heads, groups, -1, limit)
                rows[:, :, max(lo, first_kept_row) - first_kept_row : hi - first_kept_row, :limit] = reduce_group(
                    kept, gqa_reduce
                )
        lo = hi

    if strided:
        lse_out.copy_(lse.view(batch, q_heads, q_len))
    mass = reduce_group(per_head_mass.view(batch, kv_heads, groups, n_slots), gqa_reduce)
    return AttentionMass(out.view(batch, q_heads, q_len, v_dim).to(query.dtype), mass, rows)


def _block(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    *,
    softcap: float | None,
    gain: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    scored: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block of query rows against every slot they may see: ``(out, scoring probabilities)``.

    Args:
        queries: ``[R, G, r, D]`` scaled queries; keys ``[R, L, D]`` and values ``[R, L, D_v]``, read in place.
        bias: ``[R, 1, r, L - s]`` 0 on visible slots, -inf elsewhere, for the last ``L - s`` slots (the
            first ``s`` are visible to every row); broadcast over the group.
        gain: ``[R, 1, r, 1]`` score gain of each row, or ``None`` to score with the model's softmax.
        lse_out: ``[R, G, r]`` written with each row's log-sum-exp (-inf for a row that sees nothing).
        scored: whether the caller reads the probabilities (else the second value is ``None``).

    Returns ``out`` ``[R, G, r, D_v]`` and the probabilities ``[R, G, r, L]``, zero on hidden slots and
    on rows that see nothing.
    """
    rows_of, groups, r, head_dim = queries.shape
    limit = keys.shape[1]
    logits = torch.bmm(queries.reshape(rows_of, groups * r, head_dim), keys.transpose(1, 2))
    logits = logits.view(rows_of, groups, r, limit)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    masked = limit - bias.shape[-1]  # first slot that needs the mask
    gained = None
    if scored and gain is not None:
        # gained before masking: a gain of 0 times a hidden -inf would be NaN
        gained = logits * gain
        gained[..., masked:].add_(bias)
    logits[..., masked:].add_(bias)
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(logits, dim=-1))
    probs = torch.softmax(logits, dim=-1)
    del logits
    # a row that sees nothing (padding) is all -inf, so its softmax is NaN: it contributes nothing
    # instead. Checked on one column, since a NaN row is NaN everywhere and no other row has a NaN.
    unseen = bool(probs[..., :1].isnan().any())
    if unseen:
        probs.nan_to_num_(0.0)
    out = torch.bmm(probs.view(rows_of, groups * r, limit), values).view(rows_of, groups, r, -1)
    if not scored:
        return out, None
    if gained is not None:
        probs = torch.softmax(gained, dim=-1)
        if unseen:
            probs.nan_to_num_(0.0)
    return out, probs


def _plain_causal(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether slot ``j`` holds query ``j``'s position at every head, the positions run on by one with no
    padding, and no window hides a slot: then query ``i`` sees exactly slots ``0..i``, the flash op's
    ``is_causal`` mask (top-left aligned). A whole prompt on an empty cache is such a call."""
    q_len, n_slots = query_pos.shape[1], key_pos.shape[2]
    return (n_slots == q_len and (sliding_window is None or sliding_window >= q_len)
            and in_order(query_pos, key_pos))


def _last_dim_dense(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` itself when its last dim is contiguous (the C++ kernel's need), else a contiguous copy."""
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _seen_by_all(key_pos: torch.Tensor):
    """``f(p)``: how many leading slots hold, at every head, a position ``<= p``: all of them are visible
    to a query at ``p`` or later when no window applies. An empty slot at any head ends that prefix."""
    largest = key_pos.masked_fill(key_pos < 0, torch.iinfo(key_pos.dtype).max).flatten(0, 1).amax(dim=0)  # [N]
    prefix_max = largest.cummax(dim=0).values.tolist()
    return lambda p: bisect.bisect_right(prefix_max, p)


def _causal_limits(key_pos: torch.Tensor, query_pos: torch.Tensor) -> list[int]:
    """For each query index ``i``, how many leading slots cover every slot that queries ``0..i`` can see.

    A slot ``j`` is needed by a query at position ``p`` if some head holds a position ``<= p`` there;
    with ``m_j`` the smallest position any head holds at ``j`` or after, the slots needed up to ``p``
    are the ``j`` with ``m_j <= p``, a prefix since ``m`` is non-decreasing. At prefill the slots are
    in position order, so this skips the upper triangle of a causal prompt. Returns ``Q`` ints (at
    least 1), read on the host once per call.
    """
    big = torch.iinfo(key_pos.dtype).max
    smallest = key_pos.masked_fill(key_pos < 0, big).flatten(0, 1).amin(dim=0)  # [N]
    suffix_min = smallest.flip(0).cummin(dim=0).values.flip(0).contiguous()
    top = query_pos.amax(dim=0).cummax(dim=0).values  # highest position among queries 0..i of any row
    return torch.searchsorted(suffix_min, top, right=True).clamp(min=1).tolist()
