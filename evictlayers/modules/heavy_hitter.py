"""H2O's heavy-hitter selection: keep the slots with the highest accumulated score."""

from __future__ import annotations

import torch

from evictlayers.scoring import Component, Observation, ScoreAccumulator, SlotView


class HeavyHitterSelector(Component):
    """Fills the slots the protections leave with the highest-scoring tokens, per KV head.

    Scores in, kept slots out: ``accumulator`` (``Cumulative`` = H2O Algorithm 1, ``Averaged`` = the
    appendix B.2 variant) turns attention mass into a per-slot score; the policy evicts the
    lowest-scoring unprotected slot (Algorithm 1 line 12: removing the minimum-score token maximises
    ``F_score`` of what stays).
    """

    param_names = ("accumulator",)

    def __init__(self, accumulator: ScoreAccumulator):
        super().__init__()
        if not isinstance(accumulator, ScoreAccumulator):
            raise TypeError(
                f"HeavyHitterSelector(accumulator={accumulator!r}): expected a ScoreAccumulator "
                "such as Cumulative() or Averaged()"
            )
        self.accumulator = accumulator

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        return self.accumulator.state_specs

    @property
    def rows_needed(self) -> int:
        return self.accumulator.rows_needed

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the logits of the scoring softmax, or ``None`` for the model's own."""
        return None

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        self.accumulator.update(state, observation, view)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return self.accumulator.score(state, view)
