"""Decode attention over quantised slots on CPU: the codes unpacked one block of slots at a time.

Same signature and result as ``naive.py``. The reference dequantises the whole cache into a dense copy
before attending; here the ``C`` code slots are cut into ``SLOT_BLOCKS`` blocks, and the QK loop
dequantises one block into a small buffer and multiplies it by the query before the next block is
unpacked (likewise the PV loop with the values). A block's buffer is ``B * H * C / SLOT_BLOCKS * D``
elements, so it stays in the CPU caches where the whole copy went through memory, and inductor reuses
one buffer for every block. The logits (``[B, H_kv, G, C + R]`` float32, small) are concatenated and go
through the same softmax as the naive decode (``decode/naive.py``'s ``slot_softmax``), so masking,
softcap, score gain and the GQA reduction cannot drift from the reference.

Written for ``torch.compile(fullgraph=True)`` (the decode step): the block count is a constant and the
block length ``ceil(C / SLOT_BLOCKS)`` a symbol, the last block open-ended, so a cache whose slot count
changes (a growing full cache, per-layer budgets) keeps one shape-generic graph rather than a graph per
size. Deviation from a fused kernel (``triton.py`` dequantises in registers): inductor calls the BLAS
matmul on each dequantised block, because its generated code for a reduction fused with the unpacking
was several times slower than unpack-then-matmul on the CPUs measured.
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import DecodeAttention, check_packed_inputs, no_mass, reduce_group
from evictlayers.kernels.decode.naive import slot_softmax
from evictlayers.kernels.quantization import PackedKV

SLOT_BLOCKS = 8  # blocks the code slots are unpacked in (each block's buffer is 1/8 of a dense copy)


def quantized_decode_attention_with_mass_cpu(
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
    """``naive.py``'s ``quantized_decode_attention_with_mass`` without the dense copy; see it for the arguments."""
    groups = check_packed_inputs(
        query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos,
        gqa_reduce=gqa_reduce, score_gain=score_gain,
    )
    batch, q_heads, head_dim = query.shape
    kv_heads, n_codes = key_pos.shape[1:]
    dtype = residual_keys.dtype
    grouped = query.view(batch, kv_heads, groups, head_dim).to(dtype)
    blocks = _blocks(n_codes)
    logits = [torch.matmul(grouped, packed.keys(dtype, block).transpose(-1, -2)) for block in blocks]
    logits.append(torch.matmul(grouped, residual_keys.transpose(-1, -2)))
    probs, lse, scores = slot_softmax(
        torch.cat(logits, -1).float() * scaling, query_pos, torch.cat([key_pos, residual_pos], 2),
        softcap=softcap, sliding_window=sliding_window, score_gain=score_gain, need_mass=need_mass,
    )
    weights = probs.to(dtype)
    out = torch.matmul(weights[..., n_codes:], residual_values)
    for block in blocks:
        out = out + torch.matmul(weights[..., :n_codes][..., block], packed.values(dtype, block))
    mass = (
        reduce_group(scores, gqa_reduce) if need_mass
        else no_mass(batch, kv_heads, n_codes + residual_pos.shape[-1], query.device)
    )
    return DecodeAttention(out.reshape(batch, q_heads, -1).to(query.dtype), mass, lse.reshape(batch, q_heads))


def _blocks(n_slots: int) -> list[slice]:
    """``SLOT_BLOCKS`` consecutive slices covering ``range(n_slots)``, the last open-ended (no clamp, so no
    guard on whether the length divides evenly); a symbolic ``n_slots`` stays symbolic."""
    length = (n_slots + SLOT_BLOCKS - 1) // SLOT_BLOCKS
    return [slice(i * length, (i + 1) * length) for i in range(SLOT_BLOCKS - 1)] + [
        slice((SLOT_BLOCKS - 1) * length, None)
    ]
