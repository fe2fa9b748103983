"""Rolling positions (H2O Sec. 5.3 Q1): keys held un-rotated and re-rotated to their rank in
the cache. Checked against the unmodified model with nothing evicted (every RoPE family, rope scaling,
partial rotary, left padding, compiled), against a plain-loop reference of StreamingLLM's position
assignment with eviction, and on a tiny trained model streamed 10x past its context window."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import evictlayers as el
from evictlayers.compose.positions import RotaryTable, rotate, slot_ranks
from tiny_models import FAMILIES, _llama_like, build, left_padded, single_thread  # noqa: F401

TOL = dict(rtol=1e-5, atol=1e-5)
ROPE_FAMILIES = [name for name in FAMILIES if name not in ("gpt2", "opt")]
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    # YaRN scales cos/sin by an attention factor (1.14 here): the table must not apply it twice
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def _generate_logits(model, ids, mask, policy=None, compile=False, steps=10):
    settings = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        if policy is None:
            out = model.generate(**settings)
        else:
            with el.apply(model, policy, compile=compile):
                out = model.generate(**settings)
    return out.sequences, torch.stack(out.logits, dim=1)


def _assert_same_as_unmodified(model, compile=False):
    ids, mask = left_padded([9, 14, 5])
    reference_tokens, reference = _generate_logits(model, ids, mask)
    tokens, logits = _generate_logits(model, ids, mask, el.Policy(budget=None, positions="rolling"), compile)
    assert torch.equal(tokens, reference_tokens)
    real = mask.bool().any(1)
    torch.testing.assert_close(logits[real], reference[real], **TOL)


@pytest.mark.parametrize("name", ROPE_FAMILIES)
def test_rolling_with_nothing_evicted_equals_the_unmodified_model(name):
    _assert_same_as_unmodified(build(name))


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rolling_follows_the_models_rope_scaling(scaling):
    config = _llama_like(transformers.LlamaConfig, rope_parameters=ROPE_SCALINGS[scaling])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    _assert_same_as_unmodified(transformers.LlamaForCausalLM(config).eval())


def test_rolling_compiled_equals_the_unmodified_model():
    _assert_same_as_unmodified(build("llama"), compile=True)


def test_rolling_under_eviction_compiled_equals_eager():
    """Eviction by shared selectors over a quantised storage: the compiled step rotates as the eager one."""
    recipe = el.compose.recipes.policy_to_dict(el.load_recipe("tova_keydiff"))
    recipe.update(budget=16, positions="rolling", storage={"_component_": "QuantizedKV", "group": 8, "residual": 4})
    policy = el.compose.recipes.policy_from_dict(recipe)
    model = build("llama")
    ids, mask = left_padded([40, 46])
    eager_tokens, eager = _generate_logits(model, ids, mask, policy, steps=12)
    compiled_tokens, compiled = _generate_logits(model, ids, mask, policy, compile=True, steps=12)
    assert torch.equal(compiled_tokens, eager_tokens)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_rolling_without_a_cache_equals_the_unmodified_model():
    model = build("phi3")  # partial rotary
    ids, mask = left_padded([9, 14])
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with el.apply(model, el.Policy(budget=None, positions="rolling")):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], reference[real], **TOL)


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_learned_absolute_positions_refuse_rolling(name):
    model = build(name)
    with pytest.raises(el.UnsupportedModelError, match="learned absolute position embeddings"):
        el.apply(model, el.Policy(budget=8, positions="rolling"))
    assert not hasattr(model, "_evictlayers_run")  # refused before anything was patched


def test_bad_positions_and_rolling_with_a_stream_sketch_are_refused():
    with pytest.raises(ValueError, match=r"positions='relative'.*\('absolute', 'rolling'\)"):
        el.Policy(budget=8, positions="relative")
    with pytest.raises(ValueError, match="position-less clusters"):
        el.Policy(el.RecentWindow(), el.ClusterSketch(radius=1.0), budget=8, positions="rolling")
    store = el.SlotStore(el.Policy(budget=8, positions="rolling"))  # no rotary table given
    q, k, v = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="needs\\s+the model's rotary table"):
        store.step(q, k, v, scaling=1.0)


def test_positions_round_trip_through_recipe_yaml():
    policy = el.Policy(el.SinkTokens(4), el.RecentWindow(), budget=32, positions="rolling")
    loaded = el.compose.recipes.policy_from_dict(el.compose.recipes.policy_to_dict(policy))
    assert loaded == policy and loaded.positions == "rolling"
    assert el.Policy(el.SinkTokens(4), el.RecentWindow(), budget=32) != policy


@pytest.mark.parametrize("width", [64, 48, 16], ids=lambda w: f"rotary{w}of64")
def test_rotate_is_transformers_rotate_half_form(width):
    """``rotate`` (written out per half) against transformers' own ``x * cos + rotate_half(x) * sin`` on
    the first ``width`` dims, the rest passed through (partial rotary), with a per-dim table."""
    from transformers.models.llama.modeling_llama import rotate_half

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 7, 64, generator=generator)
    cos, sin = (torch.randn(7, width, generator=generator) for _ in range(2))
    head, tail = x[..., :width], x[..., width:]
    expected = torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)
    assert torch.equal(rotate(x, cos, sin), expected)


def test_slot_ranks_match_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    pos = torch.randperm(40, generator=generator)[:24].view(2, 2, 6).clone()
    pos[0, 1, [1, 4]] = -1
    pos[1, 0, 0] = -1
    ranks = slot_ranks(pos)
    for b in range(2):
        for h in range(2):
            held = sorted(p for p in pos[b, h].tolist() if p >= 0)
            for s, p in enumerate(pos[b, h].tolist()):
                if p >= 0:
                    assert ranks[b, h, s] == held.index(p)


# ---- a model-free reference: StreamingLLM's position assignment, one head at a time ---------------------

THETA, ROTARY_DIMS, FACTOR = 10000.0, 6, 1.5  # partial rotary (6 of 8 dims) and an attention factor


def _rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE of ``x`` ``[D]`` at ``position`` from the formula, pairs (i, i + R/2), times ``FACTOR``."""
    out, half = x.clone(), ROTARY_DIMS // 2
    for i in range(half):
        angle = position * THETA ** (-2 * i / ROTARY_DIMS)
        c, s = math.cos(angle) * FACTOR, math.sin(angle) * FACTOR
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def _formula_table() -> RotaryTable:
    def compute(rows, device, dtype):
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * THETA ** (
            -torch.arange(0, ROTARY_DIMS, 2, dtype=torch.float64) / ROTARY_DIMS
        )
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * FACTOR).to(dtype), (angles.sin() * FACTOR).to(dtype)

    return RotaryTable(compute)


def _reference_step(held, query, key, value, scaling):
    """Attention of one query head over ``held`` ``[(pos, k, v)]`` plus the new token, every key rotated
    to its rank among them and the query to the new token's rank. Keys arrive as the model gives them
    under rolling: un-rotated, their rotary dims scaled by the attention factor (the model's rotary at
    position 0), which the reference divides out before applying the formula."""

    def unscaled(x):
        return torch.cat([x[:ROTARY_DIMS] / FACTOR, x[ROTARY_DIMS:]])

    tokens = sorted(held, key=lambda t: t[0]) + [(None, key, value)]
    rank_q = len(tokens) - 1
    q = _rope(unscaled(query), rank_q)
    scores = torch.stack([q @ _rope(unscaled(k), rank) for rank, (_, k, _) in enumerate(tokens)]) * scaling
    weights = scores.softmax(0)
    return sum(w * v for w, (_, _, v) in zip(weights, tokens))


@pytest.mark.parametrize("drop", [1, 3])
def test_rolling_decode_matches_streaming_llm_position_assignment(drop):
    """Eviction (sinks, heavy hitters, a recent window) leaves gaps in the original positions; the store's
    output must equal attention with every held key at its rank, the query right after them."""
    generator = torch.Generator().manual_seed(3)
    batch, kv_heads, group, dim, prompt, steps = 2, 2, 2, 8, 12, 14
    q = torch.randn(batch, kv_heads * group, prompt + steps, dim, generator=generator)
    k = torch.randn(batch, kv_heads, prompt + steps, dim, generator=generator)
    v = torch.randn(batch, kv_heads, prompt + steps, dim, generator=generator)
    policy = el.Policy(
        el.SinkTokens(2), el.RecentWindow(2), el.HeavyHitterSelector(el.Cumulative()), budget=7, drop=drop,
        positions="rolling",
    )
    store = el.SlotStore(policy, rotary=_formula_table())
    store.step(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], scaling=0.4)
    gaps = 0
    for t in range(prompt, prompt + steps):
        pos, keys, values = store.pos.clone(), store.keys.clone(), store.values.clone()
        out = store.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], scaling=0.4)
        for b in range(batch):
            for h in range(kv_heads):
                held = [(int(p), keys[b, h, s], values[b, h, s]) for s, p in enumerate(pos[b, h]) if p >= 0]
                gaps += max(p for p, _, _ in held) + 1 - len(held)
                for g in range(group):
                    head = h * group + g
                    expected = _reference_step(held, q[b, head, t], k[b, h, t], v[b, h, t], 0.4)
                    torch.testing.assert_close(out[b, head, 0], expected, rtol=1e-4, atol=1e-5)
    assert gaps > 0  # eviction happened: ranks differ from original positions


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("drop", [1, 3, 12], ids=lambda d: f"drop{d}")
def test_rolling_ranks_kept_by_the_decode_step_equal_a_fresh_ranking(drop, compiled):
    """The decode step keeps each slot's rank up to date instead of sorting (a new token takes the count
    of the others, an eviction lowers newer slots by one; drops above 8 re-rank by one sort): after every
    step, with padding steps in one row and a beam-search reorder midway, the held slots' ranks equal
    ``slot_ranks`` of the positions."""
    generator = torch.Generator().manual_seed(11)
    batch, kv_heads, dim, prompt, steps = 2, 2, 8, 30, 40
    q = torch.randn(batch, 2 * kv_heads, prompt + steps, dim, generator=generator)
    k = torch.randn(batch, kv_heads, prompt + steps, dim, generator=generator)
    v = torch.randn(batch, kv_heads, prompt + steps, dim, generator=generator)
    policy = el.Policy(el.SinkTokens(2), el.HeavyHitterSelector(el.Cumulative()), budget=20, drop=drop,
                       positions="rolling")
    layer = el.hf.cache.EvictionLayer(policy, compile=compiled, rotary=_formula_table())
    store = layer.store
    store.step(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], scaling=0.4)
    evicted = 0
    for t in range(prompt, prompt + steps):
        real = torch.tensor([[True], [t % 5 != 0]])  # row 1 pads every fifth step
        held_before = int((store.pos >= 0).sum())
        store.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], real, scaling=0.4)
        evicted += held_before + int(real.sum()) * kv_heads - int((store.pos >= 0).sum())
        if t == prompt + steps // 2:
            layer.reorder_cache(torch.tensor([1, 0]))
        held = store.pos >= 0
        assert torch.equal(store.ranks[held], slot_ranks(store.pos)[held]), t
    assert evicted > 0
    assert store.state_bytes() == store.pos.nbytes * 2 + sum(x.nbytes for x in store.state.values())


# ---- past the context window: a tiny trained model --------------------------------------------------

CONTEXT, LAG, VOCAB = 96, 8, 32


def _lagged_tokens(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Token t repeats token t - LAG (90%) or is random: a model must attend LAG tokens back."""
    tokens = torch.randint(3, VOCAB, (batch, length), generator=generator)
    fresh = torch.rand(batch, length, generator=generator) < 0.1
    for t in range(LAG, length):
        tokens[:, t] = torch.where(fresh[:, t], tokens[:, t], tokens[:, t - LAG])
    return tokens


def _trained_model() -> transformers.LlamaForCausalLM:
    """A one-layer Llama trained 400 steps on windows of its context (96 tokens): ~5 s on one thread."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        tokens = _lagged_tokens(32, CONTEXT, generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _window_perplexities(log_probs: torch.Tensor) -> list[float]:
    return [math.exp(-log_probs[s : s + CONTEXT].mean()) for s in range(0, len(log_probs) - CONTEXT + 1, CONTEXT)]


def test_rolling_streams_ten_windows_past_the_context_with_flat_memory():
    """1,000 tokens through a model trained on 96: the unmodified model degrades past its window, a
    StreamingLLM cache of 48 tokens with rolling positions keeps the perplexity of its first window and
    a fixed number of KV bytes."""
    model = _trained_model()
    tokens = _lagged_tokens(1, 1001, torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    unmodified = _window_perplexities(torch.log_softmax(logits, -1)[0].gather(-1, tokens[0, 1:, None])[:, 0])
    assert min(unmodified[2:]) > 3 * unmodified[0], unmodified  # past its window the model is lost

    budget = 48
    policy = el.Policy(el.SinkTokens(4), el.RecentWindow(), budget=budget, positions="rolling")
    log_probs, kv_bytes = [], set()
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        for t in range(1000):
            mask = torch.ones(1, t + 1, dtype=torch.long)
            out = model(input_ids=tokens[:, t : t + 1], attention_mask=mask, past_key_values=cache)
            log_probs.append(torch.log_softmax(out.logits[0, -1], -1)[tokens[0, t + 1]])
            store = cache.layers[0].store
            assert int(slot_ranks(store.pos).masked_fill(store.pos < 0, 0).max()) < budget < CONTEXT
            if t >= budget:
                kv_bytes.add(run.stats()["kv_bytes"])
    rolling = _window_perplexities(torch.stack(log_probs))
    # one KV head of 16 dims, keys and values, float32, budget + 1 slots, whatever the length
    assert kv_bytes == {2 * (budget + 1) * 16 * 4}
    # until the budget fills nothing is evicted and every rank is the original position
    reference = torch.log_softmax(logits, -1)[0].gather(-1, tokens[0, 1:, None])[:budget, 0]
    torch.testing.assert_close(torch.stack(log_probs[:budget]), reference, **TOL)
    later = math.exp(sum(math.log(p) for p in rolling[1:]) / len(rolling[1:]))
    assert later < 1.5 * rolling[0], rolling
