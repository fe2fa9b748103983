"""KV sharing (Gemma 3n, Gemma 4's small models): a reusing layer attends with its own queries over exactly
what its source layer attended over in the same forward, before the source evicts.

References: the unmodified model (nothing evicted) and, under eviction, plain softmax attention written
here over the tokens the source held before the step plus the step's own."""

from __future__ import annotations

import math

import pytest
import torch

import evictlayers as el
from evictlayers.hf import attention as hf_attention
from evictlayers.hf.support import model_support

from architecture_sweep import conformance, tiny_model
from tiny_models import greedy, left_padded

LENGTHS = [20, 13]
NEW_TOKENS = 8
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# Gemma 4 with its last two layers reusing the last earlier layer of their type (as Gemma 4's E2B/E4B do), its
# global layers with wider heads than the sliding ones
GLOBAL_HEADS = {1: {"head_dim": 32}, 3: {"head_dim": 32}}
GEMMA4_SHARED = dict(layer_types=ALTERNATING, per_layer_config=GLOBAL_HEADS, num_kv_shared_layers=2)
MODELS = {"gemma3n_text": {}, "gemma4_text": GEMMA4_SHARED}


@pytest.fixture(scope="module", params=list(MODELS))
def shared_model(request):
    return request.param, tiny_model(request.param, **MODELS[request.param])


def test_the_sharing_layers_and_their_sources_are_found(shared_model):
    _, model = shared_model
    support = model_support(model)
    assert [(layer.index, layer.source) for layer in support.reusing] == [(2, 0), (3, 1)]
    assert [layer.index for layer in support.attention] == [0, 1]


@pytest.mark.parametrize("model_type", list(MODELS))
def test_nothing_evicted_gives_the_unmodified_models_logits_and_a_budget_holds(model_type):
    # conformance: prefill and greedy decoding of a left-padded batch against the unmodified model, then every
    # layer with a cache of its own within an H2O budget and every reusing layer holding nothing
    assert conformance(model_type, el, **MODELS[model_type]).status == "works"


def _reference_attention(query, keys, values, pos, query_pos, scaling, window):
    """Plain softmax attention over the held slots a query may see; ``[B, H_q, Q, D_v]``, 0 for padding queries."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
    pos = pos.repeat_interleave(group, 1)
    logits = torch.einsum("bhqd,bhnd->bhqn", query.float(), keys) * scaling
    visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= query_pos[:, None, :, None])
    if window is not None:
        visible &= query_pos[:, None, :, None] - pos[:, :, None, :] < window
    probs = torch.softmax(logits.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    out = torch.einsum("bhqn,bhnd->bhqd", probs, values)
    return out * (query_pos >= 0)[:, None, :, None]


def test_under_eviction_a_reusing_layer_reads_what_its_source_held_and_the_new_tokens(shared_model, monkeypatch):
    _, model = shared_model
    ids, mask = left_padded(LENGTHS)
    calls = []
    real_attend = hf_attention.attend_shared

    def checked(attended, query, **options):
        out = real_attend(attended, query, **options)
        keys, values, pos, query_pos = attended
        calls.append((pos, query_pos))
        rows = query_pos[:, query_pos.shape[1] - query.shape[2] :]  # Gemma 4: the kept logits' tokens only
        want = _reference_attention(query, keys, values, pos, rows, options["scaling"], options["sliding_window"])
        torch.testing.assert_close(out.float(), want, rtol=1e-4, atol=1e-4)
        return out

    monkeypatch.setattr(hf_attention, "attend_shared", checked)
    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=6)
    with el.apply(model, policy) as run:
        cache = run.new_cache()
        seen = mask.sum(1)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, logits_to_keep=1)
        prefill_calls = list(calls)
        for step in range(NEW_TOKENS):
            sources = {index: cache.layers[index].store for index in (0, 1)}
            assert all(store.attended is None for store in sources.values()), "the last reader lets the step go"
            before = {index: store.pos.clone() for index, store in sources.items()}
            calls.clear()
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            token = torch.full((2, 1), 5 + step)
            model(input_ids=token, attention_mask=mask, past_key_values=cache)
            for (pos, query_pos), source in zip(calls, (0, 1), strict=True):
                assert torch.equal(query_pos[:, 0], seen)
                for b in range(2):
                    for h in range(pos.shape[1]):
                        was = set(before[source][b, h][before[source][b, h] >= 0].tolist())
                        assert set(pos[b, h][pos[b, h] >= 0].tolist()) == was | {int(seen[b])}
            seen = seen + 1
        stats = run.stats()
    # the prefill: each reusing layer read every real token of its row, as its source attended over
    for pos, _ in prefill_calls:
        for b, length in enumerate(LENGTHS):
            assert set(pos[b, 0][pos[b, 0] >= 0].tolist()) == set(range(length))
    assert [layer["kind"] for layer in stats["layers"][2:]] == ["shared", "shared"]
    assert all(layer["retained_tokens"] == 0 and layer["kv_bytes"] == 0 for layer in stats["layers"][2:])
    assert all(layer["retained_tokens"] <= 6 for layer in stats["layers"][:2])


def test_a_policy_a_reusing_layer_cannot_follow_is_refused(shared_model):
    model_type, model = shared_model
    with pytest.raises(el.UnsupportedModelError, match=r"layers 2 <- 0, 3 <- 1.*positions='rolling'"):
        el.apply(model, el.Policy(budget=None, positions="rolling"))
    with pytest.raises(ValueError, match="ClusterSketch merges"):
        el.apply(model, el.load_recipe("clustergen"))
    assert getattr(model, "_evictlayers_run", None) is None


def test_a_model_whose_every_layer_reuses_another_models_keys_is_refused():
    # an assistant model: every layer reads keys and values a target model computed
    model = tiny_model("gemma4_text", **{**GEMMA4_SHARED, "num_kv_shared_layers": 4})
    with pytest.raises(el.UnsupportedModelError, match="no earlier layer of this model keeps"):
        el.apply(model, el.Policy(budget=None))


def test_compile_decodes_a_kv_sharing_model_layer_by_layer_and_says_why(shared_model):
    _, model = shared_model
    ids, mask = left_padded(LENGTHS)
    policy = el.load_recipe("h2o").replace(budget=8)
    with el.apply(model, policy):
        eager = greedy(model, ids, mask, NEW_TOKENS)
    with pytest.warns(UserWarning, match="KV sharing"):
        with el.apply(model, policy, compile=True) as run:
            compiled = greedy(model, ids, mask, NEW_TOKENS)
            path = run.stats()["compiled_decode"]
    assert path["graph_steps"] == 0 and path["eager_steps"] == NEW_TOKENS - 1
    assert "KV sharing" in path["eager_reason"]
    assert torch.equal(compiled.sequences, eager.sequences)
    for got, want in zip(compiled.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
