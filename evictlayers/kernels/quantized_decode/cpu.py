"""Decode attention over quantised slots on CPU: int4 codes read in registers, int8 codes one block of slots
at a time.

Same signature and result as ``naive.py``, which dequantises the whole cache into a dense copy before
attending. Here:

- int4 codes whose groups hold whole bytes (an even ``group``, every shipped recipe) go to ``int4_cpu.py``'s
  C++ ops, which dequantise the codes in registers (QK) or a tile of ~16 KB of slots at a time in L1 (PV):
  no buffer of dequantised slots beyond that tile. Without a gradient one op, ``int4_attention``, takes the
  whole step (codes and dense residual, softmax and mass); with one, ``int4_logits`` and ``int4_values`` (each
  the other's backward) and the dense residual through the dense slot ops (``decode/slots_cpu.py``).
  ``docs/benchmarks.md`` ("int4") has the decode against dense H2O.
- int8 codes, int4 with an odd group (a byte's two codes in different groups), and int4 where the ops could
  not be compiled, are cut into ``SLOT_BLOCKS`` blocks: the QK loop dequantises one block into a small buffer
  and multiplies it by the query before the next block is unpacked (likewise the PV loop with the values), so a
  block's buffer, ``1 / SLOT_BLOCKS`` of a dense copy, stays in the CPU caches where the whole copy went through
  memory.

Outside the one op, either way the logits (``[B, H_kv, G, C + R]`` float32, small) are concatenated and go
through the dense decode's softmax (``decode/slots_cpu.py``'s C++ op where the dense slot ops are built, else
``decode/naive.py``'s ``softmax_mass``), so masking, softcap, score gain and the GQA reduction cannot drift from
the dense path.

How a block is unpacked, and why:

- The bytes become float32 in ATen, not in inductor's generated code: ``codes_as_float`` is a one-line
  custom op (``codes.float()``) that the compiled step calls as an opaque kernel, and everything after
  it is float arithmetic. Inductor loads integer vectors through a copy into a stack buffer (its
  ``loadu`` with an element count has no fast path for integer types), which makes its uint8 -> float
  conversion an order of magnitude slower than ATen's. Even so, BLAS on each block plus the op's call cost
  about what reading the dense float32 cache does, which is why int4 codes skip the blocks for the C++ ops
  (``python -m benchmarks --only decode`` times ``h2o_int4`` beside the dense ``h2o``).
- The nibbles are split in float: with ``x`` a byte's value, its high nibble is ``floor(x / 16)`` and its
  low one ``x - 16 * floor(x / 16)``, written as one broadcast expression over the two halves so
  inductor fuses split, scale and zero point into one pass over the block (a ``cat`` of the halves was
  materialised first and cost another pass).
- Eager (not compiling), each op is its own pass whatever the arithmetic, and ATen's vectorised ``& 15``
  and ``>> 4`` on the bytes take fewer of them than the float split. Each nibble half is written into
  its columns of the block (one conversion, one ``addcmul``), with the scale and zero point spread to
  the bytes' width first: no operand is broadcast, which made ATen's ``addcmul`` twice as slow.
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
  several times slower than unpack-then-matmul.
- Compiled, ``SLOT_BLOCKS`` is 4: each block costs an op call and matmul calls, whose fixed overhead at
  small caches outweighs keeping a block in L2; more blocks only add that overhead at large caches.
- Eager, a block is unpacked into buffers this thread keeps between calls (``_scratch``): a fresh
  block-sized tensor each call cost page faults, several times its size over ~1 MiB. With them, a
  block's dozen ATen calls cost a fixed overhead whatever its size, so the count follows the cache: as many
  blocks as keep a block's float32 keys under ``EAGER_BLOCK_BYTES`` (2 MiB), at most
  ``EAGER_MAX_BLOCKS``: one block for small caches, where the overhead dominates, more for large ones,
  where a block that stays in cache is what counts.
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

import math
import threading

import torch

from evictlayers.kernels.common import DecodeAttention, check_packed_inputs, no_mass
from evictlayers.kernels.decode import slots_cpu
from evictlayers.kernels.decode.naive import softmax_mass
from evictlayers.kernels.quantization import PackedKV
from evictlayers.kernels.quantized_decode.int4_cpu import available, int4_attention, int4_logits, int4_values, serves

SLOT_BLOCKS = 4  # compiled: blocks the code slots are unpacked in (each block's buffer is 1/4 of a dense copy)
EAGER_BLOCK_BYTES = 2 << 20  # eager: the most float32 bytes one block's keys or values take (2 MiB)...
EAGER_MAX_BLOCKS = 16  # ...in at most this many blocks (more cost more in calls than they save)

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
    if whole_step_serves(query, packed, residual_keys, residual_values):
        return int4_decode_attention(
            query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos, None, scaling=scaling,
            softcap=softcap, sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain,
            need_mass=need_mass,
        )
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
    in_registers = serves(packed.bits, packed.group) and available()  # int4_cpu.py's ops; otherwise blocks
    if in_registers:
        blocks = []
        logits = [int4_logits(permuted, packed.key_codes, packed.key_scale, packed.key_zero)]
    else:
        if torch.compiler.is_compiling():
            blocks = _blocks(n_codes, SLOT_BLOCKS)
        else:
            dense_bytes = 4 * batch * kv_heads * n_codes * max(head_dim, residual_values.shape[-1])
            blocks = _blocks(n_codes, min(EAGER_MAX_BLOCKS, max(1, -(-dense_bytes // EAGER_BLOCK_BYTES))))
        logits = [
            torch.matmul(permuted, _unpacked(packed.key_codes, packed.key_scale, packed.key_zero, block, packed)
                         .transpose(-1, -2))
            for block in blocks
        ]
    # the dense residual through the dense slot ops (decode/slots_cpu.py) when they are built: a batched matmul of
    # G rows per KV head costs BLAS more in overhead than the ops take
    residual_ops = slots_cpu.serves(grouped, residual_keys, residual_values)
    logits.append(slots_cpu.slot_logits(grouped, residual_keys) if residual_ops
                  else torch.matmul(grouped, residual_keys.float().transpose(-1, -2)))
    softmax_of = slots_cpu.softmax_mass if residual_ops else softmax_mass
    probs, lse, mass = softmax_of(
        torch.cat(logits, -1), scaling, query_pos, torch.cat([key_pos, residual_pos], 2), softcap=softcap,
        sliding_window=sliding_window, score_gain=score_gain, need_mass=need_mass, gqa_reduce=gqa_reduce,
    )
    coded = probs[..., :n_codes]
    if in_registers:
        out = int4_values(coded, packed.value_codes, packed.value_scale, packed.value_zero)
    else:
        out = sum(
            torch.matmul(coded[..., block], _unpacked(packed.value_codes, packed.value_scale, packed.value_zero,
                                                      block, packed))
            for block in blocks
        )
    ring = probs[..., n_codes:]
    out = _channel_order(out, halves) + (slots_cpu.slot_values(ring, residual_values) if residual_ops
                                         else torch.matmul(ring, residual_values.float()))
    return DecodeAttention(out.reshape(batch, q_heads, -1).to(query.dtype), mass, lse.reshape(batch, q_heads))


def whole_step_serves(query: torch.Tensor, packed: PackedKV, residual_keys: torch.Tensor,
                      residual_values: torch.Tensor) -> bool:
    """Whether ``int4_attention`` takes the whole step: int4 codes the ops read (built), no gradient wanted (it has
    no backward; the two int4 ops do), and a residual it reads as held (float32, bfloat16 or float16 with
    contiguous channels, keys and values one dtype)."""
    return (
        serves(packed.bits, packed.group) and available()
        and not (query.requires_grad or residual_keys.requires_grad or residual_values.requires_grad)
        and residual_keys.dtype == residual_values.dtype and residual_keys.dtype in slots_cpu.SLOT_DTYPES
        and residual_keys.stride(-1) == 1 and residual_values.stride(-1) == 1
    )


def int4_decode_attention(
    query: torch.Tensor,
    packed: PackedKV,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    residual_pos: torch.Tensor,
    ring_slot: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    need_mass: bool = True,
) -> DecodeAttention:
    """The whole step in ``int4_attention`` (``whole_step_serves`` must hold); the arguments are
    ``quantized_decode_attention_with_mass_cpu``'s, plus ``ring_slot`` ``[B, H_kv, R]`` int64: ``None`` for that
    signature (the mass covers the code slots, then the residual's), or the code slot each residual entry
    overlays (``-1``: none), whose code row is then hidden and whose mass takes the entry's (mass ``[B, H_kv,
    C]``)."""
    groups = check_packed_inputs(
        query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos,
        gqa_reduce=gqa_reduce, score_gain=score_gain,
    )
    batch, q_heads, head_dim = query.shape
    kv_heads, n_codes = key_pos.shape[1:]
    grouped = query.view(batch, kv_heads, groups, head_dim).float()
    out, lse, mass = int4_attention(
        _codes_order(grouped * packed.key_channel_scale, 2), grouped, packed.key_codes, packed.key_scale,
        packed.key_zero, packed.value_codes, packed.value_scale, packed.value_zero, residual_keys, residual_values,
        key_pos, residual_pos, ring_slot, query_pos, scaling, 0.0 if softcap is None else softcap,
        -1 if sliding_window is None else sliding_window, score_gain, slots_cpu.REDUCE[gqa_reduce], need_mass,
    )
    columns = n_codes if ring_slot is not None else n_codes + residual_pos.shape[-1]
    return DecodeAttention(
        out.reshape(batch, q_heads, -1).to(query.dtype),
        mass if need_mass else no_mass(batch, kv_heads, columns, query.device), lse.reshape(batch, q_heads),
    )


def _unpacked(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, block: slice, packed: PackedKV):
    """``[B, H, n, D]`` float32 ``code * scale + zero`` of the slots ``block``, in the codes' channel order
    (int4: the low nibbles, channels ``0, 2, 4, ..``, then the high ones). Eager, it lives in this thread's
    scratch buffer: read it before the next call."""
    halves = 2 if packed.bits == 4 else 1
    per_byte = codes.shape[-1]
    if not torch.compiler.is_compiling() and packed.group % halves == 0:
        return _unpacked_eager(codes[:, :, block], scale[:, :, block], zero[:, :, block], halves,
                               packed.group // halves)
    values = codes_as_float(codes[:, :, block])[:, :, :, None, :]  # [B, H, n, 1, P] each byte's value x
    if halves == 2:
        # [B, H, n, 2, P]: x - 16 * floor(x / 16) (low nibble), then floor(x / 16) (high nibble)
        low, high = (torch.tensor(c, device=codes.device)[:, None] for c in ([1.0, 0.0], [-16.0, 1.0]))
        values = values * low + torch.floor(values * 0.0625) * high
    scale, zero = scale[:, :, block].float(), zero[:, :, block].float()  # [B, H, n, D / group]
    if packed.group % halves == 0:
        # element (half j, byte p) is channel halves * p + j, in group p // (group / halves) for either half:
        # each half is D / group runs of group / halves elements sharing a scale (a broadcast, no gather)
        runs = values.unflatten(-1, (-1, packed.group // halves))  # [B, H, n, halves, D / group, run]
        return torch.addcmul(zero[:, :, :, None, :, None], runs, scale[:, :, :, None, :, None]).flatten(-3)
    # an odd group (int4 only): the halves of a byte may fall in different groups
    channel = halves * torch.arange(per_byte, device=codes.device) + torch.arange(halves, device=codes.device)[:, None]
    group = channel // packed.group  # [halves, P]
    return (values * scale[..., group] + zero[..., group]).flatten(-2)


def _unpacked_eager(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, halves: int,
                    run: int) -> torch.Tensor:
    """Eager: ``codes`` ``[B, H, n, P]`` with ``scale``/``zero`` ``[B, H, n, P / run]`` -> ``[B, H, n, halves *
    P]`` float32 in a scratch buffer, the low nibbles' half then the high nibbles' (int4). Each half is one
    ``addcmul`` written into its columns, with the scale and zero point spread to the bytes' width (both
    nibbles of byte ``p`` are in group ``p // run``), so no operand is broadcast (module docstring)."""
    batch, heads, n_slots, per_byte = codes.shape
    shape = (batch, heads, n_slots, halves * per_byte)
    # with grad enabled, the matmul that reads the block may save it for its backward: a fresh tensor then
    unpacked = (torch.empty(shape, device=codes.device) if torch.is_grad_enabled()
                else _scratch("unpacked", shape, torch.float32, codes.device))
    spread_scale, spread_zero = (_scratch(name, codes.shape, torch.float32, codes.device) for name in ("scale", "zero"))
    for spread, values in ((spread_scale, scale), (spread_zero, zero)):
        # to float32 first, then spread (ATen's 16-bit -> float32 copy with a broadcast took twice as long)
        spread.view(*values.shape, run).copy_(values.float()[..., None].expand(*values.shape, run))
    nibbles = _scratch("nibbles", codes.shape, torch.uint8, codes.device) if halves == 2 else None
    for half in range(halves):
        if halves == 1:
            source = codes
        elif half == 0:
            source = torch.bitwise_and(codes, 15, out=nibbles)
        else:
            source = torch.bitwise_right_shift(codes, 4, out=nibbles)
        columns = unpacked[..., half * per_byte:(half + 1) * per_byte].copy_(source)
        torch.addcmul(spread_zero, columns, spread_scale, out=columns)
    return unpacked


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous ``shape`` view of this thread's buffer ``name``, kept between eager calls and grown when
    too small: a fresh block-sized tensor per call cost page faults each time (module docstring)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key, numel = (name, dtype, device), math.prod(shape)
    if key not in buffers or buffers[key].numel() < numel:
        # a normal tensor even when first needed under inference_mode, so that later calls outside it may
        # still write it (an inference tensor may only be written inside inference_mode)
        with torch.inference_mode(False):
            buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key][:numel].view(shape)


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
