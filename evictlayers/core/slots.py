"""Index helpers for ``[B, H_kv, N, ...]`` slot tensors, shared by the slot store, the decode step and
the scorers that order slots by position."""

from __future__ import annotations

import torch

LAST = torch.iinfo(torch.long).max
"""A sort key above every position: masked into the free (or excluded) slots of a position-ordered
sort or ``argmin`` so that they come last."""


def along_slots(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Expand a ``[B, H, k]`` slot index to ``like``'s trailing dims, for gather/scatter on dim 2."""
    shaped = index.view(*index.shape, *([1] * (like.dim() - 3)))
    return shaped.expand(*index.shape, *like.shape[3:])


def batch_head_index(slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, 1], [1, H])`` aranges that, with ``slot`` ``[B, H]``, index one slot per ``(b, h)``."""
    batch, heads = slot.shape
    return torch.arange(batch, device=slot.device)[:, None], torch.arange(heads, device=slot.device)[None, :]


def pad_slots(tensor: torch.Tensor, extra: int, fill: float) -> torch.Tensor:
    """``tensor`` with ``extra`` more slots (dim 2) holding ``fill``."""
    pad = tensor.new_full((*tensor.shape[:2], extra, *tensor.shape[3:]), fill)
    return torch.cat([tensor, pad], dim=2)
