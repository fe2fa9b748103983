"""Windowed, LowScoreCounter, StepGainSoftmax and ValuePrior equal the papers' equations step by step
(tests/reference_scorers.py), AhaKV's positional-bias claim holds on a random stream, and bad
arguments fail clearly."""

import math
from pathlib import Path

import pytest
import torch

import evictlayers as el
from evictlayers.kernels import dispatch
from evictlayers.scoring import SlotView
from reference_scorers import ReferenceCache, single_thread  # noqa: F401 (autouse fixture)

N, D = 40, 16
SCHEDULES = {
    "decode": [1] * N,
    "prefill+decode": [18] + [1] * (N - 18),
    "two-chunks+decode": [12, 9] + [1] * (N - 21),
}


def _selector(scorer, sg, pool):
    if scorer[0] == "windowed":
        accumulator = el.Windowed(scorer[1])
    elif scorer[0] == "windowed_max":
        accumulator = el.Windowed(scorer[1], reduce="max")
    elif scorer[0] == "low":
        accumulator = el.LowScoreCounter(window=scorer[1], threshold=scorer[2])
    else:
        accumulator = el.Cumulative()
    return el.HeavyHitterSelector(
        accumulator, transform=el.StepGainSoftmax() if sg else None, prior=el.ValuePrior(pool) if pool else None
    )


def _library_scores(store, scorer):
    selector = store.policy.selector
    if scorer[0] == "low":
        values = -selector.accumulator.counts(store.state)
    else:
        values = selector.score(store.state, SlotView(pos=store.pos, seen=store.seen, budget=store.budget))
    pos = store.pos[0, 0]
    return {int(p): float(values[0, 0, s]) for s, p in enumerate(pos.tolist()) if p >= 0}


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """Score with the reference attention: Algorithm 2's counter compares each probability with 1/t, a
    step function, so the last-bit differences of the fused CPU prefill (tested against the reference
    in test_kernels_cpu.py) can flip a count where a probability sits on the threshold."""
    monkeypatch.setenv("EVICTLAYERS_KERNELS", "reference")
    dispatch.reload_kernel_choice()
    yield
    monkeypatch.undo()
    dispatch.reload_kernel_choice()


def _compare(scorer, *, budget, schedule, recent=0, sinks=0, drop=1, sg=False, pool=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(N, D, generator=g) * 2 for _ in range(3))
    modules = ([el.SinkTokens(sinks)] if sinks else []) + ([el.RecentWindow(recent)] if recent else [])
    store = el.SlotStore(el.Policy(*modules, _selector(scorer, sg, pool), budget=budget, drop=drop))
    reference = ReferenceCache(q, k, v, budget=budget, scorer=scorer, recent=recent, sinks=sinks, drop=drop,
                               sg=sg, pool=pool)
    start = 0
    for size in SCHEDULES[schedule]:
        stop = start + size
        store.step(q[None, None, start:stop], k[None, None, start:stop], v[None, None, start:stop], scaling=D**-0.5)
        reference.step(stop)
        kept = _library_scores(store, scorer)
        assert set(kept) == set(reference.retained), f"tokens {start}..{stop - 1}"
        expected = reference.scores(reference.retained)
        for j, value in kept.items():
            assert value == pytest.approx(expected[j], rel=1e-4, abs=1e-5), f"token {j} after {stop - 1}"
        if budget is not None:
            assert int(store.retained().max()) <= budget
        start = stop
    return store


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("rows,budget,recent", [(4, 8, 0), (6, 10, 3), (1, 6, 2)], ids=str)
def test_windowed_matches_eq_5(schedule, rows, budget, recent):
    _compare(("windowed", rows), budget=budget, schedule=schedule, recent=recent, seed=rows)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("rows,budget,recent", [(4, 8, 0), (6, 10, 3), (1, 6, 2)], ids=str)
def test_windowed_max_keeps_the_largest_row_of_the_window(schedule, rows, budget, recent):
    _compare(("windowed_max", rows), budget=budget, schedule=schedule, recent=recent, seed=rows + 10)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "window,threshold,budget,recent,drop",
    [(6, "1/t", 10, 2, 1), (6, "1/t", 12, 2, 5), (4, 0.05, 10, 0, 4), (10, "1/t", 8, 3, 1)],
    ids=str,
)
def test_low_score_counter_matches_algorithm_2(schedule, window, threshold, budget, recent, drop):
    _compare(("low", window, threshold), budget=budget, schedule=schedule, recent=recent, drop=drop, seed=window)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("scorer", [("windowed", 5), ("cumulative",)], ids=lambda s: s[0])
def test_step_gain_softmax_matches_eq_9_12(schedule, scorer):
    _compare(scorer, budget=9, schedule=schedule, recent=2, sg=True, seed=3)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pool", [1, 3, 5])
def test_value_prior_matches_eq_13_15(schedule, pool):
    _compare(("windowed", 4), budget=9, schedule=schedule, recent=2, pool=pool, seed=pool)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("budget,recent,sinks", [(10, 4, 0), (12, 3, 2)], ids=str)
def test_ahakv_composition_matches_algorithm_1(schedule, budget, recent, sinks):
    _compare(("windowed", 6), budget=budget, schedule=schedule, recent=recent, sinks=sinks, sg=True, pool=3, seed=7)


def test_value_prior_pools_a_whole_prompt_like_avgpool():
    """One prefill step: gamma is the moving average of ||v||^2 (mean over the neighbours that exist)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 11, 4, generator=g) for _ in range(3))
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.Windowed(3), prior=el.ValuePrior(5))))
    store.step(q, k, v, scaling=0.5)
    nu = v[0, 0].pow(2).sum(-1)
    pooled = torch.nn.functional.avg_pool1d(nu[None, None], 5, stride=1, padding=2, count_include_pad=False)[0, 0]
    assert torch.allclose(store.policy.selector.prior.pooled(store.state)[0, 0], pooled, atol=1e-6)


def test_step_gain_is_sqrt_2_log_i_over_k_and_the_models_softmax_up_to_the_budget():
    gain = el.StepGainSoftmax().score_gain(torch.tensor([[0, 9, 10, 99, -1]]), torch.tensor([10]))
    expected = torch.tensor([1.0, 1.0, (2 * math.log(11 / 10)) ** 0.5, (2 * math.log(10.0)) ** 0.5, 1.0])
    assert torch.allclose(gain[0], expected)
    assert el.StepGainSoftmax().score_gain(torch.tensor([[5]]), None) is None


def test_step_gain_changes_scoring_only_never_the_output():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 30, 8, generator=g) * scale for scale in (3, 1, 1))
    outs = []
    for transform in (None, el.StepGainSoftmax()):
        store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.Windowed(4), transform=transform), budget=30))
        outs.append(store.step(q, k, v, scaling=8**-0.5))
    assert torch.equal(outs[0], outs[1])


def test_used_by_example_runs_on_a_full_cache():
    policy = el.Policy(el.RecentWindow(32), el.HeavyHitterSelector(accumulator=el.Windowed()))
    store = el.SlotStore(policy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    store.step(q[:, :, :30], k[:, :, :30], v[:, :, :30], scaling=0.3)
    for i in range(30, 40):
        store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.3)
    assert store.retained().tolist() == [[40, 40]]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().double()


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def test_cumulative_score_falls_with_position_while_windowed_stays_flat():
    """AhaKV Sec. 4.1: on i.i.d. Gaussian queries/keys, E[S_j] of the accumulated score decreases with
    the position j (Eq. 4), while the recent accumulation of Eq. 5 does not depend on it. Measured as the
    Spearman correlation between position and score over the tokens every window row can see, averaged
    over seeds."""
    n, d, rows = 256, 16, 32
    candidates = torch.arange(n - rows)  # tokens visible to all of the last `rows` queries
    correlations = {"cumulative": [], "windowed": []}
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
        for name, accumulator in (("cumulative", el.Cumulative()), ("windowed", el.Windowed(rows))):
            store = el.SlotStore(el.Policy(el.HeavyHitterSelector(accumulator)))
            store.step(q, k, v, scaling=d**-0.5)
            view = SlotView(pos=store.pos, seen=store.seen, budget=None)
            score = store.policy.selector.score(store.state, view)[0, 0]
            correlations[name].append(_spearman(store.pos[0, 0][candidates].double(), score[candidates].double()))
    cumulative = sum(correlations["cumulative"]) / 6
    windowed = sum(correlations["windowed"]) / 6
    assert cumulative < -0.5, correlations
    assert abs(windowed) < 0.1, correlations


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: el.Windowed(0), r"Windowed\(rows=0\): rows must be an int >= 1"),
        (lambda: el.Windowed(2.5), r"Windowed\(rows=2.5\): rows must be an int >= 1"),
        (lambda: el.Windowed(4, reduce="mean"), r"Windowed\(reduce='mean'\): reduce must be one of 'sum', 'max'"),
        (lambda: el.LowScoreCounter(window=0), r"LowScoreCounter\(window=0\): window must be an int >= 1"),
        (lambda: el.LowScoreCounter(threshold="1/n"), r"threshold='1/n'.*expected \"1/t\" or a number in \(0, 1\]"),
        (lambda: el.LowScoreCounter(threshold=None), r"threshold=None.*expected \"1/t\" or a number"),
        (lambda: el.LowScoreCounter(threshold=1.5), r"threshold=1.5.*must be in \(0, 1\]"),
        (lambda: el.LowScoreCounter(threshold=0), r"threshold=0.*must be in \(0, 1\]"),
        (lambda: el.ValuePrior(pool=4), r"ValuePrior\(pool=4\): pool must be an odd int >= 1"),
        (lambda: el.ValuePrior(pool=0), r"ValuePrior\(pool=0\): pool must be an odd int >= 1"),
        (lambda: el.ValuePrior(pool=-3), r"ValuePrior\(pool=-3\): pool must be an odd int >= 1"),
        (lambda: el.HeavyHitterSelector(el.Windowed(), transform=el.ValuePrior()), "expected a ScoreTransform"),
        (lambda: el.HeavyHitterSelector(el.Windowed(), prior=el.StepGainSoftmax()), "expected a ScorePrior"),
        (lambda: el.HeavyHitterSelector(el.LowScoreCounter(), prior=el.ValuePrior()), "would invert them"),
    ],
    ids=["rows-0", "rows-float", "reduce-unknown", "window-0", "threshold-string", "threshold-none", "threshold-big",
         "threshold-zero", "pool-even", "pool-0", "pool-negative", "transform-type", "prior-type", "prior-on-counter"],
)
def test_bad_arguments_name_the_value_and_the_allowed_range(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_threshold_accepts_1_over_t_and_numbers():
    assert el.LowScoreCounter(threshold=" 1/t").threshold == "1/t"
    assert el.LowScoreCounter(threshold=1).threshold == 1.0


RECIPES = Path(el.__file__).parent / "recipes"


def test_shipped_recipes_are_the_papers_compositions():
    assert el.load_recipe(RECIPES / "ahakv_windowed.yaml") == el.Policy(
        el.RecentWindow(32),
        el.HeavyHitterSelector(el.Windowed(32), transform=el.StepGainSoftmax(), prior=el.ValuePrior(5)),
        budget=0.2,
    )
    assert el.load_recipe(RECIPES / "h2o_windowed.yaml") == el.Policy(
        el.RecentWindow(32), el.HeavyHitterSelector(accumulator=el.Windowed()), budget=0.2
    )
    scissorhands = el.load_recipe(RECIPES / "scissorhands.yaml")
    assert isinstance(scissorhands.selector.accumulator, el.LowScoreCounter)
    assert scissorhands.drop == 0.5 and scissorhands.budget == 0.2


def test_h2o_recipe_still_dumps_without_optional_parts():
    text = el.dump_recipe(el.load_recipe(RECIPES / "h2o.yaml"))
    assert "transform" not in text and "prior" not in text


def test_new_compositions_keep_a_padded_batch_equal_to_each_row_alone():
    """Through generate() on a tiny GQA Llama: the rings index real rows, so left padding changes nothing."""
    from tiny_models import build, left_padded

    model = build("llama")
    ids, mask = left_padded([20, 13])
    policies = [
        el.Policy(
            el.RecentWindow(2), el.HeavyHitterSelector(el.Windowed(4), el.StepGainSoftmax(), el.ValuePrior(3)), budget=6
        ),
        el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.LowScoreCounter(window=4)), budget=6, drop=0.5),
    ]

    def generate(x, m, cache=None):
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=m, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0, past_key_values=cache)
        return torch.stack(out.logits, dim=1)

    full = generate(ids, mask)
    for policy in policies:
        with el.apply(model, policy) as run:
            batched = generate(ids, mask, run.new_cache())
            for row in range(2):
                alone = ids[row][mask[row].bool()][None]
                solo = generate(alone, torch.ones_like(alone), run.new_cache())[0]
                assert torch.allclose(batched[row], solo, atol=1e-4)
        assert (batched - full).abs().max() > 1e-3  # something was evicted
