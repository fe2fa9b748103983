"""Decode attention over quantised slots (codes plus a dense residual) with per-slot mass and LSE: one
signature, three backends.

- ``naive.py``: ``quantized_decode_attention_with_mass``, the reference: dequantise, then the naive decode;
- ``cpu.py``: ``quantized_decode_attention_with_mass_cpu``: int4 codes through ``int4_cpu.py``'s C++ ops
  (``int4_cpu.cpp``, dequantised in registers, a PyTorch reference beside them), int8 codes unpacked one
  block of slots at a time;
- ``triton.py``: ``quantized_decode_attention_with_mass_triton``, the codes dequantised in registers,
  imported on first use only (triton reads ``TRITON_INTERPRET`` when a kernel is defined).

Each takes ``(query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos, *, scaling,
softcap, sliding_window, gqa_reduce, score_gain, need_mass)`` and returns ``DecodeAttention``; ``naive.py``
documents the arguments.
"""

from evictlayers.kernels.quantized_decode.cpu import quantized_decode_attention_with_mass_cpu
from evictlayers.kernels.quantized_decode.naive import quantized_decode_attention_with_mass

__all__ = ["quantized_decode_attention_with_mass", "quantized_decode_attention_with_mass_cpu"]
