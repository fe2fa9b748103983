"""Properties every selector keeps, on random shapes, budgets, batches and padding (hypothesis):

- no head holds more than its budget, and none evicts while its row has fed no more than the budget;
- protected slots (RecentWindow, SinkTokens) are never evicted (while the drop amount leaves enough
  unprotected tokens to drop: a drop larger than that must take protected ones, oldest first);
- no slot holds a token from the future, none holds a token twice;
- eviction is per (batch row, KV head): one head's kept set does not change when another head's or
  another row's queries, keys and values change.

The scenarios, the selectors and the checks live in tests/selector_cases.py (shared with
tests/test_ahakv_algorithm1.py); the expected budgets and protected positions are computed there from
the modules' documented rules, not read from the policy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

import evictlayers as el
from reference_scorers import single_thread  # noqa: F401 (autouse fixture)
from selector_cases import (
    PROPERTY_SETTINGS,
    SELECTORS,
    check_budget_protection_causality,
    check_rows_and_heads_evict_independently,
    kept_positions,
    scenarios,
)


@pytest.mark.parametrize("kind", SELECTORS)
@PROPERTY_SETTINGS
@given(s=scenarios())
def test_budget_protection_causality(kind, s):
    check_budget_protection_causality(SELECTORS[kind], s)


@pytest.mark.parametrize("kind", SELECTORS)
@PROPERTY_SETTINGS
@given(s=scenarios(perturbable=True))
def test_each_row_and_head_evicts_on_its_own(kind, s):
    check_rows_and_heads_evict_independently(SELECTORS[kind], s)


def test_a_drop_larger_than_the_unprotected_slots_takes_the_oldest_protected():
    """Local window with Scissorhands' m = 0.5 B: each overflow evicts the m oldest, never the newest."""
    budget, m = 8, 4  # m = floor(0.5 * 8)
    store = el.SlotStore(el.Policy(el.RecentWindow(), budget=budget, drop=0.5))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 40, 4, generator=g) for _ in range(3))
    held = 0
    for i in range(40):
        store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=1.0)
        held += 1
        if held > budget:
            held -= m
        kept = sorted(kept_positions(store, 0, 0))
        assert kept == list(range(i + 1 - held, i + 1)), (i, kept)
