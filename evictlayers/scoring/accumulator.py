"""The ScoreAccumulator interface: per-slot state updated from attention mass, read as a score."""

from __future__ import annotations

import torch

from evictlayers.scoring.component import Component
from evictlayers.scoring.view import Observation, SlotView


class ScoreAccumulator(Component):
    """Turns the attention mass each slot receives into an importance score (higher = keep).

    ``state_specs`` names the per-slot state tensors the accumulator needs and their trailing shape
    (``()`` for one float per slot); the slot store allocates them as ``[B, H_kv, C, *shape]`` float32,
    moves them with their slots and zeroes them when a slot is reused.
    """

    state_specs: dict[str, tuple[int, ...]] = {}
    rows_needed: int = 0  # how many of a step's last query rows ``Observation.rows`` must hold

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        """Fold this step's attention into ``state`` in place."""
        raise NotImplementedError

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``[B, H_kv, N]`` float importance of each slot."""
        raise NotImplementedError
