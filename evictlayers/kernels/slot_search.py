"""Where a decode step's new token goes: each head's first free slot. A PyTorch reference here and, on CPU, the C++
op ``evictlayers::first_free_slot`` (``decode/slots_cpu.cpp``), which serves where it is built.

Why C++: inductor compiles ``(pos < 0).int().argmax(-1)`` into an argmax reduction that carries indices through
int64 comparisons, a kernel-level profile's second-largest cost of the compiled H2O layer step after the products
and the softmax (~0.13-0.2 ms per layer call at SmolLM2's shape with 1,639 slots, batch 8); the op is a
``find_if`` per head over its row. Eviction's own search (the lowest held slot, ``compose/eviction.py``) stays
inductor's: as an op it was faster on its own, but the layer step did not gain, the priorities then being written
out for it instead of staying in the kernel that computes them.
"""

from __future__ import annotations

import torch

from evictlayers.kernels.decode import slots_cpu


def first_free_slot_reference(pos: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` int64: each head's first free slot (``pos < 0``) of ``pos`` ``[B, H, N]``; 0 when none is free."""
    return (pos < 0).int().argmax(-1)


def first_free_slot(pos: torch.Tensor) -> torch.Tensor:
    """``first_free_slot_reference``, by the C++ op for CPU tensors where it is built."""
    if pos.device.type == "cpu" and slots_cpu.available():
        return torch.ops.evictlayers.first_free_slot(pos)
    return first_free_slot_reference(pos)
