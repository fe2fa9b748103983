"""Sliding-window layers: a query at position p sees positions above p - window (transformers' sliding
mask), so a sliding layer never needs more than ``window - 1`` held tokens. Whatever the policy, it holds
at most that many (``full`` included), the budget binds where smaller, and a token that slid out of the
window goes before any token a later query can still see. Expectations come from that formula, not
from the store.
"""

from __future__ import annotations

import pytest
import torch

import evictlayers as el
from tiny_models import build, greedy, left_padded, single_thread  # noqa: F401

WINDOW = 8
TOKENS = 30


def _qkv(batch=2, heads=2, n=TOKENS, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads * 2, n, d, generator=g), torch.randn(batch, heads, n, d, generator=g),
            torch.randn(batch, heads, n, d, generator=g))


def _held(store, b, h) -> list[int]:
    pos = store.pos[b, h]
    return sorted(pos[pos >= 0].tolist())


def _feed(store, prefill: int, compiled_decode: bool = False):
    q, k, v = _qkv()
    store.step(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], scaling=0.5, sliding_window=WINDOW)
    yield prefill
    for i in range(prefill, TOKENS):
        store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.5, sliding_window=WINDOW)
        yield i + 1


POLICIES = {
    "full": lambda: el.Policy(budget=None),
    "h2o-20": lambda: el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=20),
    "scissorhands-20": lambda: el.Policy(
        el.RecentWindow(0.25), el.HeavyHitterSelector(el.LowScoreCounter(window=4)), budget=20, drop=0.5
    ),
}


@pytest.mark.parametrize("prefill", [1, 5, 12])
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_budget_above_the_window_holds_exactly_the_window(name, prefill):
    store = el.SlotStore(POLICIES[name](), window=WINDOW)
    for fed in _feed(store, prefill):
        visible = list(range(max(0, fed - WINDOW + 1), fed))  # what the next query (position fed) sees
        for b in range(2):
            for h in range(2):
                assert _held(store, b, h) == visible, (fed, b, h)
    assert store.bound == "window"
    assert store.capacity == WINDOW  # window - 1 held plus the slot the next token lands in


@pytest.mark.parametrize("prefill", [1, 12])
def test_a_budget_below_the_window_binds_and_never_keeps_a_stale_token(prefill):
    budget = 4
    policy = el.Policy(el.RecentWindow(1), el.HeavyHitterSelector(el.Cumulative()), budget=budget)
    store = el.SlotStore(policy, window=WINDOW)
    for fed in _feed(store, prefill):
        for b in range(2):
            for h in range(2):
                held = _held(store, b, h)
                assert len(held) == min(fed, budget)
                assert all(fed - p < WINDOW for p in held), (fed, held)  # every held token still visible
                assert fed - 1 in held  # the recent window
    assert store.bound == "budget"


def test_a_window_that_disagrees_with_the_call_is_an_error():
    q, k, v = _qkv()
    store = el.SlotStore(el.Policy(budget=None), window=WINDOW)
    with pytest.raises(ValueError, match="sliding_window=6.*window of 8"):
        store.step(q[:, :, :3], k[:, :, :3], v[:, :, :3], scaling=0.5, sliding_window=6)


@pytest.mark.parametrize("window", [1, 0, 2.5, True])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        el.SlotStore(el.Policy(budget=None), window=window)


def test_stats_report_which_rule_binds_each_layer_of_a_mixed_model():
    """Gemma 2's tiny config alternates a sliding layer (window 8) and a full one."""
    model = build("gemma2", "eager")
    ids, mask = left_padded([20, 13])
    for budget, bounds in [(None, ["window", None]), (16, ["window", "budget"]), (4, ["budget", "budget"])]:
        policy = el.Policy(budget=None) if budget is None else el.Policy(
            el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=budget
        )
        with el.apply(model, policy) as run:
            greedy(model, ids, mask, 6)
            layers = run.stats()["layers"]
        assert [layer["bound"] for layer in layers] == bounds, budget
        assert [layer["kind"] for layer in layers] == ["sliding", "attention"]
        limits = [min(budget or 10**9, WINDOW - 1), budget or 10**9]
        assert all(layer["retained_tokens"] <= limit for layer, limit in zip(layers, limits)), (budget, layers)
