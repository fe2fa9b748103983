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

- The bytes become float32 in ATen, not in inductor's generated code: ``codes_as_float`` is a one-line
  custom op (``codes.float()``) that the compiled step calls as an opaque kernel, and everything after
  it is float arithmetic. Inductor loads integer vectors through a copy into a stack buffer (its
  ``loadu`` with an element count has no fast path for integer types), which made its uint8 -> float
  conversion ~1.2 ns per element against ~0.1 ns for ATen's. With the op (2-core AVX2 development
  machine, one thread, ``python -m benchmarks --only decode``), compiled ``h2o_int4`` decodes at 0.89x
  the tokens/s of compiled dense ``h2o`` at 8k-token prompts, batch 8 (0.61x before), 1.02x at 4k
  batch 8 (0.63x) and 0.88x at 4k batch 1 (0.82x): BLAS on each block plus the op's ~20 us per call
  now cost about what reading the dense float32 cache does.
- The nibbles are split in float: with ``x`` a byte's value, its high nibble is ``floor(x / 16)`` and its
  low one ``x - 16 * floor(x / 16)``, written as one broadcast expression over the two halves so
  inductor fuses split, scale and zero point into one pass over the block (a ``cat`` of the halves was
  materialised first and cost another pass). Eager (not compiling), each op is its own pass whatever
  the arithmetic, and ATen's vectorised ``& 15`` and ``>> 4`` on the bytes take fewer of them; with the
  scale and zero point spread over their runs before one ``addcmul`` (below), the eager kernel ran
  1.8x (300 slots) and 2.5x (1,600 slots) faster than through the float split (one thread, batch 3,
  3 KV heads, ``python`` timing loop, four blocks; eager block counts below).
- Eager int4 keeps the two halves apart: each is unpacked into its own ``[B, H, n, D / 2]`` buffer (one
  ``addcmul`` with the scale and zero point spread to the bytes' width, no broadcast) and gets its own
  matmul, the query's halves against the keys', the values' halves side by side. Broadcasting the scale
  over a ``[n, 2, D / 2]`` stack made ATen's ``addcmul`` twice as slow as over a plain matrix; the split
  block (unpack and QK^T) took 0.8x the time of the stacked one at 107 and 320 slots (batch 8, 3 KV heads,
  ``python`` timing loop, medians of 5 interleaved rounds).
- int4 bytes are not interleaved back into channel order: a block is dequantised as ``[n, 2, D / 2]``
  (low nibbles, the even channels, then high nibbles, the odd ones), and the query's channels are
  permuted to match (the output's permuted back), since a dot product does not depend on the channel
  order. Interleaving had inductor emit a copy of every block.
- The keys' per-channel scale multiplies the query, not the keys: a factor every block read made
  inductor fuse the dequantisation of all blocks into one kernel, all their buffers alive at once,
  which is the dense copy again. The block matmuls run in float32 whatever the cache dtype (the
  reference multiplies in the cache dtype; the difference is that dtype's rounding, and CPUs offer no
  faster 16-bit matmul for these shapes).
- Deviation from a fused kernel (``triton.py`` dequantises in registers): inductor calls the BLAS matmul
  on each dequantised block, because its generated code for a reduction fused with the unpacking was
  several times slower than unpack-then-matmul (measured again with the float op: ~5x the dense attention).
- Compiled, ``SLOT_BLOCKS`` is 4: each block costs an op call and matmul calls (~20 us of overhead), which
  at small caches (4k-token prompt, batch 1) outweighed keeping a block in L2; 8k-token prompts at batch 8
  timed the same with 2, 4 or 8 blocks, 16 and 32 were slower.
- Eager, a block's ~15 ATen calls cost ~100 us whatever its size, so the count follows the cache instead:
  as many blocks as keep each block's float32 buffer under ``EAGER_BLOCK_BYTES`` (768 KiB), at most
  ``EAGER_MAX_BLOCKS``; a cache that small is one block. Same-run kernel timings (one thread, 3 KV heads,
  ``D = 64``, group 32), 1/2/4 blocks: 0.33 MiB of dense keys 0.81/1.05/1.48 ms, 0.66 MiB 1.80/2.08/3.17 ms;
  2 MiB 8.7/5.7/3.7 ms (a buffer over ~1 MiB cost several times its size: fresh pages each call); 8, 16
  blocks at 12 MiB 13.6/15.0 ms against 15.4 ms for 4.
- Tried and dropped: shifts and masks on an int32 or int16 view of the bytes inside the graph (the same
  integer loads, as slow); a float16/bfloat16 op output (ATen's uint8 -> float16 conversion is slow,
  bfloat16 no faster overall); scale and zero point kept out of the block by splitting the dot product
  per group (``q . (c * s + z) = s (q . c) + z sum(q)``), which needs a matmul per group or twice the
  query rows and cost more in BLAS than the pass it saved.

Written for ``torch.compile(fullgraph=True)`` (the decode step): compiled, the block count is a constant and the
block length ``ceil(C / SLOT_BLOCKS)`` a symbol, the last block open-ended, so a cache whose slot count
changes (a growing full cache, per-layer budgets) keeps one shape-generic graph rather than a graph per
size.
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import DecodeAttention, check_packed_inputs, no_mass, reduce_group
from evictlayers.kernels.decode.naive import slot_softmax
from evictlayers.kernels.quantization import PackedKV

SLOT_BLOCKS = 4  # compiled: blocks the code slots are unpacked in (each block's buffer is 1/4 of a dense copy)
EAGER_BLOCK_BYTES = 3 << 18  # eager: the most float32 bytes one block's keys or values take (768 KiB)...
EAGER_MAX_BLOCKS = 8  # ...in at most this many blocks (more cost more in calls than they save)

_LIB = torch.library.Library("evictlayers", "FRAGMENT")
_LIB.define("codes_as_float(Tensor codes) -> Tensor")


def _codes_as_float(codes: torch.Tensor) -> torch.Tensor:
    """``[...]`` uint8 -> ``[...]`` float32, each byte's value: ATen's vectorised conversion, kept out of
    inductor's generated loops (module docstring)."""
    return codes.float()


_LIB.impl("codes_as_float", _codes_as_float, "CPU")
torch.library.register_fake("evictlayers::codes_as_float", lambda codes: torch.empty_like(codes, dtype=torch.float32),
                            lib=_LIB)
codes_as_float = torch.ops.evictlayers.codes_as_float


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
    if torch.compiler.is_compiling():
        blocks = _blocks(n_codes, SLOT_BLOCKS)
    else:
        dense_bytes = 4 * batch * kv_heads * n_codes * max(head_dim, residual_values.shape[-1])
        blocks = _blocks(n_codes, min(EAGER_MAX_BLOCKS, max(1, -(-dense_bytes // EAGER_BLOCK_BYTES))))
    logits = []
    for block in blocks:
        # each part holds a run of channels in the codes' order: QK^T is the sum of the parts' products
        parts = _unpacked(packed.key_codes, packed.key_scale, packed.key_zero, block, packed)
        width = parts[0].shape[-1]
        logits.append(sum(torch.matmul(permuted[..., i * width:(i + 1) * width], part.transpose(-1, -2))
                          for i, part in enumerate(parts)))
    logits.append(torch.matmul(grouped, residual_keys.float().transpose(-1, -2)))
    probs, lse, scores = slot_softmax(
        torch.cat(logits, -1) * scaling, query_pos, torch.cat([key_pos, residual_pos], 2),
        softcap=softcap, sliding_window=sliding_window, score_gain=score_gain, need_mass=need_mass,
    )
    coded = probs[..., :n_codes]
    out = 0
    for block in blocks:
        block_probs = coded[..., block]  # sliced here: a comprehension closing over the symbolic slice recompiled per size
        parts = _unpacked(packed.value_codes, packed.value_scale, packed.value_zero, block, packed)
        out = out + _joined([torch.matmul(block_probs, part) for part in parts])
    out = _channel_order(out, halves) + torch.matmul(probs[..., n_codes:], residual_values.float())
    mass = (
        reduce_group(scores, gqa_reduce) if need_mass
        else no_mass(batch, kv_heads, n_codes + residual_pos.shape[-1], query.device)
    )
    return DecodeAttention(out.reshape(batch, q_heads, -1).to(query.dtype), mass, lse.reshape(batch, q_heads))


def _unpacked(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, block: slice,
              packed: PackedKV) -> list[torch.Tensor]:
    """``code * scale + zero`` (float32) of the slots ``block`` in the codes' channel order (int4: the low
    nibbles, channels ``0, 2, 4, ..``, then the high ones), as parts that cover consecutive runs of it: one
    ``[B, H, n, D]`` tensor, or eager int4 the two halves ``[B, H, n, D / 2]`` (module docstring)."""
    halves = 2 if packed.bits == 4 else 1
    per_byte = codes.shape[-1]
    compiling = torch.compiler.is_compiling()
    if halves == 2 and not compiling and packed.group % halves == 0:
        # eager: one half per ATen pass, with the scale and zero point spread over each group's run of bytes
        # (both halves of byte p are in group p // (group / 2)); broadcasting them over the halves instead
        # cost ATen about twice the pass, and each half is a plain matrix for the matmuls
        run = packed.group // halves
        block_codes = codes[:, :, block]
        spread_scale, spread_zero = (t[:, :, block].float().repeat_interleave(run, -1) for t in (scale, zero))
        return [torch.addcmul(spread_zero, half.float(), spread_scale) for half in (block_codes & 15, block_codes >> 4)]
    if halves == 2 and not compiling:
        block_codes = codes[:, :, block]
        values = torch.stack([block_codes & 15, block_codes >> 4], dim=-2).float()  # [B, H, n, 2, P]
    else:
        values = codes_as_float(codes[:, :, block])[:, :, :, None, :]  # [B, H, n, 1, P] each byte's value x
        if halves == 2:
            # [B, H, n, 2, P]: x - 16 * floor(x / 16) (low nibble), then floor(x / 16) (high nibble)
            low, high = (torch.tensor(c, device=codes.device)[:, None] for c in ([1.0, 0.0], [-16.0, 1.0]))
            values = values * low + torch.floor(values * 0.0625) * high
    scale, zero = scale[:, :, block].float(), zero[:, :, block].float()  # [B, H, n, D / group]
    if packed.group % halves == 0:
        # element (half j, byte p) is channel halves * p + j, in group p // (group / halves) for either half:
        # each half is D / group runs of group / halves elements sharing a scale (a broadcast, no gather)
        run = packed.group // halves
        if not compiling:
            # eager int8: scale and zero point spread over each group's run first (ATen took twice as long
            # broadcasting over a short inner run)
            return [torch.addcmul(zero.repeat_interleave(run, -1)[:, :, :, None, :], values,
                                  scale.repeat_interleave(run, -1)[:, :, :, None, :]).flatten(-2)]
        runs = values.unflatten(-1, (-1, run))  # [B, H, n, halves, D / group, run]
        return [torch.addcmul(zero[:, :, :, None, :, None], runs, scale[:, :, :, None, :, None]).flatten(-3)]
    # an odd group (int4 only): the halves of a byte may fall in different groups
    channel = halves * torch.arange(per_byte, device=codes.device) + torch.arange(halves, device=codes.device)[:, None]
    group = channel // packed.group  # [halves, P]
    return [(values * scale[..., group] + zero[..., group]).flatten(-2)]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along the channels; one part as it is (a ``cat`` of one tensor made dynamo
    specialise on the block length, a graph per slot count)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def _codes_order(x: torch.Tensor, halves: int) -> torch.Tensor:
    """``[..., D]`` in natural channel order -> the codes' order (``[..., halves, D / halves]`` flattened)."""
    return x.unflatten(-1, (-1, halves)).transpose(-1, -2).flatten(-2)


def _channel_order(x: torch.Tensor, halves: int) -> torch.Tensor:
    """Inverse of ``_codes_order``."""
    return x.unflatten(-1, (halves, -1)).transpose(-1, -2).flatten(-2)


def _blocks(n_slots: int, count: int) -> list[slice]:
    """``count`` consecutive slices covering ``range(n_slots)``, the last open-ended (no clamp, so no guard
    on whether the length divides evenly); a symbolic ``n_slots`` stays symbolic."""
    length = (n_slots + count - 1) // count
    return [slice(i * length, (i + 1) * length) for i in range(count - 1)] + [slice((count - 1) * length, None)]
