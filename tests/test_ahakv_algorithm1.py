"""The shipped ``ahakv`` recipe follows AhaKV Algorithm 1 as written: ``RecentThenCumulative`` (the
prompt's last ``B_r`` rows weighted once by the value prior, then every generated row added unweighted)
under ``StepGainSoftmax``, against a plain-loop reference (tests/reference_scorers.py), step by step;
its recipe, validation, chunked prefill, padding, properties and compiled decode step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from torch._dynamo.utils import counters

import evictlayers as el
from evictlayers.compose.recipes import RecipeError, policy_from_dict
from evictlayers.scoring import RecentThenCumulative, SlotView
from reference_scorers import ReferenceAlgorithm1, single_thread  # noqa: F401 (autouse fixture)
from selector_cases import (
    PROPERTY_SETTINGS,
    check_budget_protection_causality,
    check_rows_and_heads_evict_independently,
    scenarios,
)

RECIPES = Path(el.__file__).parent / "recipes"
N, D = 48, 16


def _policy(budget: int, recent: int, pool: int | None, rows: int | None = None) -> el.Policy:
    accumulator = RecentThenCumulative(rows or recent, el.ValuePrior(pool) if pool else None)
    return el.Policy(el.RecentWindow(recent), el.HeavyHitterSelector(accumulator, el.StepGainSoftmax()), budget=budget)


def _scores(store) -> dict[int, float]:
    view = SlotView(pos=store.pos, seen=store.seen, budget=store.budget)
    values = store.policy.selector.score(store.state, view)
    return {int(p): float(values[0, 0, s]) for s, p in enumerate(store.pos[0, 0].tolist()) if p >= 0}


def _qkv(seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(N, D, generator=g) * 1.5 for _ in range(3))


def _step(store, q, k, v, start, stop):
    store.step(q[None, None, start:stop], k[None, None, start:stop], v[None, None, start:stop], scaling=D**-0.5)


@pytest.mark.parametrize("pool", [None, 1, 3, 5])
@pytest.mark.parametrize(
    "prompt,budget,recent",
    [(30, 12, 4), (20, 10, 6), (8, 12, 4), (3, 9, 5), (1, 10, 3)],
    ids=["prefill-evicts", "prefill-evicts-2", "prefill-under-budget", "prompt-shorter-than-rows", "stream"],
)
def test_matches_algorithm_1_step_by_step(prompt, budget, recent, pool):
    """Prefill then one token at a time, with eviction: the same kept tokens and the same F as the reference."""
    q, k, v = _qkv(seed=prompt + budget)
    store = el.SlotStore(_policy(budget, recent, pool))
    reference = ReferenceAlgorithm1(q, k, v, budget=budget, recent=recent, pool=pool)
    _step(store, q, k, v, 0, prompt)
    reference.prefill(prompt)
    for i in range(prompt, N + 1):
        kept = _scores(store)
        assert sorted(kept) == reference.retained, f"after token {i - 1}"
        for j, value in kept.items():
            assert value == pytest.approx(reference.F[j], rel=1e-4, abs=1e-6), f"token {j} after {i - 1}"
        assert len(kept) <= budget
        if i < N:
            _step(store, q, k, v, i, i + 1)
            reference.generate(i)


def test_the_prior_weights_the_prefill_only():
    """Line 10 then line 27: a generated row adds the same to a token with or without the prior."""
    q, k, v = _qkv(seed=5)
    stores = {pool: el.SlotStore(_policy(budget=40, recent=4, pool=pool)) for pool in (None, 3)}
    for store in stores.values():
        _step(store, q, k, v, 0, 20)
    before = {pool: _scores(store) for pool, store in stores.items()}
    assert any(before[3][j] < before[None][j] * 0.99 for j in before[3])  # the prior weighted the prompt
    for store in stores.values():
        _step(store, q, k, v, 20, 21)
    after = {pool: _scores(store) for pool, store in stores.items()}
    for j in before[3]:
        assert after[3][j] - before[3][j] == pytest.approx(after[None][j] - before[None][j], rel=1e-5, abs=1e-7)


def test_in_a_stream_the_prior_changes_nothing():
    """Fed one token at a time there is no multi-token prefill, so Algorithm 1's prior never weights."""
    q, k, v = _qkv(seed=2)
    kept = []
    for pool in (None, 5):
        store = el.SlotStore(_policy(budget=10, recent=3, pool=pool))
        for i in range(N):
            _step(store, q, k, v, i, i + 1)
        kept.append(_scores(store))
    assert kept[0] == kept[1]


@pytest.mark.parametrize("cut", [6, 15, 21], ids=lambda c: f"cut-{c}")
def test_a_prompt_in_chunks_scores_like_one_prefill(cut):
    """With a budget that holds the prompt, two chunks give the last ``rows`` rows of the whole prompt and
    the prior over the whole prompt, as one prefill does; decoding with eviction then agrees."""
    q, k, v = _qkv(seed=cut)
    one, two = (el.SlotStore(_policy(budget=24, recent=4, pool=3, rows=8)) for _ in range(2))
    _step(one, q, k, v, 0, 24)
    _step(two, q, k, v, 0, cut)
    _step(two, q, k, v, cut, 24)
    for i in range(24, N + 1):
        a, b = _scores(one), _scores(two)
        assert sorted(a) == sorted(b), i
        assert all(a[j] == pytest.approx(b[j], rel=1e-5, abs=1e-7) for j in a), i
        if i < N:
            _step(one, q, k, v, i, i + 1)
            _step(two, q, k, v, i, i + 1)


def test_shipped_recipes():
    assert el.load_recipe(RECIPES / "ahakv.yaml") == el.Policy(
        el.RecentWindow(32),
        el.HeavyHitterSelector(RecentThenCumulative(32, prefill_prior=el.ValuePrior(5)), el.StepGainSoftmax()),
        budget=0.2,
    )
    assert el.load_recipe(RECIPES / "ahakv_windowed.yaml") == el.Policy(
        el.RecentWindow(32),
        el.HeavyHitterSelector(el.Windowed(32), transform=el.StepGainSoftmax(), prior=el.ValuePrior(5)),
        budget=0.2,
    )


@pytest.mark.parametrize("prior", [None, el.ValuePrior(3)], ids=["no-prior", "prior"])
def test_recipe_round_trip(prior):
    policy = el.Policy(
        el.RecentWindow(4), el.HeavyHitterSelector(RecentThenCumulative(6, prefill_prior=prior), el.StepGainSoftmax()),
        budget=0.3,
    )
    accumulator = {"_component_": "RecentThenCumulative", "rows": 6}
    if prior is not None:
        accumulator["prefill_prior"] = {"_component_": "ValuePrior", "pool": 3}
    expected = {  # the recipe this policy is, written out (compose/recipes.py's format)
        "budget": 0.3, "drop": 1, "allocation": {"_component_": "Uniform"}, "gqa_reduce": "sum",
        "storage": {"_component_": "DenseKV"}, "positions": "absolute",
        "modules": [
            {"_component_": "RecentWindow", "size": 4},
            {"_component_": "HeavyHitterSelector", "accumulator": accumulator,
             "transform": {"_component_": "StepGainSoftmax"}},
        ],
    }
    text = el.dump_recipe(policy)
    assert yaml.safe_load(text) == expected
    assert yaml.safe_load(el.dump_recipe(policy_from_dict(yaml.safe_load(text)))) == expected


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: RecentThenCumulative(0), ValueError, r"RecentThenCumulative\(rows=0\): rows must be an int >= 1"),
        (lambda: RecentThenCumulative(2.5), ValueError, r"RecentThenCumulative\(rows=2.5\): rows must be an int"),
        (lambda: RecentThenCumulative(True), ValueError, r"RecentThenCumulative\(rows=True\): rows must be an int"),
        (lambda: RecentThenCumulative(4, prefill_prior=el.StepGainSoftmax()), TypeError,
         r"RecentThenCumulative\(prefill_prior=StepGainSoftmax\(\)\): expected a ScorePrior such as ValuePrior"),
        (lambda: RecentThenCumulative(4, prefill_prior="ValuePrior"), TypeError,
         r"RecentThenCumulative\(prefill_prior='ValuePrior'\): expected a ScorePrior"),
        (lambda: RecentThenCumulative(4, el.ValuePrior(pool=2)), ValueError, r"ValuePrior\(pool=2\)"),
    ],
    ids=["rows-0", "rows-float", "rows-bool", "prior-transform", "prior-string", "prior-bad-pool"],
)
def test_bad_arguments_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_bad_recipe_names_the_key():
    recipe = {"budget": 0.2, "modules": [{"_component_": "HeavyHitterSelector", "accumulator": {
        "_component_": "RecentThenCumulative", "rows": 0, "prefill_prior": {"_component_": "ValuePrior", "pool": 4}}}]}
    with pytest.raises(RecipeError) as caught:
        policy_from_dict(recipe, source="bad.yaml")
    assert "modules[0].accumulator.prefill_prior: ValuePrior(pool=4)" in str(caught.value)
    recipe["modules"][0]["accumulator"]["prefill_prior"]["pool"] = 3
    with pytest.raises(RecipeError, match=r"modules\[0\].accumulator: RecentThenCumulative\(rows=0\)"):
        policy_from_dict(recipe, source="bad.yaml")


def test_a_selector_prior_can_sit_beside_the_prefill_prior():
    """The prefill prior's state has its own names: both kinds of prior compose without a clash."""
    selector = el.HeavyHitterSelector(RecentThenCumulative(4, el.ValuePrior(3)), prior=el.ValuePrior(3))
    assert {"prior_sum", "prefill_prior_sum", "prefill_weight"} <= set(selector.state_specs)


# ---- the properties every selector keeps (tests/selector_cases.py), for this one ----------------------

def _algorithm1_selector() -> el.HeavyHitterSelector:
    return el.HeavyHitterSelector(RecentThenCumulative(3, el.ValuePrior(3)), el.StepGainSoftmax())


@PROPERTY_SETTINGS
@given(s=scenarios())
def test_budget_protection_causality(s):
    check_budget_protection_causality(_algorithm1_selector, s)


@PROPERTY_SETTINGS
@given(s=scenarios(perturbable=True))
def test_each_row_and_head_evicts_on_its_own(s):
    check_rows_and_heads_evict_independently(_algorithm1_selector, s)


# ---- through a model: padding and the compiled decode step --------------------------------------------

def _tiny_policy() -> el.Policy:
    selector = el.HeavyHitterSelector(RecentThenCumulative(4, el.ValuePrior(3)), el.StepGainSoftmax())
    return el.Policy(el.RecentWindow(2), selector, budget=6)


def test_a_padded_batch_equals_each_row_alone():
    """generate() on a tiny GQA Llama: padding rows are neither prompt rows nor generated rows."""
    from tiny_models import build, left_padded

    model = build("llama")
    ids, mask = left_padded([20, 13])

    def generate(x, m, cache=None):
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=m, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, past_key_values=cache)
        return torch.stack(out.logits, dim=1)

    full = generate(ids, mask)
    with el.apply(model, _tiny_policy()) as run:
        batched = generate(ids, mask, run.new_cache())
        for row in range(2):
            alone = ids[row][mask[row].bool()][None]
            solo = generate(alone, torch.ones_like(alone), run.new_cache())[0]
            assert torch.allclose(batched[row], solo, atol=1e-4)
    assert (batched - full).abs().max() > 1e-3  # something was evicted


def test_compiles_to_one_graph_with_the_same_logits_as_eager():
    """The decode step (a generated row, no prior update) is fixed-shape: the whole decode forward's two graphs
    (the first step's, then one generic over the step count), no recompiles after them."""
    from test_compile import decode_logits
    from tiny_models import build

    model = build("llama")
    eager, _ = decode_logits(model, _tiny_policy(), compile=False, steps=60)
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = decode_logits(model, _tiny_policy(), compile=True, steps=60)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the mask's length, then generic
    assert sum(counters["recompiles"].values()) == 0, dict(counters["recompiles"])
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
