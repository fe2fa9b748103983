"""AhaKV's value prior (Gu et al., Eq. 13-15): weight each token's score by its pooled value norm."""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.core.slots import LAST
from evictlayers.scoring.view import Observation, SlotView


class ScorePrior(Component):
    """A per-slot weight multiplied into the selector's score; keeps its own per-slot state."""

    state_specs: dict[str, tuple[int, ...]] = {}
    # as ``ScoreAccumulator``'s: whether a one-token step's ``update`` or ``weight`` reads keys / values
    reads_keys: bool = False
    reads_values: bool = False

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        raise NotImplementedError

    def weight(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``[B, H_kv, N]`` non-negative weight of each slot."""
        raise NotImplementedError


class ValuePrior(ScorePrior):
    """``S_hat_j = gamma_j / max(gamma) * S_j`` with ``gamma = AvgPool(||V||^2)`` (AhaKV Eq. 13-15).

    ``nu_j = ||V_j||^2`` is average-pooled over the ``pool`` positions centred on ``j`` (Eq. 13, "mean
    filtering" so the prior follows the text's continuity), divided by its maximum (Eq. 14) and
    multiplied into the accumulator's score (Eq. 15).

    Slots are unordered and evicted tokens are gone, so the pooling is kept as per-slot state: the sum and
    count of ``nu`` over the neighbours ``|pos_i - pos_j| <= pool // 2`` that were in the cache together
    with ``j`` at some step. When tokens are inserted, each new token pools over the retained neighbours
    and the other new tokens, and every retained neighbour adds the new token's ``nu``. Consequences:

    - a prompt prefilled in one step is pooled exactly as Eq. 13 (all its tokens are present), except at
      the edges, where we average over the neighbours that exist (``count_include_pad=False``) instead of
      zero padding; the last prompt tokens complete their window as generated tokens arrive;
    - a neighbour evicted before a token arrived is missing from that token's window (its value is gone);
      a neighbour evicted later stays in the pooled value (it was there when it was counted).

    The maximum of Eq. 14 is taken over the slots the head currently holds. Dividing by it is a per-head
    constant, so it never changes which slot a head evicts; it keeps the weight in ``[0, 1]``.

    As the selector's ``prior`` (``evictlayers/recipes/ahakv_windowed.yaml``) it deviates from Algorithm 1, which weights
    the prefill score once (line 10) and then adds generated rows unweighted (line 27): Eq. 15 is applied to
    the current score at every ranking, so generated tokens get their prior too. As
    ``RecentThenCumulative(prefill_prior=ValuePrior(pool))`` (``evictlayers/recipes/ahakv.yaml``) it weights the prompt
    rows once, as Algorithm 1 does. The pool size is not stated in the paper; ``pool=5`` is our default.
    """

    param_names = ("pool",)
    state_specs = {"prior_sum": (), "prior_count": ()}
    reads_values = True  # ||v||^2 of every held slot

    def __init__(self, pool: int = 5):
        super().__init__()
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 or pool % 2 == 0:
            raise ValueError(f"ValuePrior(pool={pool!r}): pool must be an odd int >= 1 (a window centred on the token)")
        self.pool = pool

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        total, count = state["prior_sum"], state["prior_count"]
        valid = view.valid
        nu = observation.values.float().pow(2).sum(-1) * valid  # [B, H, N]
        new = valid & (count == 0)  # a processed slot counts at least itself
        total += nu * new
        count += new.float()
        half = self.pool // 2
        if half == 0:
            return
        # neighbours by position: sort each head's slots by position; positions are distinct, so the
        # tokens within ``half`` positions of a slot are within ``half`` places of it in that order
        key = torch.where(valid, view.pos, LAST)
        order = key.argsort(-1)
        spos, snu, snew, svalid = (t.gather(-1, order) for t in (key, nu, new, valid))
        add_total = torch.zeros_like(snu)
        add_count = torch.zeros_like(snu)
        n_slots = spos.shape[-1]
        for offset in range(1, min(half, n_slots - 1) + 1):
            left, right = slice(0, n_slots - offset), slice(offset, n_slots)
            # a pair is counted once, at the step where the later of its two tokens arrives
            pair = (
                svalid[..., left] & svalid[..., right]
                & (spos[..., right] - spos[..., left] <= half)
                & (snew[..., left] | snew[..., right])
            ).float()
            add_total[..., left] += pair * snu[..., right]
            add_count[..., left] += pair
            add_total[..., right] += pair * snu[..., left]
            add_count[..., right] += pair
        total.scatter_add_(-1, order, add_total)
        count.scatter_add_(-1, order, add_count)

    def pooled(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, H, N]`` ``gamma``: the pooled squared value norm of each slot (Eq. 13)."""
        return state["prior_sum"] / state["prior_count"].clamp(min=1.0)

    def weight(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        gamma = self.pooled(state) * view.valid
        top = gamma.amax(-1, keepdim=True).clamp(min=torch.finfo(gamma.dtype).tiny)
        return gamma / top
