"""Shared cases for the properties every selector keeps (tests/test_selector_properties.py runs them for
``SELECTORS``; tests/test_ahakv_algorithm1.py for AhaKV's Algorithm 1 selector). Not a test module.

Random shapes, budgets, batches and padding come from the ``scenarios`` strategy (hypothesis). The
expected budget, tokens seen and protected positions are computed here from the scenario and the
modules' documented rules, never read back from the policy or the store:

- a budget is an ``int`` number of tokens per KV head, or a ``float`` fraction of each row's real
  tokens in the first step, rounded half up, at least ``min_budget`` (``Policy``; 1 here, so that a
  fraction of these short prompts stays a fraction);
- ``SinkTokens(n)`` keeps positions ``0 .. n-1`` of the row's real tokens (padding is not counted);
- ``RecentWindow(size)`` keeps the ``size`` newest real tokens, a ``float`` size being that fraction of
  the row's budget rounded down;
- a head over budget evicts ``drop`` tokens at once (``Policy(drop=...)``, an ``int`` here), the
  lowest-ranked unprotected first; protected ones go only when fewer than ``drop`` of the
  ``budget + 1`` tokens held at that moment are unprotected.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import evictlayers as el

SelectorFactory = Callable[[], "torch.nn.Module | None"]  # a fresh selector, or None for none

SELECTORS: dict[str, SelectorFactory] = {
    "cumulative": lambda: el.HeavyHitterSelector(el.Cumulative()),
    "averaged": lambda: el.HeavyHitterSelector(el.Averaged()),
    "windowed": lambda: el.HeavyHitterSelector(el.Windowed(3)),
    "low_score": lambda: el.HeavyHitterSelector(el.LowScoreCounter(window=4)),
    "low_score_alpha": lambda: el.HeavyHitterSelector(el.LowScoreCounter(window=2, threshold=0.2)),
    "ahakv": lambda: el.HeavyHitterSelector(el.Windowed(3), el.StepGainSoftmax(), el.ValuePrior(3)),
    "keydiff": lambda: el.HeavyHitterSelector(el.KeyDiff()),
    "knorm_pooled": lambda: el.HeavyHitterSelector(el.KeyNorm(), refine=[el.PooledScores(3, reduce="max")]),
    "local": lambda: None,  # no selector: the unprotected slots go to the most recent tokens
}
PROPERTY_SETTINGS = settings(
    max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
HEAD_DIM = 4


@st.composite
def scenarios(draw, perturbable: bool = False):
    """A scenario; ``perturbable=True`` ones have a second row or a second KV head to perturb."""
    if perturbable:
        batch, kv_heads = draw(st.sampled_from([(1, 2), (2, 1), (2, 2)]))
    else:
        batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    groups = draw(st.integers(1, 2))
    lengths = [draw(st.integers(1, 14)) for _ in range(batch)]
    decode = draw(st.integers(0, 8))
    sinks = draw(st.integers(0, 2))
    recent = draw(st.one_of(st.integers(0, 3), st.sampled_from([0.25, 0.5])))
    # the smallest budget that holds the protected slots (a fraction <= 1/2 of b leaves b/2 >= sinks)
    smallest = max(1, sinks + recent) if isinstance(recent, int) else max(1, 2 * sinks)
    budget = draw(st.one_of(st.integers(smallest, 12), st.sampled_from([0.3, 0.5, 1.0])))
    chunked = draw(st.booleans())
    # a float budget is resolved from the first step's real tokens (the first chunk of the prompt)
    prompt = max(lengths)
    first = prompt // 2 if chunked and prompt > 1 else prompt
    firsts = [max(1, first - (prompt - n)) for n in lengths]
    if isinstance(budget, float) and min(int(budget * n + 0.5) for n in firsts) < smallest:
        budget = smallest + 2  # a fraction of a short prompt cannot hold the protected slots
    drop = draw(st.integers(1, 6))
    if isinstance(budget, float) or (drop > 1 and drop >= budget):
        drop = 1
    pad_decode = draw(st.lists(st.booleans(), min_size=decode, max_size=decode))
    seed = draw(st.integers(0, 2**16))
    return dict(batch=batch, kv_heads=kv_heads, groups=groups, lengths=lengths, decode=decode, sinks=sinks,
                recent=recent, budget=budget, drop=drop, chunked=chunked, pad_decode=pad_decode, seed=seed)


def make_policy(make_selector: SelectorFactory, s: dict) -> el.Policy:
    modules = [el.SinkTokens(s["sinks"])] if s["sinks"] else []
    modules += [el.RecentWindow(s["recent"])] if s["recent"] else []
    selector = make_selector()
    return el.Policy(*modules, *([selector] if selector is not None else []), budget=s["budget"], min_budget=1,
                     drop=s["drop"])


def make_inputs(s: dict, perturb: bool):
    """Left-padded prompts then decode steps; ``perturb`` changes the last KV head and the last row."""
    g = torch.Generator().manual_seed(s["seed"])
    batch, heads, groups, d = s["batch"], s["kv_heads"], s["groups"], HEAD_DIM
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


def run_scenario(
    make_selector: SelectorFactory, s: dict, perturb: bool = False
) -> Iterator[tuple[el.SlotStore, list[int]]]:
    """Feed the scenario step by step; yield ``(store, real tokens each row has fed)`` after every step."""
    store = el.SlotStore(make_policy(make_selector, s))
    q, k, v, real, prompt = make_inputs(s, perturb)
    cuts = [0, prompt // 2, prompt] if s["chunked"] and prompt > 1 else [0, prompt]
    cuts += list(range(prompt + 1, q.shape[2] + 1))
    for start, stop in zip(cuts, cuts[1:]):
        store.step(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], real[:, start:stop], scaling=0.5)
        yield store, real[:, :stop].sum(1).tolist()


def kept_positions(store: el.SlotStore, b: int, h: int) -> list[int]:
    pos = store.pos[b, h]
    return pos[pos >= 0].tolist()


def expected_budgets(s: dict, first_step_tokens: list[int]) -> list[int]:
    """Tokens per head of each row: the int budget, or the fraction of the row's first-step real tokens
    rounded half up (at least 1)."""
    if isinstance(s["budget"], int):
        return [s["budget"]] * s["batch"]
    return [max(1, int(s["budget"] * n + 0.5)) for n in first_step_tokens]


def expected_recent(s: dict, budget: int) -> int:
    """Tokens ``RecentWindow(s["recent"])`` keeps under a row budget of ``budget``."""
    return s["recent"] if isinstance(s["recent"], int) else math.floor(budget * s["recent"])


def expected_protected(s: dict, seen: int, budget: int) -> set[int]:
    """Positions the protections keep in a row that has fed ``seen`` real tokens: the first ``sinks``
    (SinkTokens) and the newest ``expected_recent`` (RecentWindow)."""
    return set(range(min(s["sinks"], seen))) | set(range(max(0, seen - expected_recent(s, budget)), seen))


def check_budget_protection_causality(make_selector: SelectorFactory, s: dict) -> None:
    """After every step, in every (row, KV head): at most ``budget`` tokens, each a distinct real position
    already fed; every token while the row has fed no more than its budget, and at least
    ``budget + 1 - drop`` once it has fed more; the protected positions while ``drop`` leaves enough
    unprotected tokens to evict."""
    budgets = None
    for store, seen_per_row in run_scenario(make_selector, s):
        if budgets is None:  # fixed from the first step's real tokens
            budgets = expected_budgets(s, seen_per_row)
        assert store.budget.tolist() == budgets
        for b, (seen, budget) in enumerate(zip(seen_per_row, budgets, strict=True)):
            protected = expected_protected(s, seen, budget)
            protections_hold = s["drop"] <= budget + 1 - (s["sinks"] + expected_recent(s, budget))
            for h in range(s["kv_heads"]):
                kept = kept_positions(store, b, h)
                assert len(set(kept)) == len(kept), (b, h, kept)
                assert all(0 <= p < seen for p in kept), (b, h, seen, kept)
                if seen <= budget:
                    assert sorted(kept) == list(range(seen)), (b, h, budget, kept)
                else:
                    assert budget + 1 - s["drop"] <= len(kept) <= budget, (b, h, budget, s["drop"], kept)
                if protections_hold:
                    assert protected <= set(kept), (b, h, protected, kept)


def check_rows_and_heads_evict_independently(make_selector: SelectorFactory, s: dict) -> None:
    """Row 0, KV head 0 keeps the same tokens when the last row's or the last KV head's queries, keys and
    values change (``s`` must be ``perturbable``: the last row or head is another one)."""
    assert s["batch"] > 1 or s["kv_heads"] > 1, "nothing else to perturb: draw it from scenarios(perturbable=True)"
    for (original, _), (perturbed, _) in zip(
        run_scenario(make_selector, s), run_scenario(make_selector, s, perturb=True), strict=True
    ):
        assert sorted(kept_positions(original, 0, 0)) == sorted(kept_positions(perturbed, 0, 0))
