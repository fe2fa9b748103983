"""Policy construction: budgets, protections, and the clear errors for bad input."""

import pytest
import torch

import evictlayers as el


def h2o(budget, **settings):
    return el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=budget, **settings)


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
    policy = el.Policy(el.SinkTokens(4), el.RecentWindow(8), budget=0.1, min_budget=1)
    assert policy.resolve_budget(torch.tensor([200])).tolist() == [20]
    with pytest.raises(ValueError, match=r"budget of 5 tokens cannot hold .* = 12"):
        policy.resolve_budget(torch.tensor([50]))
    floored = el.Policy(el.SinkTokens(4), el.RecentWindow(8), budget=0.1, min_budget=12)
    with pytest.warns(UserWarning):
        assert floored.resolve_budget(torch.tensor([50])).tolist() == [12]  # the floor holds the protections


def test_float_budget_rounds_half_up_per_row(recwarn):
    assert h2o(0.2, min_budget=1).resolve_budget(torch.tensor([10, 12, 13, 1])).tolist() == [2, 2, 3, 1]
    assert not recwarn.list  # one token is the least any budget is: no floor to lift it


def test_a_fraction_of_a_short_prompt_is_lifted_to_the_floor_with_one_warning():
    """20% of a 4-token prompt is 1 token per head; the default floor keeps 32, and says so once."""
    policy = h2o(0.2)
    assert policy.min_budget == 32
    with pytest.warns(UserWarning) as caught:
        assert policy.resolve_budget(torch.tensor([4, 200, 1000])).tolist() == [32, 40, 200]
        for layer in range(4):  # every layer resolves its budget; the policy warned already
            policy.resolve_budget(torch.tensor([4]), layer, 4)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert all(part in message for part in ("budget=0.2", "min_budget=32", "4-token prompt", "is 1 token(s) per head"))


def test_the_floor_leaves_long_prompts_and_int_budgets_alone(recwarn):
    assert h2o(0.2).resolve_budget(torch.tensor([160, 500])).tolist() == [32, 100]
    assert h2o(8).resolve_budget(torch.tensor([4])).tolist() == [8]  # an int budget is the tokens per head given
    assert h2o(0.5, min_budget=64).resolve_budget(torch.tensor([128])).tolist() == [64]
    assert not recwarn.list


def test_the_floor_applies_before_the_allocation_splits_the_budget():
    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.1, min_budget=40,
                       allocation=el.Ramp(0.5))
    with pytest.warns(UserWarning):
        layers = [policy.resolve_budget(torch.tensor([100]), layer, 4).item() for layer in range(4)]
    assert layers == [budget.item() for budget in el.Ramp(0.5).layer_budgets(torch.tensor([40]), 4)]
    assert layers != [budget.item() for budget in el.Ramp(0.5).layer_budgets(torch.tensor([10]), 4)]


def test_the_sliding_layers_policy_shares_the_floor_and_its_one_warning():
    policy = h2o(0.2, min_budget=16, sliding_modules=[el.RecentWindow()])
    assert policy.sliding.min_budget == 16
    with pytest.warns(UserWarning) as caught:
        assert policy.resolve_budget(torch.tensor([10])).tolist() == [16]
        assert policy.sliding.resolve_budget(torch.tensor([10])).tolist() == [16]
    assert len(caught) == 1


@pytest.mark.parametrize("floor", [0, -1, 2.5, True, "32"], ids=str)
def test_bad_floors_are_refused(floor):
    with pytest.raises(ValueError, match=rf"min_budget={floor!r}.*int >= 1"):
        h2o(0.2, min_budget=floor)


def test_the_floor_is_a_recipe_key(tmp_path):
    policy = h2o(0.2, min_budget=8)
    assert "min_budget: 8" in el.dump_recipe(policy, tmp_path / "floor.yaml")
    assert el.load_recipe(tmp_path / "floor.yaml") == policy != h2o(0.2)
    assert "min_budget" not in el.dump_recipe(h2o(0.2))  # the default stays out, as recipes wrote before
    assert el.load_recipe("h2o").min_budget == 32
    assert policy.replace(min_budget=64).min_budget == 64 and policy.replace(budget=0.5).min_budget == 8


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
