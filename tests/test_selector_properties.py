"""Properties every selector keeps, on random shapes, budgets, batches and padding (hypothesis):

- no head holds more than its budget;
- protected slots (RecentWindow, SinkTokens) are never evicted (while the drop amount leaves enough
  unprotected tokens to drop: a drop larger than that must take protected ones, oldest first);
- no slot holds a token from the future, none holds a token twice;
- eviction is per (batch row, KV head): one head's kept set does not change when another head's or
  another row's queries, keys and values change.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evictlayers as el
from reference_scorers import single_thread  # noqa: F401 (autouse fixture)

SELECTORS = {
    "cumulative": lambda: el.HeavyHitterSelector(el.Cumulative()),
    "averaged": lambda: el.HeavyHitterSelector(el.Averaged()),
    "windowed": lambda: el.HeavyHitterSelector(el.Windowed(3)),
    "low_score": lambda: el.HeavyHitterSelector(el.LowScoreCounter(window=4)),
    "low_score_alpha": lambda: el.HeavyHitterSelector(el.LowScoreCounter(window=2, threshold=0.2)),
    "ahakv": lambda: el.HeavyHitterSelector(el.Windowed(3), el.StepGainSoftmax(), el.ValuePrior(3)),
    "keydiff": lambda: el.HeavyHitterSelector(el.KeyDiff()),
    "knorm_pooled": lambda: el.HeavyHitterSelector(el.KeyNorm(), pool=3, pool_reduce="max"),
    "local": lambda: None,
}
PROPERTY_SETTINGS = settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def scenarios(draw):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    groups = draw(st.integers(1, 2))
    lengths = [draw(st.integers(1, 14)) for _ in range(batch)]
    decode = draw(st.integers(0, 8))
    sinks = draw(st.integers(0, 2))
    recent = draw(st.integers(0, 3))
    budget = draw(st.one_of(st.integers(max(1, sinks + recent), 12), st.sampled_from([0.3, 0.5, 1.0])))
    chunked = draw(st.booleans())
    # a float budget is resolved from the first step's real tokens (the first chunk of the prompt)
    prompt = max(lengths)
    first = prompt // 2 if chunked and prompt > 1 else prompt
    firsts = [max(1, first - (prompt - n)) for n in lengths]
    if isinstance(budget, float) and min(int(budget * n + 0.5) for n in firsts) < max(1, sinks + recent):
        budget = max(1, sinks + recent) + 2  # a fraction of a short prompt cannot hold the protected slots
    drop = draw(st.integers(1, 6))
    if isinstance(budget, float) or (drop > 1 and drop >= budget):
        drop = 1
    pad_decode = draw(st.lists(st.booleans(), min_size=decode, max_size=decode))
    seed = draw(st.integers(0, 2**16))
    return dict(batch=batch, kv_heads=kv_heads, groups=groups, lengths=lengths, decode=decode, sinks=sinks,
                recent=recent, budget=budget, drop=drop, chunked=chunked, pad_decode=pad_decode, seed=seed)


def _policy(kind, s):
    modules = [el.SinkTokens(s["sinks"])] if s["sinks"] else []
    modules += [el.RecentWindow(s["recent"])] if s["recent"] else []
    selector = SELECTORS[kind]()
    return el.Policy(*modules, *([selector] if selector is not None else []), budget=s["budget"], drop=s["drop"])


def _inputs(s, perturb: bool):
    """Left-padded prompts then decode steps; ``perturb`` changes the last KV head and the last row."""
    g = torch.Generator().manual_seed(s["seed"])
    batch, heads, groups, d = s["batch"], s["kv_heads"], s["groups"], 4
    width = max(s["lengths"]) + s["decode"]
    q = torch.randn(batch, heads * groups, width, d, generator=g) * 2
    k = torch.randn(batch, heads, width, d, generator=g) * 2
    v = torch.randn(batch, heads, width, d, generator=g)
    if perturb:
        g2 = torch.Generator().manual_seed(s["seed"] + 1)
        for t, per_kv in ((q, groups), (k, 1), (v, 1)):
            if heads > 1:
                t[:, -per_kv:] = torch.randn(t[:, -per_kv:].shape, generator=g2)
            if batch > 1:
                t[-1] = torch.randn(t[-1].shape, generator=g2)
    prompt = max(s["lengths"])
    real = torch.zeros(batch, width, dtype=torch.bool)
    for b, n in enumerate(s["lengths"]):
        real[b, prompt - n : prompt] = True
        real[b, prompt:] = True
    for step, pad in enumerate(s["pad_decode"]):
        if pad and batch > 1:
            real[-1, prompt + step] = False  # a padding column mid-generation in the last row
    return q, k, v, real, prompt


def _run(kind, s, perturb=False):
    """Feed the scenario; yield (store, kept sets per (b, h)) after every step."""
    store = el.SlotStore(_policy(kind, s))
    q, k, v, real, prompt = _inputs(s, perturb)
    cuts = [0, prompt // 2, prompt] if s["chunked"] and prompt > 1 else [0, prompt]
    cuts += list(range(prompt + 1, q.shape[2] + 1))
    for start, stop in zip(cuts, cuts[1:]):
        store.step(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], real[:, start:stop], scaling=0.5)
        yield store


def _kept(store, b, h):
    pos = store.pos[b, h]
    return pos[pos >= 0].tolist()


@pytest.mark.parametrize("kind", SELECTORS)
@PROPERTY_SETTINGS
@given(s=scenarios())
def test_budget_protection_causality(kind, s):
    policy = _policy(kind, s)
    for store in _run(kind, s):
        budget = store.budget
        reserved = torch.stack(policy.reservations(budget)).sum(0) if policy.protections else torch.zeros_like(budget)
        drop = policy.drop_amount(budget)
        for b in range(s["batch"]):
            seen = int(store.seen[b])
            recent = min(int(policy.reservations(budget)[-1][b]), seen) if s["recent"] else 0
            protected = set(range(seen - recent, seen)) | set(range(min(s["sinks"], seen)))
            for h in range(s["kv_heads"]):
                kept = _kept(store, b, h)
                assert len(kept) <= int(budget[b]), (b, h, kept)
                assert len(set(kept)) == len(kept)
                assert all(0 <= p < seen for p in kept), (seen, kept)
                if int(drop[b]) <= int(budget[b]) + 1 - int(reserved[b]):
                    assert protected <= set(kept), (protected, kept)
                assert len(kept) > 0 or seen == 0


@pytest.mark.parametrize("kind", SELECTORS)
@PROPERTY_SETTINGS
@given(s=scenarios())
def test_each_row_and_head_evicts_on_its_own(kind, s):
    if s["batch"] == 1 and s["kv_heads"] == 1:
        return  # nothing else to perturb
    for original, perturbed in zip(_run(kind, s), _run(kind, s, perturb=True)):
        assert sorted(_kept(original, 0, 0)) == sorted(_kept(perturbed, 0, 0))


def test_a_drop_larger_than_the_unprotected_slots_takes_the_oldest_protected():
    """Local window with Scissorhands' m = 0.5 B: each overflow evicts the m oldest, never the newest."""
    store = el.SlotStore(el.Policy(el.RecentWindow(), budget=8, drop=0.5))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 40, 4, generator=g) for _ in range(3))
    for i in range(40):
        store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=1.0)
        kept = sorted(_kept(store, 0, 0))
        assert kept == list(range(i + 1 - len(kept), i + 1)), (i, kept)
