"""Decode attention straight from int4 codes on CPU: its two matmuls, ``evictlayers::int4_logits`` and
``evictlayers::int4_values``, C++ kernels (``int4_cpu.cpp``) with their PyTorch references beside them, and
``evictlayers::int4_attention``, the whole step in one op.

The arithmetic (``PackedKV``'s layout, both ops in the codes' channel order: the ``P`` low nibbles, the
even channels, then the ``P`` high ones; byte ``p`` is in group ``p // run``, ``run = group / 2``):

- ``int4_logits(query [B, H, G, 2P] f32, codes [B, H, C, P] u8, scale, zero [B, H, C, K])`` ->
  ``[B, H, G, C]`` f32, ``q . (code * scale + zero)``;
- ``int4_values(probs [B, H, G, C] f32, codes, scale, zero)`` -> ``[B, H, G, 2P]`` f32, ``sum_c probs[c] *
  (code[c] * scale[c] + zero[c])``.

``probs`` may be strided (the code slots' columns of a wider row); the scale and zero point are read in their
stored dtype (16-bit for the models' caches, any float type).

``int4_attention(query_codes, query, key codes/scale/zero, value codes/scale/zero, ring_keys, ring_values,
key_pos, ring_pos, ring_slot, query_pos, scale, softcap, window, gain, reduce, need_mass)`` -> ``(out [B, H, G,
Dv], lse [B, H, G], mass)`` is ``cpu.py``'s decode for an int4 cache with its dense ring. Without ``ring_slot`` it
takes the backend signature's ``key_pos`` and ``residual_pos`` and the mass has ``C + R`` columns; with it (the
code slot each ring entry overlays, ``QuantizedSlots``' layout) it hides those slots' code rows itself and adds
the entries' mass to theirs (``[B, H, C]``), which saved the decode step the masking and folding around it. Per
(batch, KV head) the codes' logits (``int4_logits``' loops, ``query_codes`` in the codes' order) and the ring's
(``query`` in channel order) go into one scratch row of ``C + R`` floats, the decode's softmax and mass run on it
in place (``cpu_kernels.h``, as ``slot_softmax`` does), and PV over the codes (``int4_values``' loops, turned back
to channel order) and the ring makes the output. Against the ops one by one it writes no logits or probabilities
to memory, concatenates nothing, and is one call instead of five (``docs/benchmarks.md``, "Decode throughput", has
the decode against dense H2O). It has no backward: a gradient goes through the two ops.

Why a C++ kernel. An int4 cache is there to be read in fewer bytes, so the decode dequantises in registers. On
CPU, inductor's code for a reduction fused with the unpacking ran slower than unpack-then-matmul, and
unpack-then-matmul (``cpu.py``'s blocks) writes 8 float bytes per code byte, which costs what reading a dense cache
does. Here the codes are the only cache bytes read from memory, at the instruction-set level the kernel is built
for (``kernels/cpu_extension.py``):

- From ``avx512`` up (groups of a multiple of 32 channels, head dims 32, 64, 128 or 256) both products dequantise
  each slot in registers: 16 bytes are widened to 32-bit lanes in one instruction, split there into the low
  (``& 15``) and high (``>> 4``) nibbles, converted, and scaled by one FMA each. QK keeps the query rows in
  registers and feeds the 32 values straight into up to 4 rows' dot products, slots in tiles of 16 whose
  partial sums ``sum16`` reduces to one vector per row (``cpu_kernels.h``, shared with the dense slot ops); PV
  keeps every row's accumulators in registers across all slots.
- At ``avx2`` (groups of a multiple of 16 channels) QK dequantises 8 bytes at a time in registers the same way,
  slots in tiles of 8 reduced by a tree of ``hadd``; PV dequantises a tile of ~16 KB of slots into a scratch
  row that stays in L1, then runs the dense slot ops' register-blocked accumulation over it.

``python -m benchmarks --only cpu_kernel`` times both ops against the dense slot ops and ``torch.matmul``
at SmolLM2's shapes (``benchmarks/results``). Other even groups, and the ``scalar`` level, run scalar loops with the
same arithmetic.

The C++ file registers itself as the ops' CPU kernels, so a call, eager or from the compiled decode step
(the ops are opaque there, with the shapes of ``register_fake`` below), goes from the dispatcher straight to
C++. It is compiled by ``kernels/cpu_extension.py`` on first use (announced on stderr; once per machine and
level, then imported from the cache): ``QuantizedKV.allocate`` asks for it when an int4 cache is made on CPU, so
the build happens at prefill, not inside a decode step someone is timing. When it cannot be built, ``available``
is false, a warning says why, and ``cpu.py`` dequantises blocks of slots for ``torch.matmul`` instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from evictlayers.kernels.cpu_extension import build
from evictlayers.kernels.quantization import unpack_int4

SOURCE = Path(__file__).with_name("int4_cpu.cpp")


def serves(bits: int, group: int) -> bool:
    """Whether these ops read codes of ``bits`` and ``group`` (int4 whose groups hold whole bytes): the one rule
    ``cpu.py`` routes by and ``QuantizedKV.allocate`` builds the extension by."""
    return bits == 4 and group % 2 == 0


def extension():
    """The compiled module (its import registers the ops' CPU kernels), built on the first call; ``None`` (after
    one warning) when it cannot be built."""
    return build(SOURCE, "int4 CPU kernel",
                 "int4 decode on CPU dequantises blocks of slots for torch.matmul instead (same results, slower)")


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the ops have their C++ kernels (building them on the first call). A constant to the compiled
    decode step: traced once, not re-checked per step."""
    return extension() is not None


def dequantized_codes_order(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``[B, H, C, P]`` int4 codes with ``[B, H, C, K]`` scale and zero point -> ``[B, H, C, 2P]`` float32
    ``code * scale + zero`` in the codes' channel order (low nibbles, then high nibbles)."""
    run = codes.shape[-1] // scale.shape[-1]
    spread_scale, spread_zero = (t.float().repeat_interleave(run, -1) for t in (scale, zero))
    low, high = unpack_int4(codes).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.cat([low.float() * spread_scale + spread_zero, high.float() * spread_scale + spread_zero], -1)


def int4_logits_reference(query: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of ``int4_logits``: dequantise every slot, then ``query @ keys^T``."""
    return torch.matmul(query.float(), dequantized_codes_order(codes, scale, zero).transpose(-1, -2))


def int4_values_reference(probs: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of ``int4_values``: dequantise every slot, then ``probs @ values``."""
    return torch.matmul(probs.float(), dequantized_codes_order(codes, scale, zero))


# Declared here, implemented by the compiled C++ file (TORCH_LIBRARY_IMPL), which is loaded by ``extension``: the
# compiled decode step calls each as one opaque kernel.
_LIB = torch.library.Library("evictlayers", "FRAGMENT")
_LIB.define("int4_logits(Tensor query, Tensor codes, Tensor scale, Tensor zero) -> Tensor")
_LIB.define("int4_values(Tensor probs, Tensor codes, Tensor scale, Tensor zero) -> Tensor")
torch.library.register_fake(
    "evictlayers::int4_logits",
    lambda query, codes, scale, zero: query.new_empty((*codes.shape[:2], query.shape[2], codes.shape[2])),
    lib=_LIB,
)
torch.library.register_fake(
    "evictlayers::int4_values",
    lambda probs, codes, scale, zero: probs.new_empty((*codes.shape[:2], probs.shape[2], 2 * codes.shape[3])),
    lib=_LIB,
)
_LIB.define(
    "int4_attention(Tensor query_codes, Tensor query, Tensor key_codes, Tensor key_scale, Tensor key_zero, "
    "Tensor value_codes, Tensor value_scale, Tensor value_zero, Tensor ring_keys, Tensor ring_values, "
    "Tensor key_pos, Tensor ring_pos, Tensor? ring_slot, Tensor query_pos, float scale, float softcap, int window, "
    "Tensor? gain, int reduce, bool need_mass) -> (Tensor, Tensor, Tensor)"
)


def _attention_shapes(query_codes, query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero,
                      ring_keys, ring_values, key_pos, ring_pos, ring_slot, query_pos, scale, softcap, window, gain,
                      reduce, need_mass):
    batch, heads, slots = key_codes.shape[:3]
    held = slots if ring_slot is not None else slots + ring_keys.shape[2]
    return (
        query.new_empty((batch, heads, query.shape[2], 2 * value_codes.shape[3])),
        query.new_empty((batch, heads, query.shape[2])),
        query.new_empty((batch, heads, held if need_mass else 0)),
    )


torch.library.register_fake("evictlayers::int4_attention", _attention_shapes, lib=_LIB)
int4_logits = torch.ops.evictlayers.int4_logits
int4_values = torch.ops.evictlayers.int4_values
int4_attention = torch.ops.evictlayers.int4_attention


def _keep_codes(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:])


# Each op's gradient is the other op on the same codes: d(q . k_c)/dq summed with the incoming gradient over c
# is a probability-weighted sum of keys (int4_values), and d(sum_c p_c v_c)/dp_c = grad . v_c (int4_logits).
# The codes, scales and zero points get none (they are stored integers and constants).
torch.library.register_autograd(
    "evictlayers::int4_logits",
    lambda ctx, grad: (int4_values(grad.contiguous(), *ctx.saved_tensors), None, None, None),
    setup_context=_keep_codes, lib=_LIB,
)
torch.library.register_autograd(
    "evictlayers::int4_values",
    lambda ctx, grad: (int4_logits(grad.contiguous(), *ctx.saved_tensors), None, None, None),
    setup_context=_keep_codes, lib=_LIB,
)
