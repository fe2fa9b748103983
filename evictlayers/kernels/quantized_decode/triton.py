"""Triton decode attention over quantised slots: the codes dequantised in registers.

Same signature and result as ``naive.py``. The split-K flash-decoding of ``decode/triton.py`` with the
key and value tiles read as codes: each program loads a block of packed bytes, their scales and zero
points, unpacks and dequantises them in registers (``(code * scale + zero) * channel scale``, cast to the
model dtype as the reference casts its dequantised copy) and feeds ``tl.dot`` directly, so no dense copy
of the cache exists in memory: the attention kernel reads the storage's own layout and dequantises in
registers, as lmdeploy's Triton attention does for int4 caches.

int4 codes hold channel ``2p`` in the low nibble and ``2p + 1`` in the high nibble of byte ``p``
(``kernels/quantization.py``), so a key tile is two half tiles, even and odd channels, each multiplied
by the matching half of the query: ``q . k = q_even . k_even + q_odd . k_odd``; value tiles likewise give
the even and odd output channels. int8 codes are one tile.

The dense residual (KIVI's newest tokens, Liu et al. 2024) is attended by ``decode/triton.py``'s own
split kernel, as further splits after the codes' splits, and the finalise pass merges every split by
log-sum-exp and turns the cached logits into mass as it does for a dense cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from evictlayers.kernels.common import DecodeAttention, check_packed_inputs, no_mass
from evictlayers.kernels.decode.triton import Scratch, finalise, split_dense, split_plan
from evictlayers.kernels.quantization import PackedKV
from evictlayers.kernels.triton_common import (
    block_size,
    dot_options,
    interpreting,
    masked_logits,
    online_update,
    run_op,
    soft_cap,
    visible_slots,
)


@triton.jit
def _dequantized(codes_ptr, scale_ptr, zero_ptr, offs_n, offs_p, n_ok, p_ok, s_n, s_sn, s_zn,
                 HIGH: tl.constexpr, PACKED: tl.constexpr, GROUP: tl.constexpr):
    """``[BLOCK_N, BLOCK_P]`` float32 ``code * scale + zero`` of one half tile: the low nibbles (channels
    ``2p``) or the high ones (``2p + 1``) of int4 bytes, or the int8 codes themselves (channel ``p``)."""
    ok = n_ok[:, None] & p_ok[None, :]
    codes = tl.load(codes_ptr + offs_n[:, None] * s_n + offs_p[None, :], mask=ok, other=0)
    if PACKED:
        if HIGH:
            codes = codes >> 4
        else:
            codes = codes & 15
        channel = 2 * offs_p + HIGH
    else:
        channel = offs_p
    group = (channel // GROUP)[None, :]
    scale = tl.load(scale_ptr + offs_n[:, None] * s_sn + group, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + offs_n[:, None] * s_zn + group, mask=ok, other=0.0).to(tl.float32)
    return codes.to(tl.float32) * scale + zero


@triton.jit
def _query_half(q_ptr, b, h, s_qb, s_qh, offs_g, g_ok, offs_p, p_ok,
                HIGH: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr):
    """``[BLOCK_G, BLOCK_P]`` the query channels that meet one half tile (even or odd; all for int8)."""
    if PACKED:
        channel = 2 * offs_p + HIGH
    else:
        channel = offs_p
    return tl.load(q_ptr + b * s_qb + (h * G + offs_g)[:, None] * s_qh + channel[None, :],
                   mask=g_ok[:, None] & p_ok[None, :], other=0.0)


@triton.jit
def _code_split_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, kch_ptr, vc_ptr, vs_ptr, vz_ptr, qpos_ptr, kpos_ptr, gain_ptr,
    logits_ptr, m_ptr, l_ptr, ms_ptr, ls_ptr, acc_ptr,
    s_qb, s_qh, s_kcb, s_kch, s_kcn, s_ksb, s_ksh, s_ksn, s_kzb, s_kzh, s_kzn, s_chb, s_chh,
    s_vcb, s_vch, s_vcn, s_vsb, s_vsh, s_vsn, s_vzb, s_vzh, s_vzn, s_pb, s_ph,
    N, P, PV, DV, split_len, n_splits, scaling, softcap, window, row_len,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_PV: tl.constexpr, GROUP: tl.constexpr, PACKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GAIN: tl.constexpr, NEED_MASS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Pass 1 over the code slots, one program per (b * H_kv + h, split): dequantise each block in
    registers, logits to scratch (columns ``0 .. N``), split max/sum/partial output."""
    bh = tl.program_id(0).to(tl.int64)  # int64: b * batch stride overflows int32 on large caches
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    dtype = q_ptr.dtype.element_ty  # the model dtype: the reference casts its dequantised copy to it
    offs_g = tl.arange(0, BLOCK_G)
    offs_p = tl.arange(0, BLOCK_P)
    offs_pv = tl.arange(0, BLOCK_PV)
    g_ok = offs_g < G
    p_ok = offs_p < P
    pv_ok = offs_pv < PV
    q_lo = _query_half(q_ptr, b, h, s_qb, s_qh, offs_g, g_ok, offs_p, p_ok, 0, PACKED, G)
    channels = kch_ptr + b * s_chb + h * s_chh
    if PACKED:
        q_hi = _query_half(q_ptr, b, h, s_qb, s_qh, offs_g, g_ok, offs_p, p_ok, 1, PACKED, G)
        ch_lo = tl.load(channels + 2 * offs_p, mask=p_ok, other=1.0)
        ch_hi = tl.load(channels + 2 * offs_p + 1, mask=p_ok, other=1.0)
    else:
        ch_lo = tl.load(channels + offs_p, mask=p_ok, other=1.0)
    q_pos = tl.load(qpos_ptr + b)
    if HAS_GAIN:
        gain = tl.load(gain_ptr + b).to(tl.float32)
    kc = kc_ptr + b * s_kcb + h * s_kch
    ks = ks_ptr + b * s_ksb + h * s_ksh
    kz = kz_ptr + b * s_kzb + h * s_kzh
    vc = vc_ptr + b * s_vcb + h * s_vch
    vs = vs_ptr + b * s_vsb + h * s_vsh
    vz = vz_ptr + b * s_vzb + h * s_vzh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    ms_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    ls_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, BLOCK_PV], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_PV], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k_pos = tl.load(kpos_ptr + b * s_pb + h * s_ph + offs_n, mask=n_ok, other=-1)
        seen = visible_slots(q_pos, k_pos, window, HAS_WINDOW)[None, :]
        k_lo = (_dequantized(kc, ks, kz, offs_n, offs_p, n_ok, p_ok, s_kcn, s_ksn, s_kzn, 0, PACKED, GROUP)
                * ch_lo[None, :]).to(dtype)
        x = masked_logits(q_lo, k_lo, seen, scaling, softcap, False, UPCAST, PRECISION)
        if PACKED:
            k_hi = (_dequantized(kc, ks, kz, offs_n, offs_p, n_ok, p_ok, s_kcn, s_ksn, s_kzn, 1, PACKED, GROUP)
                    * ch_hi[None, :]).to(dtype)
            x += masked_logits(q_hi, k_hi, seen, scaling, softcap, False, UPCAST, PRECISION)
        if HAS_SOFTCAP:  # on the whole logit, after the halves are summed
            x = tl.where(seen, soft_cap(x, softcap), float("-inf"))
        if NEED_MASS:
            tl.store(logits_ptr + (bh * G + offs_g)[:, None] * row_len + offs_n[None, :], x,
                     mask=g_ok[:, None] & n_ok[None, :])
        m_i, alpha, p, l_i = online_update(m_i, l_i, x)
        if not UPCAST:
            p = p.to(dtype)
        v_lo = _dequantized(vc, vs, vz, offs_n, offs_pv, n_ok, pv_ok, s_vcn, s_vsn, s_vzn, 0, PACKED, GROUP).to(dtype)
        if UPCAST:
            v_lo = v_lo.to(tl.float32)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo, input_precision=PRECISION)
        if PACKED:
            v_hi = _dequantized(vc, vs, vz, offs_n, offs_pv, n_ok, pv_ok, s_vcn, s_vsn, s_vzn, 1, PACKED, GROUP).to(dtype)
            if UPCAST:
                v_hi = v_hi.to(tl.float32)
            acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi, input_precision=PRECISION)
        if HAS_GAIN:
            # gain 0 on a hidden -inf logit would be NaN: mask after multiplying
            ms_i, _, _, ls_i = online_update(ms_i, ls_i, tl.where(seen, x * gain, float("-inf")))

    stat = (bh * n_splits + split) * G + offs_g
    if PACKED:  # the even and odd output channels, interleaved back into [G, D_v]
        at = acc_ptr + stat[:, None] * DV + 2 * offs_pv[None, :]
        tl.store(at + 1, acc_hi, mask=g_ok[:, None] & pv_ok[None, :])
        acc_lo_at = at
    else:
        acc_lo_at = acc_ptr + stat[:, None] * DV + offs_pv[None, :]
    tl.store(acc_lo_at, acc_lo, mask=g_ok[:, None] & pv_ok[None, :])
    tl.store(m_ptr + stat, m_i, mask=g_ok)
    tl.store(l_ptr + stat, l_i, mask=g_ok)
    if HAS_GAIN:
        tl.store(ms_ptr + stat, ms_i, mask=g_ok)
        tl.store(ls_ptr + stat, ls_i, mask=g_ok)


def quantized_decode_attention_with_mass_triton(
    query: torch.Tensor,
    packed: PackedKV,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    residual_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    need_mass: bool = True,
) -> DecodeAttention:
    """Triton twin of ``naive.py``'s ``quantized_decode_attention_with_mass``; see it for the arguments.

    Extra memory: ``B * H_q * (C + R)`` float32 logits (none with ``need_mass=False``) plus per-split
    statistics. Traced by ``torch.compile``, the launch is the custom op
    ``torch.ops.evictlayers.quantized_decode_attention_triton`` (``torch.library.triton_op``); run eagerly, the
    same function called directly (``decode/triton.py`` says why).
    """
    check_packed_inputs(
        query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos,
        gqa_reduce=gqa_reduce, score_gain=score_gain,
    )
    out, mass, lse = run_op(
        _quantized_decode_op, _quantized_decode_launch, query, *packed[:7], residual_keys, residual_values,
        query_pos, key_pos, residual_pos, packed.bits, packed.group, scaling, softcap, sliding_window, gqa_reduce,
        score_gain, need_mass,
    )
    if not need_mass:
        batch, kv_heads, n_codes = key_pos.shape
        mass = no_mass(batch, kv_heads, n_codes + residual_pos.shape[-1], query.device)
    return DecodeAttention(out, mass, lse)


def _quantized_decode_launch(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    key_channel_scale: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    residual_pos: torch.Tensor,
    bits: int,
    group: int,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    gqa_reduce: str,
    score_gain: torch.Tensor | None,
    need_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate the scratch buffers; launch pass 1 over the codes and over the residual, then pass 2."""
    batch, q_heads, _ = query.shape
    kv_heads, n_codes = key_pos.shape[1:]
    n_residual = residual_pos.shape[-1]
    total = n_codes + n_residual
    groups = q_heads // kv_heads
    scratch_like = query  # the output keeps the query's dtype
    query = query.to(residual_keys.dtype)  # the reference multiplies in the model dtype
    # the kernels index the last dim with stride 1
    query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, residual_keys, residual_values = (
        t if t.stride(-1) == 1 else t.contiguous()
        for t in (query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, residual_keys,
                  residual_values)
    )
    key_channel_scale, query_pos, key_pos, residual_pos = (
        t.contiguous() for t in (key_channel_scale, query_pos, key_pos, residual_pos)
    )
    gain = score_gain.contiguous() if score_gain is not None else query_pos  # never read without a gain
    has_gain = score_gain is not None and need_mass  # the scoring softmax only feeds the mass
    block_n = 16 if interpreting() else 64
    code_len, code_splits = split_plan(n_codes, batch * kv_heads, block_n, query.device)
    residual_len, residual_splits = split_plan(n_residual, batch * kv_heads, block_n, query.device) if n_residual else (
        0, 0)
    splits = code_splits + residual_splits
    scratch = Scratch(scratch_like, kv_heads, total, residual_values.shape[-1], splits, need_mass)
    packed_dims = key_codes.shape[-1], value_codes.shape[-1]
    upcast, precision = dot_options(residual_keys.dtype)
    torch.library.wrap_triton(_code_split_kernel)[(batch * kv_heads, code_splits)](
        query, key_codes, key_scale, key_zero, key_channel_scale, value_codes, value_scale, value_zero,
        query_pos, key_pos, gain, *scratch.pass_one(),
        query.stride(0), query.stride(1), key_codes.stride(0), key_codes.stride(1), key_codes.stride(2),
        key_scale.stride(0), key_scale.stride(1), key_scale.stride(2),
        key_zero.stride(0), key_zero.stride(1), key_zero.stride(2),
        key_channel_scale.stride(0), key_channel_scale.stride(1),
        value_codes.stride(0), value_codes.stride(1), value_codes.stride(2),
        value_scale.stride(0), value_scale.stride(1), value_scale.stride(2),
        value_zero.stride(0), value_zero.stride(1), value_zero.stride(2), key_pos.stride(0), key_pos.stride(1),
        n_codes, *packed_dims, residual_values.shape[-1], code_len, splits, scaling, softcap or 1.0,
        sliding_window or 0, total,
        HKV=kv_heads, G=groups, BLOCK_G=block_size(groups), BLOCK_N=block_n, BLOCK_P=block_size(packed_dims[0]),
        BLOCK_PV=block_size(packed_dims[1]), GROUP=group, PACKED=bits == 4, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None, HAS_GAIN=has_gain, NEED_MASS=need_mass, UPCAST=upcast,
        PRECISION=precision,
    )
    if n_residual:
        split_dense(
            scratch, query, residual_keys, residual_values, query_pos, residual_pos, gain, scaling=scaling,
            softcap=softcap, sliding_window=sliding_window, block_n=block_n, split_len=residual_len,
            n_splits=residual_splits, slot0=n_codes, split0=code_splits, total_slots=total, total_splits=splits,
            has_gain=has_gain, need_mass=need_mass,
        )
    finalise(scratch, gain, kv_heads, total, splits, block_n=block_n, has_gain=has_gain, gqa_reduce=gqa_reduce,
             need_mass=need_mass)
    return scratch.out, scratch.mass, scratch.lse


_quantized_decode_op = torch.library.triton_op("evictlayers::quantized_decode_attention_triton", mutates_args=())(
    _quantized_decode_launch
)
