"""TOVA's layer-wide ranking (Oren et al., 2024, arXiv:2401.06104, Sec. 3.2; ChunkKV's layer-wise index
reuse): every KV head of a layer keeps the same tokens, ranked by a score combined over the heads."""

from __future__ import annotations

import torch

from evictlayers.scoring.refinement import ScoreRefinement
from evictlayers.scoring.view import SlotView


class LayerScope(ScoreRefinement):
    """Each held slot's score becomes the ``reduce`` over the layer's KV heads of their scores for it:
    ``"mean"`` (TOVA averages the attention over the heads) or ``"max"`` (ours: the largest any head
    gives, so a token one head needs, a retrieval head reading a needle, is not outvoted by heads that
    attend elsewhere). Every head then ranks alike, so every head keeps the same tokens and the heads' slot
    layouts stay identical (slot ``j`` is the same token in every head).

    A refinement after it would score each head on its own again, so it comes last in ``refine``.
    """

    param_names = ("reduce",)
    REDUCTIONS = ("mean", "max")
    aligns_heads = True

    def __init__(self, reduce: str = "mean"):
        super().__init__()
        if reduce not in self.REDUCTIONS:
            raise ValueError(f"LayerScope(reduce={reduce!r}): expected one of {self.REDUCTIONS}")
        self.reduce = reduce

    def refine(self, score: torch.Tensor, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        held = view.valid
        if self.reduce == "max":
            # over the heads holding the slot; a slot no head holds scores 0, as the mean gives it
            top = score.masked_fill(~held, float("-inf")).amax(1, keepdim=True)
            return torch.where(held.any(1, keepdim=True), top, 0.0).expand_as(score)
        mean = (score * held).sum(1, keepdim=True) / held.sum(1, keepdim=True).clamp(min=1)
        return mean.expand_as(score)
