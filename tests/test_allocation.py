"""Per-layer budget allocation and Scissorhands' drop amount."""

import pytest
import torch

import evictlayers as el
from tiny_models import build, left_padded


@pytest.mark.parametrize(
    "allocation", [el.Uniform(), el.Ramp(0.5), el.Pyramid(0.5), el.Ramp(0.9), el.ByLayerKind(0.3)], ids=repr
)
@pytest.mark.parametrize("layers", [1, 2, 7, 30])
def test_layer_budgets_sum_to_the_total(allocation, layers):
    budget = torch.tensor([10, 37, 300])
    sliding = frozenset(range(0, layers, 3))  # every third layer slides (layer 0 of one)
    per_layer = allocation.layer_budgets(budget, layers, sliding)
    assert per_layer.shape == (layers, 3)
    assert per_layer.sum(0).tolist() == (budget * layers).tolist()
    ideal = allocation.weights(layers, sliding)[:, None] * budget.double()
    assert ((per_layer - ideal).abs() < 1).all()  # rounding moves no layer by a whole token


def test_ramp_gives_later_layers_more_and_pyramid_earlier():
    ramp = el.Ramp(0.5).layer_budgets(torch.tensor([100]), 5)[:, 0].tolist()
    pyramid = el.Pyramid(0.5).layer_budgets(torch.tensor([100]), 5)[:, 0].tolist()
    assert ramp == [50, 75, 100, 125, 150]
    assert pyramid == ramp[::-1]


def test_by_layer_kind_gives_sliding_window_layers_their_share():
    """Five sliding layers per full one (Gemma 3's pattern), 90 tokens per layer on average, a sliding layer
    weighing a quarter of a full one: 5 s + f = 540 and s = f / 4, so f = 240 and s = 60."""
    budgets = el.ByLayerKind(0.25).layer_budgets(torch.tensor([90]), 6, frozenset({0, 1, 2, 3, 4}))[:, 0]
    assert budgets.tolist() == [60, 60, 60, 60, 60, 240]
    # no sliding layer: Uniform's budgets; every layer sliding: Uniform's too (the weights are relative)
    for sliding in (frozenset(), frozenset(range(6))):
        assert el.ByLayerKind(0.25).layer_budgets(torch.tensor([90]), 6, sliding)[:, 0].tolist() == [90] * 6
    with pytest.raises(ValueError, match=r"layers \[6\] are not among the 6 layers"):
        el.ByLayerKind(0.25).layer_budgets(torch.tensor([90]), 6, frozenset({6}))


def test_by_layer_kind_reaches_the_layers_of_a_model_with_sliding_windows():
    """Gemma2 (a sliding layer of window 8, then a full one): a budget of 6 tokens per layer on average
    and ``sliding=0.5`` give s + f = 12 with s = f / 2: 4 and 8 held after a 20-token prompt and decode
    steps; a ``reset`` cache keeps the split."""
    model = build("gemma2")
    policy = el.Policy(el.RecentWindow(), budget=6, allocation=el.ByLayerKind(0.5))
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        for _ in range(2):
            ids, mask = left_padded([20, 20])
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            for token in (3, 4):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                model(input_ids=torch.full((2, 1), token), attention_mask=mask, past_key_values=cache, use_cache=True)
            sliding, full = cache.stats()["layers"]
            assert (sliding["kind"], sliding["retained_tokens"]) == ("sliding", 4)
            assert (full["kind"], full["retained_tokens"]) == ("attention", 8)
            cache.reset()


def test_policy_resolves_layer_budgets_and_checks_protected_slots_per_layer():
    policy = el.Policy(el.SinkTokens(2), el.RecentWindow(0.5), budget=10, allocation=el.Ramp(0.5))
    budgets = [int(policy.resolve_budget(torch.tensor([50]), layer, 3)) for layer in range(3)]
    assert budgets == [5, 10, 15] and sum(budgets) == 30
    with pytest.raises(ValueError, match=r"layer 0 of 3 .*budget of 5 tokens cannot hold .* = 8"):
        el.Policy(el.SinkTokens(4), el.RecentWindow(4), budget=12, allocation=el.Ramp(0.6)).resolve_budget(
            torch.tensor([50]), 0, 3
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [({"drop": 0}, ">= 1 token"), ({"drop": 1.0}, r"in \(0, 1\)"), ({"drop": 8}, r"below the budget \(allowed: 1..7"),
     ({"drop": "half"}, "expected an int"), ({"allocation": "ramp"}, "expected Uniform"),
     ({"allocation": el.Uniform(), "budget": 8, "drop": 9}, "below the budget")],
    ids=["zero", "float-one", "equal-budget", "string", "allocation-string", "above-budget"],
)
def test_bad_drop_and_allocation(kwargs, match):
    kwargs = {"budget": 8, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        el.Policy(el.RecentWindow(), **kwargs)


def test_spread_out_of_range():
    with pytest.raises(ValueError, match=r"spread must be a number in \[0, 1\)"):
        el.Ramp(1.5)
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match=r"ByLayerKind\(sliding=.*\): sliding must be a number in \(0, 1\]"):
            el.ByLayerKind(bad)


def test_drop_amount_evicts_m_at_once_then_refills():
    """Scissorhands Algorithm 1-2: when the cache exceeds B, m tokens go at once; it then grows back."""
    policy = el.Policy(el.RecentWindow(), budget=8, drop=0.5)
    store = el.SlotStore(policy)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 1, 30, 4, generator=g), torch.randn(1, 1, 30, 4, generator=g), torch.randn(1, 1, 30, 4, generator=g)
    counts = []
    for i in range(30):
        store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=1.0)
        counts.append(int(store.retained()))
    # fills to 8, then each time a 9th arrives 4 go: 9 -> 5, grows to 8 again
    assert counts[:8] == list(range(1, 9))
    assert counts[8:16] == [5, 6, 7, 8, 5, 6, 7, 8]
    assert max(counts) <= 8 and store.capacity == 9


def test_int_drop_against_a_small_float_budget_is_refused_when_resolved():
    policy = el.Policy(el.RecentWindow(), budget=0.1, min_budget=1, drop=4)
    assert policy.resolve_budget(torch.tensor([100])).tolist() == [10]
    with pytest.raises(ValueError, match="drop amount 4 is not below the budget 2"):
        policy.resolve_budget(torch.tensor([20]))
