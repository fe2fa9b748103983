"""H2O's accumulated attention score (Zhang et al., 2023, Algorithm 1)."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView


class Cumulative(ScoreAccumulator):
    """``o_j = sum_t a_{t,j}``: the attention token ``j`` received from every query so far.

    Follows H2O Algorithm 1 with ``F_score(T) = sum_{s in T} o_s``, where ``a_t`` is softmax attention
    normalised over the *retained* slots only (lines 8-9, the evicted entries are subtracted from the
    normaliser). Deviation, as in the authors' code and Remark D.15: scores accumulate from the first
    query on, including the steps where the cache is not yet full (lines 5-6 only fill it), so a
    prompt is scored by its attention column sums.
    """

    state_specs = {"score": ()}

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        state["score"] += observation.mass

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return state["score"]
