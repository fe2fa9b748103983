"""Prefill attention with per-slot mass: one signature, four backends.

- ``naive.py``: ``attention_with_mass``, the plain PyTorch reference (any device);
- ``cpu.py``: ``attention_with_mass_cpu``, output, probabilities and column sums from one logits block per
  block of query rows (the fused flash op for rows nobody scores);
- ``triton.py``: ``attention_with_mass_triton``, imported on first use only (triton reads
  ``TRITON_INTERPRET`` when a kernel is defined);
- ``fused.py``: ``attention_with_mass_fused``, on CUDA: the output and each row's LSE from PyTorch's fused
  attention (cuDNN, FlashAttention-2) for a causal prompt in slot order, then the mass from ``triton.py``'s
  mass pass; any other inputs go to ``attention_with_mass_triton``.

Each takes ``(query, key, value, query_pos, key_pos, *, scaling, softcap, sliding_window, gqa_reduce,
score_gain, keep_rows, max_chunk_elements, lse_out, need_mass)`` and returns ``AttentionMass``;
``naive.py`` documents the arguments.
"""

from evictlayers.kernels.prefill.cpu import attention_with_mass_cpu
from evictlayers.kernels.prefill.naive import attention_with_mass

__all__ = ["attention_with_mass", "attention_with_mass_cpu"]
