"""The slot store's retained set equals H2O Algorithm 1 (tests/reference_h2o.py), step by step."""

import pytest
import torch

import evictlayers as el
from reference_h2o import h2o_reference


def _retained(store: el.SlotStore, head: int = 0) -> set[int]:
    pos = store.pos[0, head]
    return set(pos[pos >= 0].tolist())


@pytest.mark.parametrize("budget,recent", [(6, 0), (10, 0), (10, 3), (10, 5), (1, 0)], ids=lambda v: str(v))
@pytest.mark.parametrize("averaged", [False, True], ids=["cumulative", "averaged"])
def test_decode_matches_algorithm_1_step_by_step(budget, recent, averaged):
    torch.manual_seed(budget * 31 + recent)
    n, d = 48, 16
    q, k, v = torch.randn(n, d) * 2, torch.randn(n, d) * 2, torch.randn(n, d)
    accumulator = el.Averaged() if averaged else el.Cumulative()
    modules = ([el.RecentWindow(recent)] if recent else []) + [el.HeavyHitterSelector(accumulator)]
    store = el.SlotStore(el.Policy(*modules, budget=budget))
    reference = h2o_reference(q, k, budget, recent, averaged=averaged)
    for i in range(n):
        store.step(q[None, None, i : i + 1], k[None, None, i : i + 1], v[None, None, i : i + 1], scaling=d**-0.5)
        assert _retained(store) == reference[i], f"step {i}"
        assert store.capacity == budget + 1


def test_each_kv_head_evicts_on_its_own():
    """Two KV heads with different keys keep different sets; each matches its own reference run."""
    torch.manual_seed(1)
    n, d, budget = 30, 8, 5
    q, k, v = torch.randn(2, n, d) * 2, torch.randn(2, n, d) * 2, torch.randn(2, n, d)
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.Cumulative()), budget=budget))
    for i in range(n):
        store.step(q[None, :, i : i + 1], k[None, :, i : i + 1], v[None, :, i : i + 1], scaling=d**-0.5)
    sets = [_retained(store, head) for head in range(2)]
    assert sets[0] != sets[1]
    for head in range(2):
        assert sets[head] == h2o_reference(q[head], k[head], budget)[-1]


def test_prefill_keeps_top_column_sums_then_decodes_as_algorithm_1():
    """A prompt longer than the budget is scored by its attention column sums (full causal softmax)
    and the top-``budget`` columns are kept; decoding then continues as Algorithm 1."""
    torch.manual_seed(2)
    n_prompt, n, d, budget = 24, 36, 16, 8
    q, k, v = torch.randn(n, d) * 2, torch.randn(n, d) * 2, torch.randn(n, d)
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.Cumulative()), budget=budget))
    store.step(q[None, None, :n_prompt], k[None, None, :n_prompt], v[None, None, :n_prompt], scaling=d**-0.5)

    logits = (q[:n_prompt] @ k[:n_prompt].T) / d**0.5
    logits = logits.masked_fill(torch.ones(n_prompt, n_prompt).triu(1).bool(), float("-inf"))
    column_sums = torch.softmax(logits, -1).sum(0)
    kept = set(column_sums.topk(budget).indices.tolist())
    assert _retained(store) == kept

    # continue with the reference's decode rule from the same state
    score = {j: float(column_sums[j]) for j in kept}
    retained = sorted(kept)
    for i in range(n_prompt, n):
        candidates = retained + [i]
        weights = torch.softmax(torch.stack([q[i] @ k[j] for j in candidates]) / d**0.5, 0)
        score[i] = 0.0
        for j, w in zip(candidates, weights.tolist()):
            score[j] += w
        candidates.remove(min(candidates, key=score.get))
        retained = candidates
        store.step(q[None, None, i : i + 1], k[None, None, i : i + 1], v[None, None, i : i + 1], scaling=d**-0.5)
        assert _retained(store) == set(retained), f"step {i}"
