"""Triton prefill attention over KV slots that also returns each slot's probability mass.

Same signature and result as ``prefill/naive.py`` (the reference). The mass in two passes, or in one, and
never an ``[n, n]`` matrix:

1. a FlashAttention forward (Dao et al. 2022, Algorithm 1: online softmax over key blocks) per query
   block and query head, writing the output and the row log-sum-exp ``LSE_i = log sum_j exp(x_ij)``
   (``O(Q)`` extra memory), plus ``LSE^s_i`` of the scoring logits ``gain_i * x_ij`` when a score gain
   is given;
2. per key block and KV head, the logits are recomputed block by block and the column sums
   ``sum_i exp(x_ij - LSE_i)`` accumulated over the queries (H2O Algorithm 1 lines 8-9 add exactly
   this to the accumulated score), per query head, then reduced over the GQA group; the last
   ``keep_rows`` rows are written out reduced over the group. Without the mass (``need_mass=False``)
   this pass reads only the query blocks holding a kept row, and is not launched when none is kept. It
   runs alone as ``mass_from_lse``, from any LSE: ``prefill/fused.py`` feeds it PyTorch's attention's.

One pass (``passes=1``) computes the logits once, as ``mass_cpu.py`` does on CPU: the forward keeps each
tile's scoring probabilities ``P~ = exp(x - m(t))``, taken against the running max ``m(t)`` of its rows, in a
scratch of ``BLOCK_M x N`` floats per program; once its rows' LSE is final it reads the scratch back and adds
``sum_i P~_ij exp(m_i(t) - LSE_i)`` to each slot's mass. The programs are as many as ``max_chunk_elements``
floats of scratch allow, each taking query blocks in turn. Its column sums are added atomically (several
programs add to a slot's mass), so their order, and the last bits of the mass, can differ between calls.
``passes_for`` picks the form measured faster for a shape.

``lse_out`` is pass 1's own LSE buffer when the caller passes one, so it costs nothing.

Slots are unordered and addressed by position, so visibility is tested per (query, slot) pair; a block
pair in which no query sees any slot (the upper triangle of an ordered prompt, empty blocks, outside
the sliding window) is skipped, which halves the work of a causal prompt. That test is a branch in every
tile's loop, which keeps Triton from pipelining the loop's loads. When the slots hold consecutive
positions and the queries are the last of them (``in_order``: a whole prompt on an empty cache, or a chunk
after in-order slots; tested from ``IN_ORDER_MIN_SLOTS`` slots on), the tiles a block sees are a range
found from its indices, and the loops have no branch, so their loads pipeline (``python -m benchmarks
--only prefill_kernel`` times both forms on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from evictlayers.kernels.common import AttentionMass, check_inputs, in_order, reduce_group
from evictlayers.kernels.triton_common import (
    REDUCE_CODES,
    block_size,
    cdiv,
    dot_options,
    interpreting,
    masked_logits,
    online_update,
    visible_slots,
)


#: the most slots ``passes_for`` computes the mass of in one pass (see there)
ONE_PASS_MAX_SLOTS = 2048
#: the fewest slots for which a call tests whether they are in order (``in_order``) to run the kernels' in-order
#: loops. The test costs the host about 0.1 ms on a GPU (ten small kernels and a sync): on an H200 the attention
#: without the mass took 207-215 us at 1k-2k slots with it, 93-136 us without it, while at 8k the in-order loops
#: took it from 1,281 to 664 us (docs/benchmarks.md)
IN_ORDER_MIN_SLOTS = 4096


@triton.jit
def _in_order_visible(offs_m, offs_n, m_ok, n_ok, shift, window, HAS_WINDOW: tl.constexpr):
    """``visible_slots`` for in-order slots: query ``i`` sees slot ``j`` iff ``j <= i + shift`` (``shift = N -
    Q``) and, with a window, ``i + shift - j < window``; ``[M, N]`` from the row and slot indices alone."""
    seen = (offs_n[None, :] <= offs_m[:, None] + shift) & m_ok[:, None] & n_ok[None, :]
    if HAS_WINDOW:
        seen = seen & (offs_m[:, None] + shift - offs_n[None, :] < window)
    return seen


@triton.jit
def _forward_tile(
    q, k_at, v_at, n0, offs_n, n_ok, offs_d, offs_dv, D, DV, s_kn, s_vn, seen, gain, m_i, l_i, ms_i, ls_i, acc,
    probs_at, tile_max_at, scaling, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GAIN: tl.constexpr,
    ONE_PASS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One tile of slots for a block of query rows: the online softmax's update of ``m_i, l_i`` (and the
    gained ``ms_i, ls_i``) and ``acc``; with ``ONE_PASS`` the tile's scoring probabilities and row max to the
    scratch. ``k_at``/``v_at``: the head's key/value rows' base pointers."""
    k = tl.load(k_at + offs_n[:, None] * s_kn + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < D),
                other=0.0)
    x = masked_logits(q, k, seen, scaling, softcap, HAS_SOFTCAP, UPCAST, PRECISION)
    m_i, alpha, p, l_i = online_update(m_i, l_i, x)
    v = tl.load(v_at + offs_n[:, None] * s_vn + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    if HAS_GAIN:
        ms_i, _, p, ls_i = online_update(ms_i, ls_i, tl.where(seen, x * gain[:, None], float("-inf")))
    if ONE_PASS:
        # p was taken against the running max, read as 0 while it is -inf (its p are 0 then); the max is
        # kept as it is, -inf included, so that the rescale of the read-back is exp(-inf) = 0
        tl.store(probs_at + offs_n[None, :], p)
        if HAS_GAIN:
            tl.store(tile_max_at + (n0 // BLOCK_N) * BLOCK_M, ms_i)
        else:
            tl.store(tile_max_at + (n0 // BLOCK_N) * BLOCK_M, m_i)
    return m_i, l_i, ms_i, ls_i, acc


@triton.jit
def _scratch_tile(probs_at, tile_max_at, n0, offs_n, n_ok, offs_m, m_ok, head_mass_at, head_rows_at, Q, N, R,
                  score_sum, score_lse, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEEP_ROWS: tl.constexpr):
    """One pass's read-back of one tile: its probabilities rescaled by ``exp(m(t) - LSE)``, their column sums
    added to the head's mass, the kept rows written."""
    rescale = tl.where(score_sum > 0, tl.exp(tl.load(tile_max_at + (n0 // BLOCK_N) * BLOCK_M) - score_lse), 0.0)
    p = tl.load(probs_at + offs_n[None, :]) * rescale[:, None]
    tl.atomic_add(head_mass_at + offs_n, tl.sum(p, 0), mask=n_ok)
    if KEEP_ROWS:
        kept = offs_m - (Q - R)
        tl.store(head_rows_at + kept[:, None] * N + offs_n[None, :], p,
                 mask=(kept[:, None] >= 0) & m_ok[:, None] & n_ok[None, :])


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, gain_ptr, out_ptr, lse_ptr, lse_s_ptr,
    probs_ptr, tile_max_ptr, head_mass_ptr, head_rows_ptr,
    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
    Q, N, D, DV, R, items, m_blocks, scaling, softcap, window,
    HQ: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GAIN: tl.constexpr, IN_ORDER: tl.constexpr,
    ONE_PASS: tl.constexpr, KEEP_ROWS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Output and LSE of query blocks, one ``(query block, b * H_q + head)`` item after another: item
    ``pid``, ``pid + programs``, ... (two passes launch one program per item).

    ``IN_ORDER`` (``in_order``: slot ``j`` holds the ``j``-th of consecutive positions, the queries the last
    ``Q``): the tiles a block sees are a range found from its rows' indices, and visibility is compared by
    index; the loop then has no branch, so its loads can be pipelined. Otherwise every tile's slot positions
    are read and a tile no row sees is skipped.

    ``ONE_PASS``: each tile's scoring probabilities ``P~ = exp(s - m(t))`` and their row max ``m(t)`` go to
    this program's scratch (``probs_ptr`` ``[programs, BLOCK_M, tiles * BLOCK_N]``, ``tile_max_ptr``
    ``[programs, tiles, BLOCK_M]``); once the rows' LSE is final, the scratch is read back and each slot's
    column sum ``sum_i P~_ij * exp(m_i(t) - LSE_i)`` added to ``head_mass_ptr`` ``[B * H_q, N]`` (atomically:
    other programs add other query blocks of the head), the kept rows written to ``head_rows_ptr``
    ``[B * H_q, R, N]``.
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    width = n_tiles * BLOCK_N  # a scratch row
    shift = N - Q
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    probs_at = probs_ptr + pid.to(tl.int64) * BLOCK_M * width + offs_r[:, None] * width
    tile_max_at = tile_max_ptr + pid.to(tl.int64) * n_tiles * BLOCK_M + offs_r
    for item in range(pid, items, tl.num_programs(0)):
        mb = item % m_blocks
        bhq = (item // m_blocks).to(tl.int64)  # int64: b * batch stride overflows int32 on large caches
        b = bhq // HQ
        hq = bhq % HQ
        h = hq // G
        offs_m = mb * BLOCK_M + offs_r
        m_ok = offs_m < Q
        q = tl.load(q_ptr + b * s_qb + hq * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                    mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(k_ptr.dtype.element_ty)
        q_pos = tl.load(qpos_ptr + b * Q + offs_m, mask=m_ok, other=-1)
        gain = 0.0
        if HAS_GAIN:
            gain = tl.load(gain_ptr + b * Q + offs_m, mask=m_ok, other=0.0).to(tl.float32)
        k_at = k_ptr + b * s_kb + h * s_kh
        v_at = v_ptr + b * s_vb + h * s_vh
        pos_at = kpos_ptr + (b * (HQ // G) + h) * N
        # in order: the tiles from the first row's first visible slot to the last row's last
        first_tile = 0
        end = N
        if IN_ORDER:
            end = tl.minimum(N, tl.minimum(Q, mb * BLOCK_M + BLOCK_M) + shift)
            if HAS_WINDOW:
                first_tile = tl.maximum(mb * BLOCK_M + shift - window + 1, 0) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        ms_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        ls_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for n0 in range(first_tile, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            if IN_ORDER:
                seen = _in_order_visible(offs_m, offs_n, m_ok, n_ok, shift, window, HAS_WINDOW)
                m_i, l_i, ms_i, ls_i, acc = _forward_tile(
                    q, k_at, v_at, n0, offs_n, n_ok, offs_d, offs_dv, D, DV, s_kn, s_vn, seen, gain, m_i, l_i, ms_i,
                    ls_i, acc, probs_at, tile_max_at, scaling, softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_GAIN,
                    ONE_PASS, UPCAST, PRECISION)
            else:
                k_pos = tl.load(pos_at + offs_n, mask=n_ok, other=-1)
                seen = visible_slots(q_pos[:, None], k_pos[None, :], window, HAS_WINDOW)
                if tl.max(seen.to(tl.int32)) > 0:
                    m_i, l_i, ms_i, ls_i, acc = _forward_tile(
                        q, k_at, v_at, n0, offs_n, n_ok, offs_d, offs_dv, D, DV, s_kn, s_vn, seen, gain, m_i, l_i,
                        ms_i, ls_i, acc, probs_at, tile_max_at, scaling, softcap, BLOCK_M, BLOCK_N, HAS_SOFTCAP,
                        HAS_GAIN, ONE_PASS, UPCAST, PRECISION)

        # a row that saw nothing (padding) has acc = 0 and l = 0: output 0, LSE -inf
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * s_ob + hq * s_oh + offs_m[:, None] * s_om + offs_dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(lse_ptr + bhq * Q + offs_m, m_i + tl.log(l_i), mask=m_ok)
        if ONE_PASS:
            score_sum = l_i
            score_lse = m_i + tl.log(l_i)
            if HAS_GAIN:
                score_sum = ls_i
                score_lse = ms_i + tl.log(ls_i)
            # the scratch was written by the threads that held each logit; it is read by others
            tl.debug_barrier()
            head_mass_at = head_mass_ptr + bhq * N
            head_rows_at = head_rows_ptr + bhq * R * N
            for n0 in range(first_tile, end, BLOCK_N):  # the tiles the loop above wrote
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < N
                if IN_ORDER:
                    _scratch_tile(probs_at, tile_max_at, n0, offs_n, n_ok, offs_m, m_ok, head_mass_at, head_rows_at,
                                  Q, N, R, score_sum, score_lse, BLOCK_M, BLOCK_N, KEEP_ROWS)
                else:
                    k_pos = tl.load(pos_at + offs_n, mask=n_ok, other=-1)
                    seen = visible_slots(q_pos[:, None], k_pos[None, :], window, HAS_WINDOW)
                    if tl.max(seen.to(tl.int32)) > 0:
                        _scratch_tile(probs_at, tile_max_at, n0, offs_n, n_ok, offs_m, m_ok, head_mass_at,
                                      head_rows_at, Q, N, R, score_sum, score_lse, BLOCK_M, BLOCK_N, KEEP_ROWS)
            # the next item overwrites the scratch these threads may still be reading
            tl.debug_barrier()
        elif HAS_GAIN:
            tl.store(lse_s_ptr + bhq * Q + offs_m, ms_i + tl.log(ls_i), mask=m_ok)


@triton.jit
def _mass_rows(q_ptr, k, lse_ptr, offs_m, m_ok, offs_d, offs_g, seen, gain, head_sums, grouped, b, h, s_qb, s_qh,
               s_qm, Q, D, scaling, softcap,
               HKV: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_GAIN: tl.constexpr, KEEP_ROWS: tl.constexpr,
               NEED_MASS: tl.constexpr, REDUCE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Pass 2 for one block of query rows against the program's slots, every head of the group: the
    heads' column sums added to ``head_sums`` ``[BLOCK_G, BLOCK_N]``, the rows reduced over the group into
    ``grouped`` ``[BLOCK_M, BLOCK_N]``."""
    for g in range(G):
        hq = h * G + g
        q = tl.load(q_ptr + b * s_qb + hq * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                    mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(k.dtype)
        x = masked_logits(q, k, seen, scaling, softcap, HAS_SOFTCAP, UPCAST, PRECISION)
        if HAS_GAIN:
            x = x * gain[:, None]
        lse = tl.load(lse_ptr + (b * HKV * G + hq) * Q + offs_m, mask=m_ok, other=0.0)
        p = tl.where(seen, tl.exp(x - lse[:, None]), 0.0)
        if NEED_MASS:
            head_sums = tl.where(offs_g[:, None] == g, head_sums + tl.sum(p, 0)[None, :], head_sums)
        if KEEP_ROWS:
            if REDUCE == 2:
                grouped = tl.maximum(grouped, p)
            else:
                grouped = grouped + p
    return head_sums, grouped


@triton.jit
def _mass_kernel(
    q_ptr, k_ptr, qpos_ptr, kpos_ptr, gain_ptr, lse_ptr, mass_ptr, rows_ptr,
    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn,
    Q, N, D, R, first_m, scaling, softcap, window,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GAIN: tl.constexpr, IN_ORDER: tl.constexpr,
    KEEP_ROWS: tl.constexpr, NEED_MASS: tl.constexpr, REDUCE: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Pass 2, one program per (slot block, b * H_kv + h): column sums of the scoring probabilities
    (``NEED_MASS``) and the kept rows, over the query blocks from ``first_m`` on (``IN_ORDER``: from the first
    block that sees the program's slots to the last, with no branch in the loop). ``rows_ptr`` is zero where no
    row of a block sees the slots.

    ``lse_ptr`` holds the LSE of the scoring softmax (the model's own, or the gained one).
    """
    nb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: b * batch stride overflows int32 on large caches
    b = bh // HKV
    h = bh % HKV
    shift = N - Q
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    n_ok = offs_n < N
    k_pos = tl.load(kpos_ptr + bh * N + offs_n, mask=n_ok, other=-1)
    k = tl.load(k_ptr + b * s_kb + h * s_kh + offs_n[:, None] * s_kn + offs_d[None, :],
                mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    # per-head column sums: "max" reduces the heads' totals over all queries, not row by row
    head_sums = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    start = first_m
    end = Q
    if IN_ORDER:
        # the rows that see a slot of this block: from the first whose causal range reaches it to the last
        # whose window still holds it
        start = tl.maximum(first_m, (nb * BLOCK_N - shift) // BLOCK_M * BLOCK_M)
        if HAS_WINDOW:
            end = tl.minimum(Q, nb * BLOCK_N + BLOCK_N - 1 + window - shift)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Q
        gain = 0.0
        if HAS_GAIN:
            gain = tl.load(gain_ptr + b * Q + offs_m, mask=m_ok, other=0.0).to(tl.float32)
        grouped = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # these rows' probabilities reduced over the group
        if IN_ORDER:
            seen = _in_order_visible(offs_m, offs_n, m_ok, n_ok, shift, window, HAS_WINDOW)
            head_sums, grouped = _mass_rows(
                q_ptr, k, lse_ptr, offs_m, m_ok, offs_d, offs_g, seen, gain, head_sums, grouped, b, h, s_qb, s_qh,
                s_qm, Q, D, scaling, softcap, HKV, G, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_GAIN, KEEP_ROWS, NEED_MASS,
                REDUCE, UPCAST, PRECISION)
        else:
            q_pos = tl.load(qpos_ptr + b * Q + offs_m, mask=m_ok, other=-1)
            seen = visible_slots(q_pos[:, None], k_pos[None, :], window, HAS_WINDOW)
            if tl.max(seen.to(tl.int32)) > 0:
                head_sums, grouped = _mass_rows(
                    q_ptr, k, lse_ptr, offs_m, m_ok, offs_d, offs_g, seen, gain, head_sums, grouped, b, h, s_qb,
                    s_qh, s_qm, Q, D, scaling, softcap, HKV, G, BLOCK_M, BLOCK_N, HAS_SOFTCAP, HAS_GAIN, KEEP_ROWS,
                    NEED_MASS, REDUCE, UPCAST, PRECISION)
        if KEEP_ROWS:
            if m0 + BLOCK_M > Q - R:
                if REDUCE == 1:
                    grouped = grouped / G
                kept = offs_m - (Q - R)
                tl.store(rows_ptr + (bh * R + kept[:, None]) * N + offs_n[None, :], grouped,
                         mask=(kept[:, None] >= 0) & m_ok[:, None] & n_ok[None, :])

    if NEED_MASS:
        if REDUCE == 2:
            mass = tl.max(head_sums, 0)  # sums are >= 0, so the zero padding heads never win
        else:
            mass = tl.sum(head_sums, 0)
            if REDUCE == 1:
                mass = mass / G
        tl.store(mass_ptr + bh * N + offs_n, mass, mask=n_ok)


def attention_with_mass_triton(
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
    passes: int | None = None,
) -> AttentionMass:
    """Triton twin of ``prefill/naive.py``'s ``attention_with_mass``; see it for the arguments.

    Shapes: query ``[B, H_q, Q, D]``, key ``[B, H_kv, N, D]``, value ``[B, H_kv, N, D_v]``, query_pos
    ``[B, Q]``, key_pos ``[B, H_kv, N]``, score_gain ``[B, Q]``, lse_out ``[B, H_q, Q]``. Returns out
    ``[B, H_q, Q, D_v]``, mass ``[B, H_kv, N]`` and rows ``[B, H_kv, R, N]``.

    ``passes``: how the mass is computed, 1 or 2 (the module docstring), or ``None`` for ``passes_for``'s
    choice. Two passes hold only block tiles (extra memory ``O(B * H_q * Q)``, the LSEs); one pass holds
    ``programs x BLOCK_M x N`` floats of scratch, ``programs`` chosen to stay within ``max_chunk_elements``
    (a bound on the logits held at once), and is refused when not even one program fits.
    """
    groups = check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain,
                          lse_out=lse_out, keep_rows=keep_rows, max_chunk_elements=max_chunk_elements)
    if passes not in (None, 1, 2):
        raise ValueError(f"passes must be 1, 2 or None (the faster for the shape), got {passes!r}")
    batch, q_heads, q_len, head_dim = query.shape
    _, kv_heads, n_slots, _ = key.shape
    v_dim = value.shape[-1]
    n_rows = min(keep_rows, q_len)
    device = query.device
    block = _block()
    m_blocks = cdiv(q_len, block)
    items = m_blocks * batch * q_heads
    programs = one_pass_programs(n_slots, items, block, max_chunk_elements) if need_mass else 0
    if passes is None:
        passes = passes_for(n_slots, programs, items)
    elif passes == 1 and not programs:
        raise ValueError(
            "passes=1 needs the mass (need_mass=True) and a scratch of BLOCK_M x N floats within "
            f"max_chunk_elements: got need_mass={need_mass}, N={n_slots}, BLOCK_M={block}, "
            f"max_chunk_elements={max_chunk_elements}; use passes=2 or None"
        )
    one_pass = passes == 1
    scores = need_mass or n_rows > 0
    gained = score_gain is not None and scores  # the gained LSE is read by the scoring only
    # the kernels index the last dim with stride 1 and the position tensors densely
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    query_pos, key_pos = query_pos.contiguous(), key_pos.contiguous()
    gain = score_gain.contiguous() if gained else query_pos  # never read without a gain
    ordered = n_slots >= IN_ORDER_MIN_SLOTS and in_order(query_pos, key_pos)

    f32 = dict(dtype=torch.float32, device=device)
    out = torch.empty(batch, q_heads, q_len, v_dim, dtype=query.dtype, device=device)
    lse = lse_out if lse_out is not None and lse_out.is_contiguous() else torch.empty(batch, q_heads, q_len, **f32)
    score_lse = torch.empty(batch, q_heads, q_len, **f32) if gained and not one_pass else lse
    shared = _constexprs(groups, block, head_dim, key.dtype, softcap, sliding_window, gained, ordered, n_rows)
    common = (scaling, softcap or 1.0, sliding_window or 0)
    if one_pass:
        width = cdiv(n_slots, block) * block
        scratch = (torch.empty(programs, block, width, **f32), torch.empty(programs, width // block, block, **f32))
        head_mass = torch.zeros(batch, q_heads, n_slots, **f32)
        head_rows = torch.zeros(batch, q_heads, n_rows, n_slots, **f32)
    else:
        programs = items
        scratch, head_mass, head_rows = (out, out), out, out  # never read: the pointers fill the signature

    _forward_kernel[(programs,)](
        query, key, value, query_pos, key_pos, gain, out, lse, score_lse, *scratch, head_mass, head_rows,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
        q_len, n_slots, head_dim, v_dim, n_rows, items, m_blocks, *common,
        HQ=q_heads, BLOCK_DV=block_size(v_dim), ONE_PASS=one_pass, **shared,
    )
    if lse_out is not None and lse is not lse_out:
        lse_out.copy_(lse)
    if one_pass:
        mass = reduce_group(head_mass.view(batch, kv_heads, groups, n_slots), gqa_reduce)
        rows = reduce_group(head_rows.view(batch, kv_heads, groups, n_rows, n_slots), gqa_reduce)
        return AttentionMass(out, mass, rows)
    mass, rows = mass_from_lse(query, key, query_pos, key_pos, score_lse, scaling=scaling, softcap=softcap,
                               sliding_window=sliding_window, gqa_reduce=gqa_reduce,
                               score_gain=gain if gained else None, keep_rows=n_rows, need_mass=need_mass,
                               ordered=ordered)
    return AttentionMass(out, mass, rows)


def mass_from_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    score_lse: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    keep_rows: int = 0,
    need_mass: bool = True,
    ordered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2 alone: ``(mass [B, H_kv, N], rows [B, H_kv, R, N])`` as ``attention_with_mass_triton`` returns them,
    from the LSE of the scoring logits, whatever computed it; reads the queries and keys, never the values.

    ``score_lse`` ``[B, H_q, Q]`` float32: each query's log-sum-exp of its scoring logits over the slots it sees
    (the model's own, or gained by ``score_gain``). ``ordered``: the caller found ``in_order(query_pos,
    key_pos)``. The other arguments are ``attention_with_mass_triton``'s, already checked (``check_inputs``).
    Without the mass and kept rows nothing is launched: the mass is zeros."""
    batch, q_heads, q_len, head_dim = query.shape
    _, kv_heads, n_slots, _ = key.shape
    groups = q_heads // kv_heads
    n_rows = min(keep_rows, q_len)
    block = _block()
    f32 = dict(dtype=torch.float32, device=query.device)
    mass = (torch.empty if need_mass else torch.zeros)(batch, kv_heads, n_slots, **f32)
    # in order, the pass skips the query blocks that see none of a program's slots: their kept rows stay 0
    rows = (torch.zeros if ordered else torch.empty)(batch, kv_heads, n_rows, n_slots, **f32)
    if not (need_mass or n_rows):
        return mass, rows
    # the kernel indexes the last dim with stride 1, the positions, gain and LSE densely
    query, key = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key))
    query_pos, key_pos, score_lse = query_pos.contiguous(), key_pos.contiguous(), score_lse.contiguous()
    gain = query_pos if score_gain is None else score_gain.contiguous()  # never read without a gain
    # without the mass, the pass starts at the query block holding the first kept row
    first_m = 0 if need_mass else (q_len - n_rows) // block * block
    _mass_kernel[(cdiv(n_slots, block), batch * kv_heads)](
        query, key, query_pos, key_pos, gain, score_lse, mass, rows,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        q_len, n_slots, head_dim, n_rows, first_m, scaling, softcap or 1.0, sliding_window or 0,
        HKV=kv_heads, BLOCK_G=block_size(groups, lo=1), NEED_MASS=need_mass, REDUCE=REDUCE_CODES[gqa_reduce],
        **_constexprs(groups, block, head_dim, key.dtype, softcap, sliding_window, score_gain is not None, ordered,
                      n_rows),
    )
    return mass, rows


def _block() -> int:
    """The kernels' query and slot block size: smaller on the interpreter, which is slow."""
    return 16 if interpreting() else 64


def _constexprs(groups: int, block: int, head_dim: int, dtype: torch.dtype, softcap: float | None,
                sliding_window: int | None, gained: bool, ordered: bool, n_rows: int) -> dict:
    """The compile-time arguments both kernels take."""
    upcast, precision = dot_options(dtype)
    return dict(G=groups, BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_size(head_dim),
                HAS_SOFTCAP=softcap is not None, HAS_WINDOW=sliding_window is not None, HAS_GAIN=gained,
                IN_ORDER=ordered, KEEP_ROWS=n_rows > 0, UPCAST=upcast, PRECISION=precision)


def one_pass_programs(n_slots: int, items: int, block: int, max_chunk_elements: int) -> int:
    """How many programs the one-pass kernel runs: one per item (query block of a head), but no more than
    ``max_chunk_elements`` floats of scratch allow (``block x N`` each, ``N`` rounded up to whole tiles);
    0 when not even one fits."""
    return min(items, max_chunk_elements // (block * cdiv(n_slots, block) * block))


def passes_for(n_slots: int, programs: int, items: int) -> int:
    """1 or 2: the faster way to compute the mass over ``n_slots`` slots for a call whose one-pass kernel
    may run ``programs`` programs (0: it cannot) over ``items`` items.

    One pass when every item gets a program and the slots are at most ``ONE_PASS_MAX_SLOTS``, the rule the
    ``prefill_kernel`` benchmark (``python -m benchmarks --only prefill_kernel``, rows ``mass_one_pass`` and
    ``mass_two_passes``) supports: writing and reading the scratch costs more than recomputing the logits once
    it is large, and a program that takes several items in turn does their work one after another."""
    return 1 if programs == items and n_slots <= ONE_PASS_MAX_SLOTS else 2
