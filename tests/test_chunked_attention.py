"""Chunked attention (Llama 4): a layer whose query sees only its own chunk of ``attention_chunk_size`` positions.

The reference is the unmodified Llama 4 text model (transformers' chunked mask, left padding excluded from the
count): with nothing evicted, evictlayers must give its logits and tokens, eagerly and compiled, whether the
prompt comes in one forward or in chunks that cut across the model's. Whatever the policy, a chunked layer holds
only tokens of each row's current chunk, at most ``chunk - 1``, and a bounded policy its budget.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import evictlayers as el
from evictlayers.compose.store import SlotStore
from evictlayers.hf.support import model_support
from tiny_models import greedy, left_padded, single_thread  # noqa: F401

CHUNK = 8
LENGTHS = [30, 21]  # the rows' chunks start at different columns
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def llama4() -> transformers.PreTrainedModel:
    """Three chunked RoPE layers and a NoPE full-attention layer, a mixture-of-experts MLP every other layer."""
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_chunk_size=CHUNK,
        max_position_embeddings=256, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.15, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).eval()


def h2o(budget: int) -> el.Policy:
    return el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=budget, min_budget=1)


def assert_holds_its_current_chunk_only(cache, most: int) -> None:
    """Each chunked layer holds tokens of the chunk of each row's last token only (an earlier chunk's leave at
    the start of the next step), at most ``most`` per head."""
    for layer in cache.layers:
        store = layer.store
        if store.chunk is None:
            continue
        current = (store.seen - 1) // store.chunk
        for row, pos in enumerate(store.pos):  # [H, N], -1: a free slot
            held = pos[pos >= 0]
            assert (held // store.chunk == current[row]).all(), (store.layer_idx, row, held)
            assert ((pos >= 0).sum(-1) <= most).all()


def test_the_chunked_layers_are_found_with_their_chunk(llama4):
    support = model_support(llama4)
    assert [layer.chunk for layer in support.attention] == [CHUNK, CHUNK, CHUNK, None]
    assert [layer.window for layer in support.attention] == [None] * 4


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_full_cache_decodes_as_the_unmodified_model(llama4, compile):
    ids, mask = left_padded(LENGTHS)
    want = greedy(llama4, ids, mask, NEW_TOKENS)
    torch._dynamo.reset()
    with torch.no_grad(), el.apply(llama4, el.Policy(), compile=compile) as run:
        got = greedy(llama4, ids, mask, NEW_TOKENS)
        stats = run.stats()
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences, want.sequences)
    kinds = [(layer["kind"], layer["retained_tokens"]) for layer in stats["layers"]]
    assert [kind for kind, _ in kinds] == ["chunked"] * 3 + ["attention"]
    assert all(retained <= CHUNK - 1 for _, retained in kinds[:3])
    if compile:
        assert stats["compiled_decode"]["graph_steps"] == NEW_TOKENS - 1


@pytest.mark.parametrize("chunk", [5, 13])
def test_a_prompt_fed_in_chunks_across_the_models_chunks_gives_its_logits(llama4, chunk):
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad():
        want = llama4(ids, attention_mask=mask).logits[:, -1]
    with el.apply(llama4, el.Policy()) as run:
        out = run.prefill(ids, mask, chunk=chunk)
        assert_holds_its_current_chunk_only(out.past_key_values, CHUNK - 1)
    torch.testing.assert_close(out.logits[:, -1], want, rtol=1e-4, atol=1e-4)


def test_a_bounded_policy_keeps_its_budget_within_the_current_chunk(llama4):
    ids, mask = left_padded(LENGTHS)
    logits = {}
    for compile in (False, True):
        torch._dynamo.reset()
        with torch.no_grad(), el.apply(llama4, h2o(5), compile=compile) as run:
            cache = run.new_cache()
            out = llama4(ids, attention_mask=mask, past_key_values=cache)
            steps = []
            for _ in range(12):
                assert_holds_its_current_chunk_only(cache, 5)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = llama4(out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache)
                steps.append(out.logits[:, -1])
            logits[compile] = torch.stack(steps)
        ids, mask = left_padded(LENGTHS)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


def test_a_chunk_must_be_a_token_count():
    with pytest.raises(ValueError, match="chunk=1"):
        SlotStore(el.Policy(), chunk=1)
    with pytest.raises(ValueError, match="not both"):
        SlotStore(el.Policy(), chunk=8, window=8)
