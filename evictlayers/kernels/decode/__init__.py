"""Decode attention (one query per row) with per-slot mass and log-sum-exp: one signature, two backends.

- ``naive.py``: ``decode_attention_with_mass``, the plain PyTorch reference; also the CPU path, since
  it compiles into the fixed-shape decode graph;
- ``triton.py``: ``decode_attention_with_mass_triton``, imported on first use only (triton reads
  ``TRITON_INTERPRET`` when a kernel is defined).

Each takes ``(query, key, value, query_pos, key_pos, *, scaling, softcap, sliding_window, gqa_reduce,
score_gain, need_mass)`` and returns ``DecodeAttention``; ``naive.py`` documents the arguments.
"""

from evictlayers.kernels.decode.naive import decode_attention_with_mass

__all__ = ["decode_attention_with_mass"]
