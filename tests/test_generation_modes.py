"""Every ``generate()`` mode under ``el.apply``: with nothing evicted each equals the
unmodified model; under eviction, beam search's reordering is checked against stores fed the chosen
rows from scratch; modes that need to roll the cache back fail with a clear error."""

from __future__ import annotations

import pytest
import torch

import evictlayers as el
from tiny_models import build, left_padded, single_thread  # noqa: F401

LENGTHS = [20, 13]
NOTHING_EVICTED = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=64)


def _generate(model, policy, **kwargs):
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad():
        if policy is None:
            return model.generate(ids, attention_mask=mask, max_new_tokens=10, **kwargs)
        with el.apply(model, policy):
            return model.generate(ids, attention_mask=mask, max_new_tokens=10, **kwargs)


@pytest.mark.parametrize(
    "mode",
    [
        {"do_sample": False},
        {"do_sample": True, "top_k": 20},
        {"do_sample": True, "num_return_sequences": 3},
        {"num_beams": 3, "do_sample": False},
        {"num_beams": 2, "num_return_sequences": 2, "do_sample": False},
    ],
    ids=["greedy", "sampling", "sampling-3-sequences", "beam-3", "beam-2-return-2"],
)
def test_mode_with_nothing_evicted_equals_the_unmodified_model(mode):
    model = build("llama")
    torch.manual_seed(7)
    want = _generate(model, None, **mode)
    torch.manual_seed(7)
    got = _generate(model, NOTHING_EVICTED, **mode)
    assert torch.equal(got, want)


def test_beam_search_under_eviction_stays_in_budget_and_differs():
    model = build("llama")
    policy = el.Policy(el.SinkTokens(1), el.HeavyHitterSelector(el.KeyDiff(), share=0.5),
                       el.HeavyHitterSelector(el.Cumulative(), share=0.5), budget=6)
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad(), el.apply(model, policy) as run:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False)
        stats = run.stats()
    assert out.shape == (2, 30)
    assert all(layer["retained_tokens"] <= 6 for layer in stats["layers"])


def _store_after(policy, rows: list[int], q, k, v, steps: int, reorder: list[int] | None = None) -> el.SlotStore:
    """A store fed the prompts of ``rows`` then ``steps`` single tokens; ``reorder`` is applied to the
    batch after the prompt (as beam search does), through the transformers cache layer."""
    from evictlayers.hf.cache import EvictionLayer

    layer = EvictionLayer(policy)
    store = layer.store
    store.step(q[rows, :, :12], k[rows, :, :12], v[rows, :, :12], scaling=0.25)
    if reorder is not None:
        layer.reorder_cache(torch.tensor(reorder))
        store = layer.store
    for i in range(12, 12 + steps):
        store.step(q[:2, :, i : i + 1], k[:2, :, i : i + 1], v[:2, :, i : i + 1], scaling=0.25)
    return store


def test_reorder_moves_positions_and_every_state_with_the_rows():
    """Rows [0, 1] reordered to [1, 1] then decoded equal rows [1, 1] decoded from the start: positions,
    per-slot state (scores, windows), per-head state (KeyDiff's anchor) and keys all follow the rows."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    policy = el.Policy(el.RecentWindow(1), el.HeavyHitterSelector(el.Windowed(3), share=0.5),
                       el.HeavyHitterSelector(el.KeyDiff(), share=0.5), budget=6)
    moved = _store_after(policy, [0, 1], q, k, v, steps=0, reorder=[1, 1])
    fresh = _store_after(policy, [1, 1], q, k, v, steps=0)
    assert torch.equal(moved.pos, fresh.pos)
    assert set(moved.state) == {"0.window", "1.anchor"}
    for name in moved.state:
        torch.testing.assert_close(moved.state[name], fresh.state[name])
    torch.testing.assert_close(moved.keys, fresh.keys)
    # and decoding on from there keeps them equal (the new tokens are the same for both rows)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[0] = t[1]
    moved = _store_after(policy, [0, 1], q2, k2, v2, steps=5, reorder=[1, 1])
    fresh = _store_after(policy, [1, 1], q2, k2, v2, steps=5)
    assert torch.equal(moved.pos, fresh.pos)
    for name in moved.state:
        torch.testing.assert_close(moved.state[name], fresh.state[name])


@pytest.mark.parametrize("mode", ["assistant_model", "prompt_lookup_num_tokens"])
def test_generation_that_rolls_the_cache_back_is_refused_clearly(mode):
    model = build("llama")
    ids, mask = left_padded([20])
    option = {"assistant_model": build("llama", seed=1)} if mode == "assistant_model" else {mode: 3}
    with torch.no_grad(), el.apply(model, NOTHING_EVICTED):
        with pytest.raises(NotImplementedError, match=f"cannot be cropped.*given {mode}"):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **option)


def test_same_seed_same_tokens_twice_under_eviction():
    model = build("llama")
    policy = el.load_recipe("tova_keydiff")
    policy = el.Policy(*policy.modules_in_order, budget=12)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(_generate(model, policy, do_sample=True, top_k=10))
    assert torch.equal(runs[0], runs[1])
