"""Heavy-hitter selection: keep the slots with the highest score (H2O, Scissorhands, AhaKV)."""

from __future__ import annotations

from typing import Any

import torch

from evictlayers.scoring import (
    Component,
    Observation,
    ScoreAccumulator,
    ScorePrior,
    ScoreTransform,
    SlotView,
)


class HeavyHitterSelector(Component):
    """Fills the slots the protections leave with the highest-scoring tokens, per KV head.

    ``HeavyHitterSelector(accumulator, transform=None, prior=None)``: the ``accumulator`` turns the
    attention each slot receives into a score, an optional ``transform`` changes the softmax it scores
    with (never the model's output), an optional ``prior`` weights the score per slot; the policy evicts
    the lowest-scoring unprotected slots (H2O Algorithm 1 line 12: removing the minimum-score token
    maximises ``F_score`` of what stays).

    - ``HeavyHitterSelector(Cumulative())``: H2O (Algorithm 1); ``Averaged()``: its normalised variant;
    - ``HeavyHitterSelector(LowScoreCounter(window=w))`` with ``Policy(..., drop=0.5)``: Scissorhands;
    - ``HeavyHitterSelector(Windowed(32), StepGainSoftmax(), ValuePrior())``: AhaKV with Eq. 5 at every
      step (recipe ``ahakv_windowed``); ``HeavyHitterSelector(RecentThenCumulative(32), StepGainSoftmax())``
      is Algorithm 1 as written (recipe ``ahakv``).
    """

    param_names = ("accumulator", "transform", "prior")

    def __init__(
        self,
        accumulator: ScoreAccumulator,
        transform: ScoreTransform | None = None,
        prior: ScorePrior | None = None,
    ):
        super().__init__()
        if not isinstance(accumulator, ScoreAccumulator):
            raise TypeError(
                f"HeavyHitterSelector(accumulator={accumulator!r}): expected a ScoreAccumulator such as "
                "Cumulative(), Averaged(), Windowed(), LowScoreCounter()"
            )
        if transform is not None and not isinstance(transform, ScoreTransform):
            raise TypeError(
                f"HeavyHitterSelector(transform={transform!r}): expected a ScoreTransform such as StepGainSoftmax()"
            )
        if prior is not None:
            if not isinstance(prior, ScorePrior):
                raise TypeError(f"HeavyHitterSelector(prior={prior!r}): expected a ScorePrior such as ValuePrior()")
            if not getattr(accumulator, "nonnegative", True):
                raise ValueError(
                    f"HeavyHitterSelector(prior={prior!r}): {type(accumulator).__name__} scores are not "
                    "non-negative attention mass, so a multiplicative prior would invert them; use it with "
                    "Cumulative, Averaged or Windowed"
                )
            clash = set(accumulator.state_specs) & set(prior.state_specs)
            if clash:
                raise ValueError(f"HeavyHitterSelector: accumulator and prior both name state {sorted(clash)}")
        self.accumulator = accumulator
        self.transform = transform
        self.prior = prior

    def params(self) -> dict[str, Any]:
        # the optional parts appear only when set, so an H2O selector dumps as it always did
        return {k: v for k, v in super().params().items() if k == "accumulator" or v is not None}

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        specs = dict(self.accumulator.state_specs)
        if self.prior is not None:
            specs.update(self.prior.state_specs)
        return specs

    @property
    def rows_needed(self) -> int:
        return self.accumulator.rows_needed

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the logits of the scoring softmax, or ``None`` for the model's own."""
        return None if self.transform is None else self.transform.score_gain(query_pos, budget)

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        self.accumulator.update(state, observation, view)
        if self.prior is not None:
            self.prior.update(state, observation, view)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        score = self.accumulator.score(state, view)
        if self.prior is not None:
            score = score * self.prior.weight(state, view)
        return score
