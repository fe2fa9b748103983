"""Tie-tolerant argmin/argmax over distances (ClusterGen's nearest cluster, greedy k-center's farthest
candidate, the k-center eviction's most redundant key).

Distances that differ by less than a relative ``TIE_TOLERANCE`` count as equal and go to the lowest
index. Exact ties are common in real keys: RoPE rotates a token's key by its position, so the distance
between two keys of the same token depends only on their offset, and a repeated token is equidistant
from copies before and after it. Under float noise (eager vs compiled, a row alone vs in a batch) an
exact ``argmin`` would break such ties differently and two runs that should agree would diverge.
"""

from __future__ import annotations

import torch

TIE_TOLERANCE = 1e-4  # relative: distances this close count as equal


def first_near_min(values: torch.Tensor, tolerance: float = TIE_TOLERANCE) -> torch.Tensor:
    """Index (last dim) of the first entry within a relative ``tolerance`` of the minimum; ``values``
    are non-negative or ``+inf`` (all ``+inf`` gives 0)."""
    lowest = values.amin(-1, keepdim=True)
    return (values <= lowest * (1 + tolerance)).int().argmax(-1)


def first_near_max(values: torch.Tensor, tolerance: float = TIE_TOLERANCE) -> torch.Tensor:
    """Index (last dim) of the first entry within a relative ``tolerance`` of the maximum; ``values``
    are non-negative or ``-inf`` (all ``-inf`` gives 0)."""
    highest = values.amax(-1, keepdim=True)
    floor = torch.where(torch.isfinite(highest), highest * (1 - tolerance), highest)
    return (values >= floor).int().argmax(-1)
