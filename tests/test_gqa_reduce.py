"""GQA: the query heads sharing a KV head combine their attention by a named option (sum/mean/max).

With ``H_q = 2 * H_kv`` and a full cache, the scorers' state equals a per-query-head reference reduced
over each group: Cumulative (column sums of a step, then reduced; for ``max`` the maximum of the
heads' per-step sums), Windowed (each of the last ``r`` rows reduced), LowScoreCounter (threshold
``G/t`` on the summed group, ``1/t`` on its mean or max).
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch

import evictlayers as el
from reference_scorers import single_thread  # noqa: F401 (autouse fixture)

KV_HEADS, GROUP, N, D = 2, 2, 24, 8
REDUCE = {"sum": lambda t: t.sum(0), "mean": lambda t: t.mean(0), "max": lambda t: t.amax(0)}
SCHEDULES = {"decode": [1] * N, "prefill+decode": [10] + [1] * (N - 10)}


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, KV_HEADS * GROUP, N, D, generator=g) * 2
    k = torch.randn(1, KV_HEADS, N, D, generator=g) * 2
    v = torch.randn(1, KV_HEADS, N, D, generator=g)
    return q, k, v


@lru_cache(maxsize=1)
def _reference_probs(seed=0):
    """``[H_q, N, N]`` causal softmax of every query head (query ``i`` over keys ``0..i``), loops only."""
    q, k, _ = _data(seed)
    probs = torch.zeros(KV_HEADS * GROUP, N, N, dtype=torch.float64)
    for h in range(KV_HEADS * GROUP):
        kv = h // GROUP  # heads 0..G-1 share KV head 0 (the repeat_kv layout)
        for i in range(N):
            logits = [float(q[0, h, i].double() @ k[0, kv, j].double()) / math.sqrt(D) for j in range(i + 1)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            for j, w in enumerate(weights):
                probs[h, i, j] = w / sum(weights)
    return probs


def _run(selector, schedule, gqa_reduce):
    q, k, v = _data()
    store = el.SlotStore(el.Policy(selector, gqa_reduce=gqa_reduce))
    start = 0
    for size in SCHEDULES[schedule]:
        sl = slice(start, start + size)
        store.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], scaling=D**-0.5)
        start += size
    assert store.pos[0, 0, :N].tolist() == list(range(N))  # a full cache keeps every token in order
    return store, _reference_probs()


def _group(probs, kv):
    return probs[kv * GROUP : (kv + 1) * GROUP]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("how", REDUCE)
def test_cumulative_mass_is_the_group_reduction(how, schedule):
    store, probs = _run(el.HeavyHitterSelector(el.Cumulative()), schedule, how)
    bounds, start = [], 0
    for size in SCHEDULES[schedule]:
        bounds.append((start, start + size))
        start += size
    for kv in range(KV_HEADS):
        group = _group(probs, kv)  # [G, N, N]
        expected = sum(REDUCE[how](group[:, a:b].sum(1)) for a, b in bounds)
        assert torch.allclose(store.state["score"][0, kv, :N].double(), expected, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("how", REDUCE)
def test_windowed_rows_are_reduced_row_by_row(how, schedule):
    rows = 5
    store, probs = _run(el.HeavyHitterSelector(el.Windowed(rows)), schedule, how)
    score = store.policy.selector.accumulator.score(store.state, None)
    for kv in range(KV_HEADS):
        expected = REDUCE[how](_group(probs, kv)[:, N - rows :]).sum(0)
        assert torch.allclose(score[0, kv, :N].double(), expected, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("how", REDUCE)
def test_low_score_threshold_follows_the_reduction(how, schedule):
    window = 6
    store, probs = _run(el.HeavyHitterSelector(el.LowScoreCounter(window=window)), schedule, how)
    counts = store.policy.selector.accumulator.counts(store.state)
    scale = GROUP if how == "sum" else 1
    for kv in range(KV_HEADS):
        reduced = REDUCE[how](_group(probs, kv))  # [N, N]
        expected = torch.zeros(N, dtype=torch.float64)
        for i in range(N - window, N):
            for j in range(i + 1):
                expected[j] += float(reduced[i, j] < scale / (i + 1))
        assert counts[0, kv, :N].double().tolist() == expected.tolist()


def test_sum_is_the_default_and_the_option_round_trips_through_recipes(tmp_path):
    policy = el.Policy(el.HeavyHitterSelector(el.Windowed(4)), budget=8)
    assert policy.gqa_reduce == "sum"
    for how in REDUCE:
        policy = el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.Windowed(4)), budget=8, gqa_reduce=how)
        el.dump_recipe(policy, tmp_path / f"{how}.yaml")
        assert el.load_recipe(tmp_path / f"{how}.yaml").gqa_reduce == how
    with pytest.raises(ValueError, match=r"gqa_reduce='median'.*\('sum', 'mean', 'max'\)"):
        el.Policy(budget=8, gqa_reduce="median")
