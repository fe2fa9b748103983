"""Accumulated attention divided by how many queries could attend (H2O appendix B.2)."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView


class Averaged(ScoreAccumulator):
    """``o_j / (t - j)``: the mean attention token ``j`` received per query that could see it.

    H2O (appendix B.2, "Previous Attempts") tried this to remove the cumulative score's bias toward
    old tokens; NVIDIA kvpress's ObservedAttentionPress scores a prompt the same way. ``t - j`` is the
    number of queries at positions ``j .. t-1`` (``SlotView.age``).
    """

    state_specs = {"score": ()}

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        state["score"] += observation.mass

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return state["score"] / view.age
