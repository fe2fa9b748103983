"""Decode attention (one query per row) with per-slot mass and log-sum-exp: one signature, three backends.

- ``naive.py``: ``decode_attention_with_mass``, the plain PyTorch reference (logits once, for output and
  mass); it compiles into the fixed-shape decode graph;
- ``cpu.py``: ``decode_attention_with_mass_cpu``, PyTorch's fused flash attention for CPU when no mass is
  wanted, the naive steps with ``slots_cpu.py``'s C++ matmuls otherwise;
- ``triton.py``: ``decode_attention_with_mass_triton``, imported on first use only (triton reads
  ``TRITON_INTERPRET`` when a kernel is defined).

Each takes ``(query, key, value, query_pos, key_pos, *, scaling, softcap, sliding_window, gqa_reduce,
score_gain, need_mass)`` and returns ``DecodeAttention``; ``naive.py`` documents the arguments.
"""

from evictlayers.kernels.decode.cpu import decode_attention_with_mass_cpu
from evictlayers.kernels.decode.naive import decode_attention_with_mass

__all__ = ["decode_attention_with_mass", "decode_attention_with_mass_cpu"]
