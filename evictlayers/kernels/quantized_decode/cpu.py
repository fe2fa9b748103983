"""Decode attention over quantised slots on CPU: the codes unpacked one block of slots at a time.

Same signature and result as ``naive.py``. The reference dequantises the whole cache into a dense copy
before attending; here the ``C`` code slots are cut into ``SLOT_BLOCKS`` blocks, and the QK loop
dequantises one block into a small buffer and multiplies it by the query before the next block is
unpacked (likewise the PV loop with the values), so a block's buffer, ``1 / SLOT_BLOCKS`` of a dense
copy, stays in the CPU caches where the whole copy went through memory. The logits (``[B, H_kv, G,
C + R]`` float32, small) are concatenated and go through the naive decode's softmax
(``decode/naive.py``'s ``slot_softmax``), so masking, softcap, score gain and the GQA reduction cannot
drift from the reference.

How a block is unpacked, and why:

- int4 bytes are not interleaved back into channel order: a block is dequantised as ``[n, 2, D / 2]``
  (low nibbles, the even channels, then high nibbles, the odd ones) in one elementwise pass, and the
  query's channels are permuted to match (the output's permuted back), since a dot product does not
  depend on the channel order. Interleaving had inductor emit a copy of every block.
- The keys' per-channel scale multiplies the query, not the keys: a factor every block read made
  inductor fuse the dequantisation of all blocks into one kernel, all their buffers alive at once,
  which is the dense copy again. The block matmuls run in float32 whatever the cache dtype (the
  reference multiplies in the cache dtype; the difference is that dtype's rounding, and CPUs offer no
  faster 16-bit matmul for these shapes).
- Deviation from a fused kernel (``triton.py`` dequantises in registers): inductor calls the BLAS matmul
  on each dequantised block, because its generated code for a reduction fused with the unpacking was
  several times slower than unpack-then-matmul on the CPUs measured.

Written for ``torch.compile(fullgraph=True)`` (the decode step): the block count is a constant and the
block length ``ceil(C / SLOT_BLOCKS)`` a symbol, the last block open-ended, so a cache whose slot count
changes (a growing full cache, per-layer budgets) keeps one shape-generic graph rather than a graph per
size.
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
    halves = 2 if packed.bits == 4 else 1
    grouped = query.view(batch, kv_heads, groups, head_dim).float()
    # the query in the codes' channel order, times the keys' channel scale ([B, H_kv, G, D])
    permuted = _codes_order(grouped * packed.key_channel_scale, halves)
    blocks = _blocks(n_codes)
    logits = [
        torch.matmul(permuted, _unpacked(packed.key_codes, packed.key_scale, packed.key_zero, block, packed)
                     .transpose(-1, -2))
        for block in blocks
    ]
    logits.append(torch.matmul(grouped, residual_keys.float().transpose(-1, -2)))
    probs, lse, scores = slot_softmax(
        torch.cat(logits, -1) * scaling, query_pos, torch.cat([key_pos, residual_pos], 2),
        softcap=softcap, sliding_window=sliding_window, score_gain=score_gain, need_mass=need_mass,
    )
    coded = probs[..., :n_codes]
    out = sum(
        torch.matmul(coded[..., block], _unpacked(packed.value_codes, packed.value_scale, packed.value_zero, block,
                                                  packed))
        for block in blocks
    )
    out = _channel_order(out, halves) + torch.matmul(probs[..., n_codes:], residual_values.float())
    mass = (
        reduce_group(scores, gqa_reduce) if need_mass
        else no_mass(batch, kv_heads, n_codes + residual_pos.shape[-1], query.device)
    )
    return DecodeAttention(out.reshape(batch, q_heads, -1).to(query.dtype), mass, lse.reshape(batch, q_heads))


def _unpacked(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, block: slice, packed: PackedKV):
    """``[B, H, n, D]`` float32 ``code * scale + zero`` of the slots ``block``, in the codes' channel order
    (int4: the low nibbles, channels ``0, 2, 4, ..``, then the high ones); one elementwise pass."""
    halves = 2 if packed.bits == 4 else 1
    per_byte = codes.shape[-1]
    shift = torch.tensor([0, 4][:halves], dtype=torch.uint8, device=codes.device)[:, None]  # [halves, 1]
    values = ((codes[:, :, block, None, :] >> shift) & (15 if halves == 2 else 255)).float()  # [B, H, n, halves, P]
    scale, zero = scale[:, :, block].float(), zero[:, :, block].float()  # [B, H, n, D / group]
    if packed.group % halves == 0:
        # element (half j, byte p) is channel halves * p + j, in group p // (group / halves) for either half:
        # each half is D / group runs of group / halves elements sharing a scale (a broadcast, no gather)
        runs = values.unflatten(-1, (-1, packed.group // halves))  # [B, H, n, halves, D / group, run]
        out = runs * scale[:, :, :, None, :, None] + zero[:, :, :, None, :, None]
        return out.flatten(-3)
    # an odd group (int4 only): the halves of a byte may fall in different groups
    channel = halves * torch.arange(per_byte, device=codes.device) + torch.arange(halves, device=codes.device)[:, None]
    group = channel // packed.group  # [halves, P]
    return (values * scale[..., group] + zero[..., group]).flatten(-2)


def _codes_order(x: torch.Tensor, halves: int) -> torch.Tensor:
    """``[..., D]`` in natural channel order -> the codes' order (``[..., halves, D / halves]`` flattened)."""
    return x.unflatten(-1, (-1, halves)).transpose(-1, -2).flatten(-2)


def _channel_order(x: torch.Tensor, halves: int) -> torch.Tensor:
    """Inverse of ``_codes_order``."""
    return x.unflatten(-1, (halves, -1)).transpose(-1, -2).flatten(-2)


def _blocks(n_slots: int) -> list[slice]:
    """``SLOT_BLOCKS`` consecutive slices covering ``range(n_slots)``, the last open-ended (no clamp, so no
    guard on whether the length divides evenly); a symbolic ``n_slots`` stays symbolic."""
    length = (n_slots + SLOT_BLOCKS - 1) // SLOT_BLOCKS
    return [slice(i * length, (i + 1) * length) for i in range(SLOT_BLOCKS - 1)] + [
        slice((SLOT_BLOCKS - 1) * length, None)
    ]
