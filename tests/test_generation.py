"""Generation under eviction: the budget bounds the store, padding is invisible, generate() is a plain
greedy loop over the cache, and a cache can be carried from one generate() call to the next.

Where nothing is evicted the reference is the unmodified model. Under eviction there is no outside
reference for the kept set itself, so the tests compare paths that must agree (padded batch vs each
row alone, generate() vs a hand-written loop, one generate() vs two) and check that eviction did
change the logits, so that none of these comparisons is vacuous.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import DynamicCache

import evictlayers as el
from tiny_models import (  # noqa: F401
    FAMILY_IMPLEMENTATIONS,
    build,
    greedy,
    kv_geometry,
    left_padded,
    positions,
    single_thread,
    unpad_row,
)

TOL = dict(rtol=1e-5, atol=1e-5)
LENGTHS = [20, 13]  # a left-padded batch of two prompts of different lengths
NEW_TOKENS = 10  # the longer row sees 30 tokens
BUDGET = 6

CASES = [pytest.param(name, impl, id=f"{name}-{impl}") for name, impl in FAMILY_IMPLEMENTATIONS]


def h2o(budget) -> el.Policy:
    # min_budget=1: a fraction of these short prompts is the budget itself, below the default floor
    return el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=budget, min_budget=1)


def row_budget(budget, length: int) -> int:
    """Tokens per head a row may keep: an int budget, or a fraction of its prompt rounded half up."""
    return budget if isinstance(budget, int) else math.floor(length * budget + 0.5)


def generate(model, ids, mask, new_tokens=NEW_TOKENS, **kwargs):
    return greedy(model, ids, mask, new_tokens, **kwargs)


def step_logits(out) -> torch.Tensor:
    """``[B, steps, vocab]`` logits of every generated token."""
    return torch.stack(out.logits, dim=1)


def assert_eviction_changed_logits(evicted: torch.Tensor, full: torch.Tensor) -> None:
    """Guard against vacuous comparisons: the budget must really have removed keys from attention."""
    assert (evicted - full).abs().max() > 1e-3, "the budget did not change any logit: nothing was evicted"


# ---- 3. the budget bounds what the store physically holds ------------------------------------------


@pytest.mark.parametrize("name, impl", CASES)
def test_budget_bounds_the_store(name, impl):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    batch, width = ids.shape
    kv_heads, head_dim = kv_geometry(model.config)
    layers = model.config.num_hidden_layers
    reference = generate(model, ids, mask)

    with el.apply(model, h2o(BUDGET)) as run:
        cache = run.new_cache()
        out = generate(model, ids, mask, past_key_values=cache)
        stats = run.stats()
        assert cache.stats() == stats

    slot_bytes = 2 * batch * kv_heads * (BUDGET + 1) * head_dim * 4  # keys + values, float32
    assert len(stats["layers"]) == layers
    for index, entry in enumerate(stats["layers"]):
        assert entry["retained_tokens"] <= BUDGET
        assert entry["seen_tokens"] == max(LENGTHS) + NEW_TOKENS - 1
        assert entry["kv_bytes"] == slot_bytes, f"layer {index}"
    assert stats["kv_bytes"] == layers * slot_bytes

    fed = torch.tensor(LENGTHS) + NEW_TOKENS - 1  # real tokens each row fed
    recent = BUDGET // 2  # RecentWindow(0.5) of the budget
    for index, layer in enumerate(cache.layers):
        store = layer.store
        # GQA stays un-expanded: H_kv heads, not H_q
        assert tuple(store.keys.shape) == (batch, kv_heads, BUDGET + 1, head_dim), f"layer {index}"
        assert tuple(store.values.shape) == (batch, kv_heads, BUDGET + 1, head_dim), f"layer {index}"
        assert store.keys.dtype == store.values.dtype == torch.float32
        assert torch.equal(store.retained(), torch.full((batch, kv_heads), BUDGET))
        assert torch.equal(store.seen, fed)
        for row in range(batch):
            for head in range(kv_heads):
                kept = store.pos[row, head]
                kept = sorted(kept[kept >= 0].tolist())
                assert len(set(kept)) == len(kept) == BUDGET
                assert 0 <= kept[0] and kept[-1] < int(fed[row])
                # the recent window is always among the kept tokens
                assert kept[-recent:] == list(range(int(fed[row]) - recent, int(fed[row])))
    assert cache.get_seq_length() == width + NEW_TOKENS - 1
    assert_eviction_changed_logits(step_logits(out), step_logits(reference))


# ---- 4. a padded batch is each row alone, under eviction -------------------------------------------


@pytest.mark.parametrize("budget", [BUDGET, 0.5], ids=["budget-6", "budget-0.5"])
@pytest.mark.parametrize("name, impl", CASES)
def test_padded_batch_matches_each_row_alone(name, impl, budget):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    solo_inputs = [unpad_row(ids, mask, row) for row in range(len(LENGTHS))]
    unmodified = [generate(model, x, torch.ones_like(x)) for x in solo_inputs]

    with el.apply(model, h2o(budget)) as run:
        with torch.no_grad():
            batch_prefill = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        cache = run.new_cache()
        batched = generate(model, ids, mask, past_key_values=cache)
        solo = []
        for x in solo_inputs:
            with torch.no_grad():
                prefill = model(input_ids=x, attention_mask=torch.ones_like(x)).logits
            solo.append((prefill, generate(model, x, torch.ones_like(x))))

    width = ids.shape[1]
    for row, (length, (prefill, alone)) in enumerate(zip(LENGTHS, solo, strict=True)):
        real = mask[row].bool()
        # the first step: every real token's logits, padding and all
        torch.testing.assert_close(batch_prefill[row][real], prefill[0], **TOL)
        assert batched.sequences[row, width:].tolist() == alone.sequences[0, length:].tolist(), f"row {row}"
        torch.testing.assert_close(step_logits(batched)[row], step_logits(alone)[0], **TOL)
        assert_eviction_changed_logits(step_logits(alone), step_logits(unmodified[row]))

    # each row kept exactly its own budget (padding took none of it); a sliding layer at most its window
    # less the query (transformers' own cache for the model gives each layer's window)
    expected = torch.tensor([row_budget(budget, length) for length in LENGTHS])
    windows = [getattr(layer, "sliding_window", None) for layer in transformers.DynamicCache(config=model.config).layers]
    for layer, window in zip(cache.layers, windows, strict=True):
        store = layer.store
        held = expected if window is None else expected.clamp(max=window - 1)
        assert torch.equal(store.retained(), held[:, None].expand_as(store.retained()))
        assert store.keys.shape[2] == int(held.max()) + 1


# ---- 5. generate() is a greedy loop over the cache; a cache carries over between generate() calls ----


def greedy_loop(model, cache, ids, mask, steps, with_positions=True):
    """Feed the prompt, then one argmax token per step; returns (tokens ``[B, steps]``, logits)."""
    tokens, logits = [], []
    kwargs = {"position_ids": positions(mask)} if with_positions else {}
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, **kwargs)
        for step in range(steps):
            last = out.logits[:, -1]
            logits.append(last)
            token = last.argmax(-1, keepdim=True)
            tokens.append(token)
            if step == steps - 1:
                break
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            kwargs = {"position_ids": positions(mask)[:, -1:]} if with_positions else {}
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, **kwargs)
            # the cache counts tokens seen, never tokens kept
            assert cache.get_seq_length() == mask.shape[1]
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


@pytest.mark.parametrize("name, impl", CASES)
def test_generate_equals_manual_greedy_loop(name, impl):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    alone = unpad_row(ids, mask, 0)
    with el.apply(model, h2o(BUDGET)) as run:
        generated = generate(model, ids, mask)
        cache = run.new_cache()
        tokens, logits = greedy_loop(model, cache, ids, mask, NEW_TOKENS)
        # one unpadded row, no position_ids: the model falls back on cache.get_seq_length(), which must
        # count tokens seen (GPT-2/OPT/... would read wrong learned positions from tokens kept)
        generated_alone = generate(model, alone, torch.ones_like(alone))
        tokens_alone, logits_alone = greedy_loop(
            model, run.new_cache(), alone, torch.ones_like(alone), NEW_TOKENS, with_positions=False
        )
    assert tokens.tolist() == generated.sequences[:, ids.shape[1] :].tolist()
    torch.testing.assert_close(logits, step_logits(generated), **TOL)
    assert max(layer.store.retained().max() for layer in cache.layers) <= BUDGET
    assert torch.equal(cache.layers[0].store.seen, torch.tensor(LENGTHS) + NEW_TOKENS - 1)
    assert tokens_alone.tolist() == generated_alone.sequences[:, alone.shape[1] :].tolist()
    torch.testing.assert_close(logits_alone, step_logits(generated_alone), **TOL)


@pytest.mark.parametrize("policy", ["h2o-6", "full"])
@pytest.mark.parametrize("name, impl", CASES)
def test_generation_continues_from_a_cache(name, impl, policy):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    width, half = ids.shape[1], NEW_TOKENS // 2
    unmodified = generate(model, ids, mask)
    with el.apply(model, h2o(BUDGET) if policy == "h2o-6" else el.Policy(budget=None)) as run:
        whole = generate(model, ids, mask)
        cache = run.new_cache()
        first = generate(model, ids, mask, new_tokens=half, past_key_values=cache)
        assert first.past_key_values is cache
        # the last generated token has not been fed yet
        assert cache.get_seq_length() == width + half - 1
        seen = [layer.store.seen.clone() for layer in cache.layers]
        assert all(torch.equal(s, torch.tensor(LENGTHS) + half - 1) for s in seen)

        grown = torch.cat([mask, torch.ones_like(first.sequences[:, width:])], dim=1)
        second = generate(model, first.sequences, grown, new_tokens=NEW_TOKENS - half, past_key_values=cache)
        assert second.past_key_values is cache
        # no token was fed twice: the cache advanced by exactly the new tokens
        assert cache.get_seq_length() == width + NEW_TOKENS - 1
        for before, layer in zip(seen, cache.layers, strict=True):
            assert torch.equal(layer.store.seen - before, torch.full_like(before, NEW_TOKENS - half))
        if policy == "h2o-6":
            assert max(int(layer.store.retained().max()) for layer in cache.layers) <= BUDGET

    assert torch.equal(second.sequences, whole.sequences)
    torch.testing.assert_close(step_logits(second), step_logits(whole)[:, half:], **TOL)
    if policy == "full":  # nothing evicted: the unmodified model is the reference
        assert torch.equal(second.sequences, unmodified.sequences)
        torch.testing.assert_close(step_logits(second), step_logits(unmodified)[:, half:], **TOL)
    else:
        assert_eviction_changed_logits(step_logits(whole), step_logits(unmodified))


# ---- 6. foreign caches are refused; use_cache=False is plain attention -----------------------------


@pytest.mark.parametrize("name, impl", [("llama", "sdpa"), ("gpt2", "eager")], ids=["llama-sdpa", "gpt2-eager"])
def test_nonempty_dynamic_cache_is_refused(name, impl):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad():
        filled = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    assert isinstance(filled, DynamicCache) and filled.get_seq_length() == ids.shape[1]
    token = torch.full((2, 1), 5)
    grown = torch.cat([mask, torch.ones_like(token)], dim=1)
    with el.apply(model, h2o(BUDGET)):
        with pytest.raises(TypeError, match="DynamicCache"), torch.no_grad():
            model(input_ids=token, attention_mask=grown, past_key_values=filled)
        with pytest.raises(TypeError, match="DynamicCache"):
            generate(model, torch.cat([ids, token], 1), grown, past_key_values=filled)
    assert filled.get_seq_length() == ids.shape[1]  # untouched


@pytest.mark.parametrize("name, impl", CASES)
def test_generate_without_cache_matches_unmodified_model(name, impl):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    reference = generate(model, ids, mask, new_tokens=4, use_cache=False)
    with el.apply(model, h2o(4)) as run:
        out = generate(model, ids, mask, new_tokens=4, use_cache=False)
        assert run.stats()["kv_bytes"] == 0  # nothing was cached
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(step_logits(out), step_logits(reference), **TOL)
