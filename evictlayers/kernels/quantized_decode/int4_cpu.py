"""Decode attention's two matmuls straight from int4 codes on CPU: ``evictlayers::int4_logits`` and
``evictlayers::int4_values``, C++ ops (``int4_cpu.cpp``) with their PyTorch references beside them.

Why a C++ kernel. DESIGN.md asks the quantised decode to dequantise in registers. On CPU, inductor's code
for a reduction fused with the unpacking was ~5x slower than unpack-then-matmul, and unpack-then-matmul
(``cpu.py``'s blocks) writes 8 float bytes per code byte, which costs what reading a dense cache does. The
C++ loops load 8 code bytes, split the nibbles, convert them to floats in AVX2 registers and multiply them
by the query (QK) or accumulate them into the output (PV) before the next 8 are loaded: the codes are the
only cache bytes read.

The arithmetic (``PackedKV``'s layout, both ops in the codes' channel order: the ``P`` low nibbles, the
even channels, then the ``P`` high ones; byte ``p`` is in group ``p // run``, ``run = group / 2``):

- ``int4_logits(query [B, H, G, 2P] f32, codes [B, H, C, P] u8, scale, zero [B, H, C, K])`` ->
  ``[B, H, G, C]`` f32, ``q . (code * scale + zero)``, computed per group as ``scale * (q . code) + zero *
  sum(q)`` so the scale and zero point multiply once per group, not per code;
- ``int4_values(probs [B, H, G, C] f32, codes, scale, zero)`` -> ``[B, H, G, 2P]`` f32, ``sum_c probs[c] *
  (code[c] * scale[c] + zero[c])``: ``probs * scale`` weights the codes, ``probs * zero`` summed per group
  is added once at the end.

How the loops are laid out (AVX2):

- QK takes the slots in tiles of 8. Each slot's codes are unpacked into an L1-resident row and multiplied by
  each query row, one vector of 8 partial sums per group; the 8 slots' vectors of a group are summed into one
  vector by a tree of ``hadd`` (one horizontal sum per vector cost ~4x as much), so the scale, the zero point
  and the store then work on 8 slots, one per lane. Summing each slot's vector alone ran at 0.9-1.0x BLAS
  on the dense float32 keys; the tiles at 0.73-0.94x its time (8k-token prompt, batch 8, 1,639 slots, one
  thread, a noisy host).
- PV unpacks a tile of 8 slots, then for each query row keeps the output's ``2P / 8`` vectors in registers
  across the tile (a compile-time count for head dims 64, 128 and 256), so they are loaded and stored once
  per tile rather than once per slot.

The scale and zero point are read in their stored dtype (16-bit for the models' caches, any float type).
The AVX2 paths need groups of a multiple of 16 channels (8 bytes per load), and PV a head dim of 64, 128 or
256; other even groups and head dims, or a machine without AVX2, FMA and F16C, run scalar C++ loops with the same
arithmetic.

The extension is compiled on first use by ``kernels/cpu_extension.py`` (about a minute once, then cached by
torch) for the machine it runs on. ``QuantizedKV.allocate`` asks for
it when an int4 cache is made on CPU, so the build happens at prefill, not inside a decode step someone is
timing. If it cannot be built, a warning says why and the ops run their PyTorch references (correct,
slower).
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
    """The compiled module (``int4_logits``, ``int4_values``), built on the first call; ``None`` (after one
    warning) when it cannot be built."""
    return build("evictlayers_int4_cpu", SOURCE, "int4 CPU kernel",
                 "int4 decode on CPU runs the PyTorch reference instead (same results, slower)")


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


def _logits(query, codes, scale, zero):
    out = torch.empty((*codes.shape[:2], query.shape[2], codes.shape[2]), dtype=torch.float32)
    module = extension()
    if module is None:
        return out.copy_(int4_logits_reference(query, codes, scale, zero))
    module.int4_logits(query, codes, scale, zero, out)
    return out


def _values(probs, codes, scale, zero):
    out = torch.empty((*codes.shape[:2], probs.shape[2], 2 * codes.shape[3]), dtype=torch.float32)
    module = extension()
    if module is None:
        return out.copy_(int4_values_reference(probs, codes, scale, zero))
    module.int4_values(probs, codes, scale, zero, out)
    return out


# Declared here, implemented by the compiled module: the compiled decode step calls each as one opaque kernel.
_LIB = torch.library.Library("evictlayers", "FRAGMENT")
_LIB.define("int4_logits(Tensor query, Tensor codes, Tensor scale, Tensor zero) -> Tensor")
_LIB.define("int4_values(Tensor probs, Tensor codes, Tensor scale, Tensor zero) -> Tensor")
_LIB.impl("int4_logits", _logits, "CPU")
_LIB.impl("int4_values", _values, "CPU")
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
int4_logits = torch.ops.evictlayers.int4_logits
int4_values = torch.ops.evictlayers.int4_values


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
