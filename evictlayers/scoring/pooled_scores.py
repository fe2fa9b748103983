"""SnapKV's clustering by pooling (Li et al., 2024, arXiv:2404.14469, Sec. 4.2): a slot's score becomes
the pooled score of the held tokens around it, so a multi-token needle is kept whole."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from evictlayers.core.slots import LAST
from evictlayers.scoring.refinement import ScoreRefinement
from evictlayers.scoring.view import SlotView


class PooledScores(ScoreRefinement):
    """Each held slot's score becomes the ``reduce`` (``"mean"`` or ``"max"``) of the scores of the
    ``window`` held tokens around it in position order.

    ``side="both"`` (``window`` odd, >= 3) centres the window on the token, as SnapKV's 1-d pooling does
    (kernel 5-7 in the paper; 5 in the authors' code). Neighbours are the *held* tokens: at prefill the
    whole prompt, as in SnapKV, later the survivors.

    Deviation (ours): ``side="before"`` (any ``window >= 2``) pools over the token and the ``window - 1``
    held tokens before it, so a high score carries forward only, onto the tokens that follow it (a
    needle's key, which the question names, onto the value after it).
    """

    param_names = ("window", "reduce", "side")
    REDUCTIONS = ("mean", "max")
    SIDES = ("both", "before")

    def __init__(self, window: int, reduce: str = "mean", side: str = "both"):
        super().__init__()
        if side not in self.SIDES:
            raise ValueError(
                f"PooledScores(side={side!r}): expected 'both' (the window centred on each token) or 'before' "
                "(the token and those before it)"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(
                f"PooledScores(window={window!r}): the pooling width must be an int >= 2 (leave PooledScores "
                "out for no pooling)"
            )
        if side == "both" and window % 2 == 0:
            raise ValueError(
                f"PooledScores(window={window}): with side='both' the width must be an odd int >= 3 (a window "
                "centred on each token; SnapKV uses 5-7); side='before' takes any width >= 2"
            )
        if reduce not in self.REDUCTIONS:
            raise ValueError(f"PooledScores(reduce={reduce!r}): expected one of {self.REDUCTIONS}")
        self.window, self.reduce, self.side = window, reduce, side

    def refine(self, score: torch.Tensor, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return pool_by_position(score, view.pos, self.window, self.reduce, self.side)


def pool_by_position(
    score: torch.Tensor, pos: torch.Tensor, width: int, reduce: str, side: str = "both"
) -> torch.Tensor:
    """``score`` ``[B, H, N]`` pooled over each slot's ``width`` neighbours among the held slots in
    position order (``pos`` ``[B, H, N]``, ``-1`` = empty); empty slots neither give nor get a value.
    ``side="both"``: the window centred on the slot (``width`` odd); ``"before"``: the slot and the
    ``width - 1`` held slots before it.

    Fixed-shape (a sort of the slot axis, a 1-d pooling, the inverse permutation), so it runs inside the
    compiled decode step."""
    batch, heads, n_slots = score.shape
    held = pos >= 0
    order = pos.masked_fill(~held, LAST).argsort(-1)  # held slots first, by position
    ranked = score.gather(-1, order).reshape(batch * heads, 1, n_slots)
    ranked_held = held.gather(-1, order).reshape(batch * heads, 1, n_slots)
    # the window's reach before and after each slot; edges are padded with slots that hold nothing
    before, after = (width - 1, 0) if side == "before" else (width // 2, width // 2)
    if reduce == "max":
        pooled = F.max_pool1d(F.pad(ranked.masked_fill(~ranked_held, -math.inf), (before, after), value=-math.inf),
                              width, stride=1)
    else:
        total, count = (F.avg_pool1d(F.pad(x, (before, after)), width, stride=1)
                        for x in (ranked.masked_fill(~ranked_held, 0.0), ranked_held.float()))
        pooled = total / count.clamp(min=1e-12)
    pooled = pooled.reshape(batch, heads, n_slots)
    return torch.empty_like(pooled).scatter_(-1, order, pooled).masked_fill(~held, 0.0)
