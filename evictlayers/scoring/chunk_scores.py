"""ChunkKV's chunk scores (Liu et al., 2025, arXiv:2502.00299, Sec. 3.1): a slot's score becomes the
score of its chunk of consecutive tokens, so whole spans of text stay or go together."""

from __future__ import annotations

import torch

from evictlayers.core.slots import LAST
from evictlayers.scoring.refinement import ScoreRefinement
from evictlayers.scoring.view import SlotView

CHUNK_REDUCTIONS = ("sum", "mean")


class ChunkScores(ScoreRefinement):
    """Each held slot's score becomes the sum of the scores of the held tokens in its chunk, the ``size``
    consecutive positions ``[k size, (k + 1) size)`` it falls in (ChunkKV Sec. 3.1: a chunk's score is the
    summed observation-window attention of its tokens, the top chunks are kept; ChunkKV uses 10).

    Deviation: the paper selects once, at prefill; here the chunk sums keep ranking while generating, and
    a chunk that has lost tokens sums fewer of them, so the cache goes on dropping it before it breaks up
    another. ``reduce="mean"`` (ours) ranks a chunk by the mean over its held tokens instead, by how much
    each of its tokens is worth rather than by how many it has.
    """

    param_names = ("size", "reduce")

    def __init__(self, size: int, reduce: str = "sum"):
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            hint = "; SentenceScores(cap) chunks the text's sentences" if isinstance(size, str) else ""
            raise ValueError(
                f"ChunkScores(size={size!r}): the chunk length must be an int >= 2 (ChunkKV uses 10; leave "
                f"ChunkScores out for no chunks){hint}"
            )
        if reduce not in CHUNK_REDUCTIONS:
            raise ValueError(f"ChunkScores(reduce={reduce!r}): expected one of {CHUNK_REDUCTIONS}")
        self.size, self.reduce = size, reduce

    def refine(self, score: torch.Tensor, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return reduce_by_group(score, view.pos, view.pos.div(self.size, rounding_mode="floor"), self.reduce)


def reduce_by_group(score: torch.Tensor, pos: torch.Tensor, group: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """``score`` ``[B, H, N]`` replaced, for each held slot, by the sum (``reduce="sum"``) or the mean
    (``"mean"``) over the held slots of the same chunk (``group`` ``[B, H, N]`` int64, non-decreasing in
    position: ``pos // c`` for fixed chunks, the start of the sentence piece for sentences; ``pos``
    ``[B, H, N]``, ``-1`` = empty, which gets 0).

    Fixed-shape, for the compiled decode step: the slots sorted by position, where each chunk is a run,
    and each run's sum (and length) read off a cumulative sum at the run's two ends."""
    batch, heads, n_slots = score.shape
    held = pos >= 0
    order = pos.masked_fill(~held, LAST).argsort(-1)  # held slots first, by position
    ranked = score.gather(-1, order).masked_fill(~held.gather(-1, order), 0.0)
    # empty slots (sorted last) get chunk ids past every real one, one run of their own
    ids = torch.where(held, group, LAST).gather(-1, order)
    index = torch.arange(n_slots, device=score.device).expand_as(ids)
    starts = torch.ones_like(held)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    ends = torch.ones_like(held)
    ends[..., :-1] = starts[..., 1:]
    first = torch.where(starts, index, 0).cummax(-1).values  # index of each slot's run start
    last = torch.where(ends, index, n_slots - 1).flip(-1).cummin(-1).values.flip(-1)  # and run end
    total = ranked.cumsum(-1)
    before = torch.where(first > 0, total.gather(-1, (first - 1).clamp(min=0)), 0.0)
    summed = total.gather(-1, last) - before
    if reduce == "mean":
        summed = summed / (last - first + 1)  # held slots sort first, so a held run counts held slots only
    return torch.empty_like(summed).scatter_(-1, order, summed).masked_fill(~held, 0.0)
