"""AhaKV's eviction score as Algorithm 1 writes it (Gu et al.): the prompt scored by its last rows and
weighted by the value prior once, then every generated row added on top."""

from __future__ import annotations

from typing import Any

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.value_prior import ScorePrior
from evictlayers.scoring.view import Observation, SlotView
from evictlayers.scoring.windowed import check_window, write_ring

PREFIX = "prefill_"  # the prior's state lives under prefixed names, so a selector-level prior cannot clash


class RecentThenCumulative(ScoreAccumulator):
    """``F = gamma_bar * sum_{last r prompt rows} a_{i,j} + sum_{generated rows} a_{t,j}`` (AhaKV Algorithm 1).

    - Prefill (lines 6-10): the prompt's last ``rows`` query rows (``B_r``, "Recent B_r Token") are summed,
      ``F_s = sum SGsoftmax(A)`` (line 8, Eq. 5 over the prompt), and, with a ``prefill_prior``, weighted
      once by it: ``F_hat_s = gamma / max(gamma) * F_s`` (lines 9-10, Eq. 13-15; ``ValuePrior(pool)``).
    - Generation (lines 19, 27): ``F_0 = F_hat_s`` and every generated row is added unweighted,
      ``F_t = SGsoftmax(A) + F_{t-1}``; a generated token starts from its own row.
    - Selection (lines 11-12, 28-30): give the policy ``RecentWindow(B_r)``; the selector keeps the
      top-scoring tokens of the rest (``B_s = B - B_r``), one eviction per generated token.
    - ``SGsoftmax`` is the selector's ``transform`` (``StepGainSoftmax()``, Eq. 9-12); without one the
      rows are the model's attention probabilities.

    A prefill is any multi-token step and a generated row any one-token step: a step's width is a static
    shape, so the decode step stays one fixed-shape graph. ``rows_needed`` is at least 2 so that a
    multi-token step always hands over more than one row. The prompt rows are kept per slot in a ring of
    ``rows`` entries indexed by position (as ``Windowed`` does), so a prompt prefilled in chunks is scored
    by its last ``rows`` rows overall; the prior's weight is recomputed at every multi-token step, over
    the slots held then (Eq. 14's maximum), and frozen in between. A single-token prompt (a stream fed one
    token at a time) is a generated row from the start: the same score, since a one-token prompt's prior
    weight is ``gamma / max(gamma) = 1``.

    Deviations and readings:

    - Line 11 writes ``TopK(F_s, B_s)``; we rank the prefill with the weighted ``F_hat_s`` (line 10),
      which line 19 carries into generation and Eq. 15 calls the eviction score.
    - The prior's pooled value norms (``ValuePrior``'s state) are updated at multi-token steps only:
      Algorithm 1 computes ``gamma`` once, at prefill (line 9), and generated rows are unweighted, so
      nothing in generation needs it (and decoding skips its cost). A generated token gets a pooled norm
      only if a later multi-token step comes.
    - Beyond Algorithm 1 (one prompt): a later multi-token step (a new turn) writes its last rows into
      the same ring by position and re-weights the ring; the generated rows stay in the sum unweighted.
    - GQA: the rows are reduced over each KV head's query group, as for every scorer here
      (``Policy(gqa_reduce=...)``); Algorithm 1 is per head.

    ``ahakv_windowed`` keeps the other reading: ``Windowed(r)`` (Eq. 5 at every step) with the prior
    multiplied in at every ranking (``HeavyHitterSelector(prior=ValuePrior())``).
    """

    param_names = ("rows", "prefill_prior")
    # a prompt is scored by its last rows and a generated row is the one-token step's only row, so no
    # step needs the summed mass: the prefill takes the fused attention for every other prompt row
    reads_mass = False

    def __init__(self, rows: int = 32, prefill_prior: ScorePrior | None = None):
        super().__init__()
        self.rows = check_window("RecentThenCumulative", "rows", rows)
        if prefill_prior is not None and not isinstance(prefill_prior, ScorePrior):
            raise TypeError(
                f"RecentThenCumulative(prefill_prior={prefill_prior!r}): expected a ScorePrior such as "
                "ValuePrior(pool=5), or None for an unweighted prefill score"
            )
        self.prefill_prior = prefill_prior

    def params(self) -> dict[str, Any]:
        # the prior appears only when set, so an unweighted accumulator dumps as `rows` alone
        params = super().params()
        return params if self.prefill_prior is not None else {"rows": params["rows"]}

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:  # type: ignore[override]
        specs: dict[str, tuple[int, ...]] = {"recent": (self.rows,), "generated": ()}
        if self.prefill_prior is not None:
            specs["prefill_weight"] = ()
            specs.update({PREFIX + name: shape for name, shape in self.prefill_prior.state_specs.items()})
        return specs

    @property
    def rows_needed(self) -> int:  # type: ignore[override]
        return max(self.rows, 2)

    def _prior_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: state[PREFIX + name] for name in self.prefill_prior.state_specs}

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        if observation.rows.shape[2] > 1:  # a multi-token step: (part of) a prompt
            write_ring(state["recent"], observation.rows[:, :, -self.rows :], observation.row_pos[:, -self.rows :])
            if self.prefill_prior is not None:
                prior_state = self._prior_state(state)
                self.prefill_prior.update(prior_state, observation, view)
                state["prefill_weight"].copy_(self.prefill_prior.weight(prior_state, view))
        else:  # a generated row: the step's only query row (all zero for a padding token)
            state["generated"] += observation.rows[:, :, -1]

    def prefill_score(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, H, N]`` ``F_hat_s``: the prompt's last rows, weighted by the prior if there is one."""
        recent = state["recent"].sum(-1)
        return recent * state["prefill_weight"] if self.prefill_prior is not None else recent

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return self.prefill_score(state) + state["generated"]
