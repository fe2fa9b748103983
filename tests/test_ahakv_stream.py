"""AhaKV in a streamed run (one token per step from the first, as the perplexity task feeds a document):
the query rows scored before the budget is reached still count when eviction starts, so they must carry
the model's attention, not a uniform row.

Issue 9: with a zero step gain while ``i <= k`` (uniform rows), ``Windowed(r)`` held only uniform rows at
the first evictions, the attention part of the score was flat among the unprotected slots and a
multiplicative ``ValuePrior`` ranked them alone; on SmolLM2-135M the first eviction took an attention sink
(a first token, small ``||v||``) in 46% of the heads and the streamed perplexity rose from ~33 to 42.48.
"""

from __future__ import annotations

import math

import pytest
import torch

import evictlayers as el
from evictlayers.compose import ranking
from evictlayers.scoring import SlotView
from reference_scorers import single_thread  # noqa: F401 (autouse fixture)

D, N, BUDGET, RECENT, ROWS = 16, 60, 24, 8, 8


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def _windowed_ahakv(transform=None) -> el.Policy:
    selector = el.HeavyHitterSelector(el.Windowed(ROWS), transform or el.StepGainSoftmax(), el.ValuePrior(3))
    return el.Policy(el.RecentWindow(RECENT), selector, budget=BUDGET)


def _stream(policy: el.Policy, q, k, v, until: int):
    """Feed tokens one at a time; yield the store after each step from the first eviction on."""
    store = el.SlotStore(policy)
    for i in range(until):
        store.step(q[None, None, i : i + 1], k[None, None, i : i + 1], v[None, None, i : i + 1], scaling=D**-0.5)
        if i + 1 > BUDGET:
            yield store


def _unprotected_parts(store):
    """Score, attention part and prior weight of the unprotected slots of head 0."""
    view = SlotView(pos=store.pos, seen=store.seen, budget=store.budget)
    selector = store.policy.selector
    mask = torch.isfinite(ranking.priority(store.policy, store.state, view))[0, 0]
    attention = selector.accumulator.score(store.state, view)[0, 0][mask]
    prior = selector.prior.weight(store.state, view)[0, 0][mask]
    return selector.score(store.state, view)[0, 0][mask], attention, prior


def test_rows_up_to_the_budget_score_with_the_models_softmax():
    """Below the budget Eq. 12 has no solution: the scoring softmax is the model's own (gain 1), not uniform."""
    gain = el.StepGainSoftmax().score_gain(torch.arange(30)[None], torch.tensor([24]))[0]
    assert torch.equal(gain[:24], torch.ones(24))
    assert 0 < gain[24] < 0.3 and torch.all(gain[25:] > gain[24:-1])


def test_the_prior_does_not_rank_alone_when_a_stream_starts_evicting():
    """The first eviction of a stream: every row in the window (``ROWS`` = the recent window, as in the
    recipe) comes from before the budget was reached. The attention part must still separate the
    unprotected slots, so that the score is not just the prior's ranking."""
    correlations, spreads = [], []
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(N, D, generator=g) for _ in range(3))
        for store in _stream(_windowed_ahakv(), q, k, v, until=BUDGET + 1):
            score, attention, prior = _unprotected_parts(store)
            correlations.append(_spearman(score, prior))
            spreads.append(float((attention.max() - attention.min()) / attention.mean()))
    assert sum(correlations) / len(correlations) < 0.7, correlations  # 0.31 (0.94 with uniform rows below k)
    assert min(spreads) > 0.5, spreads  # 0.92 or more (at most 0.21 with uniform rows below k)


def test_a_strong_sink_with_a_small_value_survives_a_stream():
    """Token 0 draws much of every query's attention but has a small value norm (an attention sink). No
    eviction of the stream may take it: only the prior, ranking alone, would put it last (the old rule
    evicted it at the first eviction in 5 of these 6 streams)."""
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(N, D, generator=g) for _ in range(3))
        direction = torch.randn(D, generator=g)
        direction /= direction.norm()
        q += 2 * direction  # every query leans towards the sink's key
        k[0] = 4 * direction
        v[0] *= 0.3
        for store in _stream(_windowed_ahakv(), q, k, v, until=N):
            assert bool((store.pos[0, 0] == 0).any()), f"seed {seed}: token 0 evicted at step {int(store.seen[0]) - 1}"


class _UniformBelowBudget(el.StepGainSoftmax):
    """The rule before issue 9: gain 0 (a uniform scoring row) while ``i <= k``."""

    def score_gain(self, query_pos, budget):
        gain = super().score_gain(query_pos, budget)
        return torch.where(query_pos + 1 <= budget[:, None], 0.0, gain)


@pytest.mark.parametrize("test", [test_the_prior_does_not_rank_alone_when_a_stream_starts_evicting,
                                  test_a_strong_sink_with_a_small_value_survives_a_stream])
def test_the_checks_above_fail_with_uniform_rows_below_the_budget(test, monkeypatch):
    """The two stream checks catch the old rule: run them with it and they fail."""
    monkeypatch.setattr(el, "StepGainSoftmax", _UniformBelowBudget)
    with pytest.raises(AssertionError):
        test()


def test_gain_just_above_the_budget_is_eq_12():
    """Sanity for Eq. 12 above the budget: the gain at i = k + 1 is sqrt(2 log((k + 1) / k)) ~ sqrt(2 / k)."""
    gain = el.StepGainSoftmax().score_gain(torch.tensor([[BUDGET]]), torch.tensor([BUDGET]))
    assert float(gain) == pytest.approx(math.sqrt(2 * math.log((BUDGET + 1) / BUDGET)), rel=1e-6)
