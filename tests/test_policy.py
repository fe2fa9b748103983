"""Policy construction: budgets, protections, and the clear errors for bad input."""

import pytest
import torch

import evictlayers as el


def h2o(budget):
    return el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=budget)


@pytest.mark.parametrize(
    "budget,match",
    [(0, "must be positive"), (-3, "must be positive"), (-0.5, "must be positive"), (1.5, r"in \(0, 1\]"),
     ("20%", "expected an int"), (True, "expected an int")],
    ids=["zero", "negative", "negative-float", "float-above-1", "string", "bool"],
)
def test_bad_budgets_are_refused(budget, match):
    with pytest.raises((ValueError, TypeError), match=match):
        h2o(budget)


def test_budget_smaller_than_protected_slots_names_the_numbers():
    with pytest.raises(ValueError, match=r"budget of 6 tokens cannot hold .*SinkTokens\(4\) \+ RecentWindow\(4\) = 8"):
        el.Policy(el.SinkTokens(4), el.RecentWindow(4), budget=6)


def test_open_ended_window_beside_sinks_cannot_hide_a_too_small_budget():
    with pytest.raises(ValueError, match=r"budget of 3 tokens cannot hold .*SinkTokens\(4\) \+ RecentWindow\(0\) = 4"):
        el.Policy(el.SinkTokens(4), el.RecentWindow(), budget=3)


def test_float_budget_checks_protected_slots_once_the_prompt_is_seen():
    policy = el.Policy(el.SinkTokens(4), el.RecentWindow(8), budget=0.1)
    assert policy.resolve_budget(torch.tensor([200])).tolist() == [20]
    with pytest.raises(ValueError, match=r"budget of 5 tokens cannot hold .* = 12"):
        policy.resolve_budget(torch.tensor([50]))


def test_float_budget_rounds_half_up_per_row():
    assert h2o(0.2).resolve_budget(torch.tensor([10, 12, 13, 1])).tolist() == [2, 2, 3, 1]


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: el.RecentWindow(-1), ">= 0 tokens"),
        (lambda: el.RecentWindow(1.5), r"fraction of the budget, in \(0, 1\]"),
        (lambda: el.SinkTokens(0), "count must be an int >= 1"),
        (lambda: el.HeavyHitterSelector(accumulator="cumulative"), "expected a ScoreAccumulator"),
        (lambda: el.Policy(el.RecentWindow(), el.HeavyHitterSelector(el.Cumulative()), budget=8), "give RecentWindow a size"),
        (lambda: el.Policy(el.RecentWindow(2), el.RecentWindow(3), budget=8), "2 RecentWindow modules"),
        (lambda: el.Policy(el.Cumulative(), budget=8), "expected a protection"),
        (lambda: el.Policy(budget=8, gqa_reduce="median"), "gqa_reduce"),
    ],
    ids=["recent-negative", "recent-float", "sinks-zero", "accumulator-type", "open-window-with-selector",
         "duplicate-window", "not-a-module", "gqa-reduce"],
)
def test_bad_components_are_refused(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_policies_compare_by_configuration():
    assert h2o(0.2) == h2o(0.2)
    assert h2o(0.2) != h2o(0.3)
    assert h2o(1) != h2o(1.0)  # one token is not the whole prompt
    assert el.Policy(el.HeavyHitterSelector(el.Cumulative()), budget=4) != el.Policy(
        el.HeavyHitterSelector(el.Averaged()), budget=4
    )
