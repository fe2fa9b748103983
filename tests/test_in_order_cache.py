"""A full cache of unpadded rows keeps its slots in position order and decodes without a mask or a slot
search (``SlotStore.filled``); any step that could leave a gap (a padded row, a chunk after the cache grew)
sends it back to the general decode step. The reference is the unmodified model fed the same tokens."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

import evictlayers as el
from evictlayers.compose import store as store_module
from evictlayers.kernels.decode import slots_cpu
from kernel_inputs import flash_mask_spy
from tiny_models import build, left_padded, single_thread  # noqa: F401

TOL = dict(rtol=1e-4, atol=1e-4)


def feed(model, chunks, cache, mask_of):
    """Run ``chunks`` (``[B, q]`` ids each) through ``model`` one after another; returns the last logits of each."""
    logits, seen = [], 0
    for ids in chunks:
        seen += ids.shape[1]
        out = model(input_ids=ids, attention_mask=mask_of(seen), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits)


def random_ids(batch, length, seed):
    return torch.randint(3, 60, (batch, length), generator=torch.Generator().manual_seed(seed))


def unpadded(batch):
    """The attention mask of ``batch`` unpadded rows, as a function of the tokens seen."""
    return lambda seen: torch.ones(batch, seen, dtype=torch.long)


def full_cache_against_unmodified(model, chunks, mask_of, compile=False):
    """``(logits under a full evictlayers cache, the unmodified model's logits, that cache)``."""
    with torch.no_grad():
        want = feed(model, chunks, DynamicCache(config=model.config), mask_of)
        with el.apply(model, el.Policy(budget=None), compile=compile) as run:
            cache = run.new_cache()
            got = feed(model, chunks, cache, mask_of)
    return got, want, cache


def fused_op_masks(monkeypatch) -> list:
    """The ``attn_mask`` of every decode-kernel call of the fused op, in call order: the backend takes the op,
    as where the C++ slot ops cannot be built (they serve otherwise, and build no mask either way), so its
    mask says whether a step promised every slot visible (the in-order path) or masked them."""
    monkeypatch.setattr(slots_cpu, "serves", lambda *tensors: False)
    return flash_mask_spy(monkeypatch)


@pytest.fixture
def flash_masks(monkeypatch):
    return fused_op_masks(monkeypatch)


@pytest.fixture
def general_steps(monkeypatch):
    """How many times the general decode step ran (eager; the compiled one is counted by dynamo)."""
    count = [0]
    real = store_module.decode_step

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(store_module, "decode_step", counted)
    return count


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
def test_unpadded_full_cache_decodes_in_order_as_the_unmodified_model(compile, general_steps, monkeypatch):
    # compiled, the spy's list would be guarded on by the graph: the slot ops serve, unspied
    flash_masks = None if compile else fused_op_masks(monkeypatch)
    model = build("llama", "sdpa")
    prompt = random_ids(2, 9, seed=0)
    steps = [random_ids(2, 1, seed=1 + i) for i in range(70)]  # past the first growth of the 9 slots
    torch._dynamo.reset()
    counters.clear()
    got, want, cache = full_cache_against_unmodified(model, [prompt, *steps], unpadded(2), compile=compile)
    torch.testing.assert_close(got, want, **TOL)
    layers = model.config.num_hidden_layers
    if not compile:
        assert len(flash_masks) == layers * len(steps) and all(mask is None for mask in flash_masks)
    # compiled, the steps run in the whole forward's graph (tests/test_compiled_forward.py): one with the
    # step count constant, one generic over it, one generic over the buffers' size after their second growth
    assert general_steps[0] == 0 and counters["stats"]["unique_graphs"] == (3 if compile else 0)
    for layer in cache.layers:
        store = layer.store
        assert store.filled == store.seq_len == 9 + len(steps) < store.capacity
        assert torch.equal(store.pos[0, 0, : store.filled], torch.arange(store.filled))
        assert (store.pos[:, :, store.filled :] == -1).all()


def test_a_padded_batch_takes_the_general_step(flash_masks, general_steps):
    model = build("llama", "sdpa")
    ids, mask = left_padded([9, 6])
    steps = [random_ids(2, 1, seed=10 + i) for i in range(5)]
    mask_of = lambda seen: torch.cat([mask, torch.ones(2, seen - mask.shape[1], dtype=torch.long)], 1)  # noqa: E731
    got, want, cache = full_cache_against_unmodified(model, [ids, *steps], mask_of)
    torch.testing.assert_close(got, want, **TOL)
    layers = model.config.num_hidden_layers
    assert general_steps[0] == layers * len(steps) and all(mask is not None for mask in flash_masks)
    assert all(layer.store.filled is None for layer in cache.layers)


def test_a_chunk_after_the_cache_grew_leaves_the_in_order_path(flash_masks, general_steps):
    """Prefill, decode (the cache grows: empty slots at its end), then a 4-token chunk, appended after those
    empty slots: the slots are no longer in order without gaps, so later steps mask as always."""
    model = build("llama", "sdpa")
    chunks = [random_ids(2, 6, seed=20), *[random_ids(2, 1, seed=21 + i) for i in range(3)], random_ids(2, 4, seed=30),
              *[random_ids(2, 1, seed=31 + i) for i in range(3)]]
    got, want, cache = full_cache_against_unmodified(model, chunks, unpadded(2))
    torch.testing.assert_close(got, want, **TOL)
    layers = model.config.num_hidden_layers
    assert general_steps[0] == layers * 3  # the three steps after the chunk
    assert [mask is None for mask in flash_masks] == [True] * (3 * layers) + [False] * (3 * layers)
    assert all(layer.store.filled is None for layer in cache.layers)


def test_a_chunk_before_any_growth_stays_in_order(general_steps):
    """Two prefill chunks on an empty cache leave no gap (the second is appended right after the first)."""
    model = build("llama", "sdpa")
    chunks = [random_ids(1, 5, seed=40), random_ids(1, 7, seed=41), *[random_ids(1, 1, seed=42 + i) for i in range(4)]]
    got, want, cache = full_cache_against_unmodified(model, chunks, unpadded(1))
    torch.testing.assert_close(got, want, **TOL)
    assert general_steps[0] == 0 and all(layer.store.filled == 16 for layer in cache.layers)


def test_a_scoring_store_never_takes_the_in_order_path(general_steps):
    """A full policy that scores (H2O's accumulator with no budget) observes every step: the general step."""
    model = build("llama", "sdpa")
    scoring = el.Policy(el.HeavyHitterSelector(el.Cumulative()), budget=None)
    chunks = [random_ids(1, 6, seed=50), random_ids(1, 1, seed=51)]
    with torch.no_grad(), el.apply(model, scoring) as run:
        cache = run.new_cache()
        feed(model, chunks, cache, unpadded(1))
    assert general_steps[0] == model.config.num_hidden_layers
    assert all(layer.store.filled is None for layer in cache.layers)


def test_sliding_layers_take_the_general_step_and_full_layers_stay_in_order(general_steps):
    """Gemma 2 (soft-capped logits, sliding and full layers alternating): a sliding layer's tokens slide out,
    so only its full layers keep ``filled``; past the window, the logits are still the unmodified model's."""
    model = build("gemma2", "eager")
    window = model.config.sliding_window
    chunks = [random_ids(1, window - 2, seed=60), *[random_ids(1, 1, seed=61 + i) for i in range(6)]]
    got, want, cache = full_cache_against_unmodified(model, chunks, unpadded(1))
    torch.testing.assert_close(got, want, **TOL)
    kinds = model.config.layer_types
    assert general_steps[0] == kinds.count("sliding_attention") * 6
    for kind, layer in zip(kinds, cache.layers, strict=True):
        assert layer.store.filled == (None if kind == "sliding_attention" else window + 4)
