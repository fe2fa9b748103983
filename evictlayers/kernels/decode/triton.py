"""Triton decode attention over KV slots that also returns each slot's probability mass.

Same signature and result as ``decode/naive.py`` (the reference).
Flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): the slots of each
``(b, kv head)`` are cut into splits processed in parallel; each split keeps a running max ``m_s``,
sum ``l_s = sum_j exp(x_j - m_s)`` and unnormalised output ``acc_s = sum_j exp(x_j - m_s) v_j``; the
merge uses the log-sum-exp rule ``M = max_s m_s``, ``L = sum_s l_s e^(m_s - M)``,
``out = sum_s acc_s e^(m_s - M) / L``. One program serves all ``G`` query heads of a GQA group, so
each key block is read once for the whole group.

The mass (H2O Algorithm 1 lines 8-9 accumulate it) needs the final normaliser, which only exists
after the merge. Rather than reading K a second time, pass 1 stores its float32 logits in a
``[B, H_kv, G, N]`` scratch buffer (as awslabs/keys_values does) and the finalise pass turns them into
``exp(x - LSE)`` with ``LSE = M + log L``, reduced over the group. With ``score_gain`` the scoring
softmax has its own normaliser: pass 1 keeps a second running max/sum over ``gain * x``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from evictlayers.kernels.common import DecodeAttention, check_inputs, no_mass
from evictlayers.kernels.triton_common import (
    REDUCE_CODES,
    block_size,
    cdiv,
    dot_options,
    interpreting,
    masked_logits,
    next_power_of_2,
    online_update,
    run_op,
    visible_slots,
)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, gain_ptr,
    logits_ptr, m_ptr, l_ptr, ms_ptr, ls_ptr, acc_ptr,
    s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_pb, s_ph,
    N, D, DV, split_len, n_splits, scaling, softcap, window, row_len, slot0, split0,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GAIN: tl.constexpr, NEED_MASS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Pass 1, one program per (b * H_kv + h, split): logits to scratch, split max/sum/partial output.

    The ``N`` slots are columns ``slot0 ..`` of the logits scratch rows (``row_len`` long) and their splits
    statistics entries ``split0 ..`` of ``n_splits`` per (b, h): 0, ``N`` and the split count for plain
    decode; the quantised op (``quantized_decode/triton.py``) puts its dense residual after its codes."""
    bh = tl.program_id(0).to(tl.int64)  # int64: b * batch stride overflows int32 on large caches
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    g_ok = offs_g < G
    q = tl.load(q_ptr + b * s_qb + (h * G + offs_g)[:, None] * s_qh + offs_d[None, :],
                mask=g_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(k_ptr.dtype.element_ty)
    q_pos = tl.load(qpos_ptr + b)
    if HAS_GAIN:
        gain = tl.load(gain_ptr + b).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    ms_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ls_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, N)
    split = split + split0
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k_pos = tl.load(kpos_ptr + b * s_pb + h * s_ph + offs_n, mask=n_ok, other=-1)
        seen = visible_slots(q_pos, k_pos, window, HAS_WINDOW)[None, :]
        k = tl.load(k_ptr + b * s_kb + h * s_kh + offs_n[:, None] * s_kn + offs_d[None, :],
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        x = masked_logits(q, k, seen, scaling, softcap, HAS_SOFTCAP, UPCAST, PRECISION)
        if NEED_MASS:
            tl.store(logits_ptr + (bh * G + offs_g)[:, None] * row_len + slot0 + offs_n[None, :], x,
                     mask=g_ok[:, None] & n_ok[None, :])
        m_i, alpha, p, l_i = online_update(m_i, l_i, x)
        v = tl.load(v_ptr + b * s_vb + h * s_vh + offs_n[:, None] * s_vn + offs_dv[None, :],
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if HAS_GAIN:
            # gain 0 on a hidden -inf logit would be NaN: mask after multiplying
            ms_i, _, _, ls_i = online_update(ms_i, ls_i, tl.where(seen, x * gain, float("-inf")))

    store_split_stats(m_ptr, l_ptr, ms_ptr, ls_ptr, acc_ptr, bh, split, n_splits, m_i, l_i, ms_i, ls_i, acc, DV,
                      G, BLOCK_G, BLOCK_DV, HAS_GAIN)


@triton.jit
def store_split_stats(m_ptr, l_ptr, ms_ptr, ls_ptr, acc_ptr, bh, split, n_splits, m_i, l_i, ms_i, ls_i, acc, DV,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_GAIN: tl.constexpr):
    """One split's running max/sum (and the scoring softmax's), and its unnormalised output, to scratch."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_dv = tl.arange(0, BLOCK_DV)
    g_ok = offs_g < G
    stat = (bh * n_splits + split) * G + offs_g
    tl.store(m_ptr + stat, m_i, mask=g_ok)
    tl.store(l_ptr + stat, l_i, mask=g_ok)
    if HAS_GAIN:
        tl.store(ms_ptr + stat, ms_i, mask=g_ok)
        tl.store(ls_ptr + stat, ls_i, mask=g_ok)
    tl.store(acc_ptr + stat[:, None] * DV + offs_dv[None, :], acc, mask=g_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def merged_lse(m_ptr, l_ptr, bh, n_splits, G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr):
    """Merge one (b, kv head)'s split statistics: (max M [G], L = sum_s l_s e^(m_s - M) [G], LSE [G]).

    ``M`` is read as 0 for a head that saw no slot; its ``L`` is 0 and its ``LSE`` is ``-inf``.
    """
    offs_s = tl.arange(0, BLOCK_S)
    offs_g = tl.arange(0, BLOCK_G)
    at = (bh * n_splits + offs_s[:, None]) * G + offs_g[None, :]
    ok = (offs_s[:, None] < n_splits) & (offs_g[None, :] < G)
    m = tl.load(m_ptr + at, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + at, mask=ok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(l * tl.exp(m - top[None, :]), 0)
    return top, total, top + tl.log(total)


@triton.jit
def _finalise_kernel(
    logits_ptr, m_ptr, l_ptr, ms_ptr, ls_ptr, acc_ptr, gain_ptr, out_ptr, mass_ptr, lse_ptr,
    s_ob, s_oh, N, DV, n_splits,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_GAIN: tl.constexpr, REDUCE: tl.constexpr, NEED_MASS: tl.constexpr,
):
    """Pass 2, one program per (b * H_kv + h, slot block): merge the splits (block 0 writes the
    output), then the block's stored logits become probabilities ``exp(x - LSE)`` reduced over the group.
    Without ``NEED_MASS`` the grid has one block per (b, h) and only the output and LSE are written."""
    bh = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    top, total, lse = merged_lse(m_ptr, l_ptr, bh, n_splits, G, BLOCK_S, BLOCK_G)
    if nb == 0:
        # splits one at a time: a [splits, G, D_v] tile would not fit in registers
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv[None, :] < DV
        out = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for split in range(n_splits):
            row = (bh * n_splits + split) * G + offs_g
            m_s = tl.load(m_ptr + row, mask=g_ok, other=float("-inf"))
            acc = tl.load(acc_ptr + row[:, None] * DV + offs_dv[None, :], mask=g_ok[:, None] & dv_ok, other=0.0)
            out += acc * tl.exp(m_s - top)[:, None]
        # a head that saw nothing (padding query) has acc = 0 and total = 0: its output stays 0
        out = out / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + b * s_ob + (h * G + offs_g)[:, None] * s_oh + offs_dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dv_ok)
        # the model's log-sum-exp per query head ([B, H_q] contiguous), -inf for a head that saw nothing
        tl.store(lse_ptr + bh * G + offs_g, lse, mask=g_ok)
    if NEED_MASS:
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        x = tl.load(logits_ptr + (bh * G + offs_g)[:, None] * N + offs_n[None, :],
                    mask=g_ok[:, None] & n_ok[None, :], other=float("-inf"))
        hidden = x == float("-inf")  # tested before the gain: -inf * 0 would be NaN
        if HAS_GAIN:
            _, _, lse = merged_lse(ms_ptr, ls_ptr, bh, n_splits, G, BLOCK_S, BLOCK_G)
            x = x * tl.load(gain_ptr + b).to(tl.float32)
        p = tl.where(hidden, 0.0, tl.exp(x - lse[:, None]))
        if REDUCE == 2:
            mass = tl.max(p, 0)  # probabilities are >= 0, so the zero padding heads never win
        else:
            mass = tl.sum(p, 0)
            if REDUCE == 1:
                mass = mass / G
        tl.store(mass_ptr + bh * N + offs_n, mass, mask=n_ok)


_MAX_SPLITS = 128  # the merge holds a [splits, G] tile of statistics


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(n_slots: int, rows: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(slots per split, number of splits): enough programs to fill the device, none of them empty."""
    n_blocks = cdiv(n_slots, block_n)
    if device.type == "cuda":
        target = 2 * multiprocessors(device)
    else:
        target = 8  # the interpreter: a few splits so that the merge is exercised
    splits = max(1, min(n_blocks, cdiv(target, rows), _MAX_SPLITS))
    split_len = cdiv(n_blocks, splits) * block_n
    return split_len, cdiv(n_slots, split_len)


def decode_attention_with_mass_triton(
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
    need_mass: bool = True,
) -> DecodeAttention:
    """Triton twin of ``decode/naive.py``'s ``decode_attention_with_mass``; see it for the arguments.

    Shapes: query ``[B, H_q, D]``, key ``[B, H_kv, N, D]``, value ``[B, H_kv, N, D_v]``, query_pos
    ``[B]``, key_pos ``[B, H_kv, N]``, score_gain ``[B]``. Returns out ``[B, H_q, D_v]`` (query dtype) and
    mass ``[B, H_kv, N]`` float32 and lse ``[B, H_q]`` float32. Extra memory: ``B * H_q * N`` float32 logits
    (none with ``need_mass=False``) plus per-split statistics.
    Traced by ``torch.compile``, the launch is the custom op ``torch.ops.evictlayers.decode_attention_with_mass_triton``
    (``torch.library.triton_op``), which inductor sees through; run eagerly it is the same function called
    directly (``triton_common.run_op``), without the op's dispatch layers.
    """
    check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain)
    out, mass, lse = run_op(_decode_op, _decode_launch, query, key, value, query_pos, key_pos, scaling, softcap,
                            sliding_window, gqa_reduce, score_gain, need_mass)
    return DecodeAttention(out, mass if need_mass else no_mass(*key_pos.shape, key_pos.device), lse)


class Scratch:
    """The buffers both passes share, for ``N`` slots in ``splits`` splits per (b, kv head): float32
    logits ``[B, H_kv, G, N]`` (empty without the mass), per-split max/sum of the model's and the scoring
    softmax, per-split unnormalised outputs; and the results: out (query dtype), mass, lse."""

    def __init__(self, query: torch.Tensor, kv_heads: int, n_slots: int, v_dim: int, splits: int, need_mass: bool):
        batch, q_heads, _ = query.shape
        groups = q_heads // kv_heads
        f32 = dict(dtype=torch.float32, device=query.device)
        self.logits = torch.empty(batch, kv_heads, groups, n_slots if need_mass else 0, **f32)
        self.stats = torch.empty(4, batch * kv_heads, splits, groups, **f32)  # m, l, and m, l of the scoring softmax
        self.acc = torch.empty(batch * kv_heads, splits, groups, v_dim, **f32)
        self.out = torch.empty(batch, q_heads, v_dim, dtype=query.dtype, device=query.device)
        self.mass = torch.empty(batch, kv_heads, n_slots if need_mass else 0, **f32)
        self.lse = torch.empty(batch, q_heads, **f32)

    def pass_one(self) -> tuple[torch.Tensor, ...]:
        """The split kernels' scratch arguments: logits, the four statistics, the partial outputs."""
        return self.logits, self.stats[0], self.stats[1], self.stats[2], self.stats[3], self.acc


def split_dense(
    scratch: Scratch, query, key, value, query_pos, key_pos, gain, *, scaling, softcap, sliding_window, block_n,
    split_len, n_splits, slot0, split0, total_slots, total_splits, has_gain, need_mass,
) -> None:
    """Launch pass 1 over dense slots: ``n_splits`` splits of ``split_len`` slots, written at columns
    ``slot0 ..`` of the logits and statistics entries ``split0 ..`` (``_split_kernel``)."""
    batch, kv_heads, n_slots, head_dim = key.shape
    upcast, precision = dot_options(key.dtype)
    torch.library.wrap_triton(_split_kernel)[(batch * kv_heads, n_splits)](
        query, key, value, query_pos, key_pos, gain, *scratch.pass_one(),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), key_pos.stride(0), key_pos.stride(1),
        n_slots, head_dim, value.shape[-1], split_len, total_splits, scaling, softcap or 1.0, sliding_window or 0,
        total_slots, slot0, split0,
        HKV=kv_heads, G=query.shape[1] // kv_heads, BLOCK_G=block_size(query.shape[1] // kv_heads), BLOCK_N=block_n,
        BLOCK_D=block_size(head_dim), BLOCK_DV=block_size(value.shape[-1]), HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None, HAS_GAIN=has_gain, NEED_MASS=need_mass,
        UPCAST=upcast, PRECISION=precision,
    )


def finalise(scratch: Scratch, gain, kv_heads, n_slots, n_splits, *, block_n, has_gain, gqa_reduce, need_mass) -> None:
    """Launch pass 2 (``_finalise_kernel``) over the ``n_splits`` splits of ``n_slots`` slots."""
    batch, q_heads, v_dim = scratch.out.shape
    groups = q_heads // kv_heads
    blocks = cdiv(n_slots, block_n) if need_mass else 1
    torch.library.wrap_triton(_finalise_kernel)[(batch * kv_heads, blocks)](
        scratch.logits, *scratch.stats, scratch.acc, gain, scratch.out, scratch.mass, scratch.lse,
        scratch.out.stride(0), scratch.out.stride(1), n_slots, v_dim, n_splits,
        HKV=kv_heads, G=groups, BLOCK_G=block_size(groups), BLOCK_S=next_power_of_2(n_splits), BLOCK_N=block_n,
        BLOCK_DV=block_size(v_dim), HAS_GAIN=has_gain, REDUCE=REDUCE_CODES[gqa_reduce], NEED_MASS=need_mass,
    )


def _decode_launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    gqa_reduce: str,
    score_gain: torch.Tensor | None,
    need_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the scratch buffers and launch the two passes; arguments as the public function."""
    batch, _, _ = query.shape
    _, kv_heads, n_slots, _ = key.shape
    # the kernels index the last dim with stride 1
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    query_pos, key_pos = query_pos.contiguous(), key_pos.contiguous()  # the kernels read them with stride 1
    gain = score_gain.contiguous() if score_gain is not None else query_pos  # never read without a gain
    has_gain = score_gain is not None and need_mass  # the scoring softmax only feeds the mass
    block_n = 16 if interpreting() else 64
    split_len, n_splits = split_plan(n_slots, batch * kv_heads, block_n, query.device)
    scratch = Scratch(query, kv_heads, n_slots, value.shape[-1], n_splits, need_mass)
    split_dense(
        scratch, query, key, value, query_pos, key_pos, gain, scaling=scaling, softcap=softcap,
        sliding_window=sliding_window, block_n=block_n, split_len=split_len, n_splits=n_splits, slot0=0, split0=0,
        total_slots=n_slots, total_splits=n_splits, has_gain=has_gain, need_mass=need_mass,
    )
    finalise(scratch, gain, kv_heads, n_slots, n_splits, block_n=block_n, has_gain=has_gain, gqa_reduce=gqa_reduce,
             need_mass=need_mass)
    return scratch.out, scratch.mass, scratch.lse


_decode_op = torch.library.triton_op("evictlayers::decode_attention_with_mass_triton", mutates_args=())(_decode_launch)
