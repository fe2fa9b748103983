"""A prompt fed in chunks holds what one forward of it holds: a float budget is a fraction of the whole prompt.

transformers' ``generate(..., prefill_chunk_size=N)`` and ``run.prefill(ids, mask, chunk=N)`` run the prompt
N tokens at a time, the cache evicting between chunks; the cache is told the prompt's real tokens per row
before the first chunk, so every layer resolves the budget one forward of the prompt would (rounding,
``min_budget`` floor, per-row lengths with left padding) and after the prompt holds exactly as many tokens
per head. A plain forward fed in chunks without the prompt's length is refused under a float budget.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import evictlayers as el
from evictlayers.hf.compiled_forward import CompiledDecodeForward
from tiny_models import PAD, build, left_padded, positions, single_thread  # noqa: F401

LENGTHS = [20, 13]  # a left-padded batch: the short row's first 7 columns are padding
WIDTH = max(LENGTHS)
CHUNKS = [1, 3, 7, 19, WIDTH]  # 3 and 7 do not divide 20; 19 leaves a one-token last chunk
BUDGETS = {
    "int": dict(budget=6),
    "float": dict(budget=0.25, min_budget=1),  # 5 and 3 tokens per head (20 and 13 real tokens)
    "float-floor": dict(budget=0.05, min_budget=4),  # 1 token each, lifted to the floor of 4
}


def policy(budget: str, drop=1) -> el.Policy:
    return el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), drop=drop, **BUDGETS[budget])


@pytest.fixture(autouse=True)
def quiet_floor():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Policy\(budget=0.05")
        yield


def held(cache) -> list[torch.Tensor]:
    """Tokens held per (row, KV head) of every layer."""
    return [layer.store.retained() for layer in cache.layers]


def budgets(cache) -> list[torch.Tensor]:
    return [layer.store.budget for layer in cache.layers]


def one_forward(model, pol, ids, mask):
    """The cache one forward of the whole prompt leaves."""
    with torch.no_grad(), el.apply(model, pol) as run:
        cache = run.new_cache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    return cache


# ---- a prompt in chunks holds what one forward holds ----------------------------------------------


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_of_a_declared_prompt_hold_what_one_forward_holds(chunk, budget):
    """Fed chunk by chunk into a cache told the prompt's length: at every chunk boundary each layer holds at
    most its budget per head in ``budget + 1`` slots (so at most ``budget + chunk`` tokens while a chunk is
    attended); after the prompt every (row, head) holds exactly what one forward holds, under the same
    budget. ``drop=2``: a one-token chunk must not be a decode step that drops two at once."""
    model = build("mistral")  # GQA and a sliding window of 12, under the 20-token prompt
    pol = policy(budget, drop=2)
    ids, mask = left_padded(LENGTHS)
    reference = one_forward(model, pol, ids, mask)
    with torch.no_grad(), el.apply(model, pol) as run:
        cache = run.new_cache(prompt_len=mask.sum(1))
        for start in range(0, WIDTH, chunk):
            stop = min(start + chunk, WIDTH)
            model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache)
            for layer, budget_ in zip(cache.layers, budgets(reference), strict=True):
                store = layer.store
                assert torch.equal(store.budget, budget_)  # resolved at the first chunk, from the whole prompt
                assert bool((store.retained() <= store.budget[:, None]).all())
                assert store.capacity <= int(store.budget.max()) + 1
            assert cache.in_prompt == (stop < WIDTH)
        helped = run.prefill(ids, mask, chunk=chunk).past_key_values
    for after, also, one in zip(held(cache), held(helped), held(reference), strict=True):
        assert torch.equal(after, one) and torch.equal(also, one)
    assert cache.layers[0].store.seen.tolist() == LENGTHS


def test_the_floor_and_the_rounding_follow_the_whole_prompt():
    """The budgets themselves: 0.25 of 20 and 13 real tokens rounds half up to 5 and 3; 0.05 of them is 1,
    lifted to the floor of 4. The sliding layer holds at most its window less one."""
    model = build("llama")
    ids, mask = left_padded(LENGTHS)
    for budget, expected in (("float", [5, 3]), ("float-floor", [4, 4])):
        with torch.no_grad(), el.apply(model, policy(budget)) as run:
            out = run.prefill(ids, mask, chunk=3)
        for layer in out.past_key_values.layers:
            assert layer.store.budget.tolist() == expected
            assert layer.store.retained().tolist() == [[n, n] for n in expected]


# ---- generate(..., prefill_chunk_size=N) ----------------------------------------------------------


def generate(model, ids, mask, max_new_tokens=4, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_generate_in_chunks_holds_what_one_shot_generate_holds(budget):
    model = build("gemma2")  # soft-capping, a sliding layer of window 8 beside a full one
    pol = policy(budget, drop=2)
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad(), el.apply(model, pol) as run:
        generate(model, ids, mask, max_new_tokens=1)
        one_shot = run.cache
        for chunk in (1, 3, 7, 19):
            generate(model, ids, mask, max_new_tokens=1, prefill_chunk_size=chunk)
            assert run.cache is not one_shot
            for a, b in zip(held(run.cache), held(one_shot), strict=True):
                assert torch.equal(a, b), chunk
            for a, b in zip(budgets(run.cache), budgets(one_shot), strict=True):
                assert torch.equal(a, b), chunk
        # and decoding on from there stays within the same budgets
        out = generate(model, ids, mask, prefill_chunk_size=7)
        assert out.sequences.shape[1] == WIDTH + 4
        for layer, budget_ in zip(run.cache.layers, budgets(one_shot), strict=True):
            assert bool((layer.store.retained() <= budget_[:, None]).all())
    assert "generate" not in model.__dict__  # the model's own generate is back


def test_generate_reads_the_padding_it_infers_and_expands_beams():
    """Without an attention_mask transformers infers the padding from the pad token; with beams it repeats each
    prompt before the first forward: the declared lengths follow both."""
    model = build("llama")
    pol = policy("float")
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad(), el.apply(model, pol) as run:
        generate(model, ids, None, max_new_tokens=1, prefill_chunk_size=6)
        assert budgets(run.cache)[0].tolist() == [5, 3]
        generate(model, ids, mask, max_new_tokens=2, prefill_chunk_size=6, num_beams=2)
        assert budgets(run.cache)[0].tolist() == [5, 5, 3, 3]
        unpadded = ids[:1]
        generate(model, unpadded, None, max_new_tokens=1, prefill_chunk_size=6)
        assert budgets(run.cache)[0].tolist() == [5]


# ---- a chunked plain forward without the prompt's length ------------------------------------------


def test_a_second_prompt_chunk_under_a_float_budget_is_refused():
    model = build("llama")
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad(), el.apply(model, policy("float")) as run:
        cache = run.new_cache()
        model(input_ids=ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache)
        before = cache.get_seq_length()
        refused = r"second chunk of the prompt.*budget=0\.25.*run\.prefill.*prompt_len.*int budget"
        with pytest.raises(ValueError, match=refused):
            model(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=cache)
        assert cache.get_seq_length() == before  # refused before anything was fed


def test_multi_token_forwards_that_are_not_prompt_chunks_still_run():
    """An int budget chunks freely; after a one-token step a multi-token forward continues the cache; a
    generate() given a cache filled by a plain forward continues it (a question after a compressed context);
    a cache told its prompt's length takes chunks."""
    model = build("llama")
    ids, mask = left_padded(LENGTHS)
    ones = torch.ones_like(mask)
    with torch.no_grad(), el.apply(model, policy("int")) as run:
        cache = run.new_cache()
        model(input_ids=ids[:, :8], past_key_values=cache)
        model(input_ids=ids[:, 8:], past_key_values=cache)
    with torch.no_grad(), el.apply(model, policy("float")) as run:
        cache = run.new_cache()
        model(input_ids=ids[:, :8], past_key_values=cache)
        model(input_ids=ids[:, 8:9], past_key_values=cache)  # a one-token step: the prompt is over
        model(input_ids=ids[:, 9:], past_key_values=cache)
        assert cache.decoded
        cache = run.new_cache()
        model(input_ids=ids[:, :8], attention_mask=ones[:, :8], past_key_values=cache)
        out = model.generate(ids, attention_mask=ones, past_key_values=cache, max_new_tokens=2, do_sample=False)
        assert out.shape[1] == WIDTH + 2 and cache.layers[0].store.budget.tolist() == [2, 2]  # 0.25 of 8
        cache = run.new_cache(prompt_len=WIDTH)
        model(input_ids=ids[:, :8], past_key_values=cache)
        model(input_ids=ids[:, 8:], past_key_values=cache)
        assert cache.layers[0].store.budget.tolist() == [5, 5]


def test_a_declared_prompt_is_checked():
    model = build("llama")
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad(), el.apply(model, policy("float")) as run:
        cache = run.new_cache(prompt_len=5)
        with pytest.raises(ValueError, match="has fed 8 real prompt tokens .* told its prompt has 5"):
            model(input_ids=ids[:1, :8], past_key_values=cache)
        with pytest.raises(ValueError, match="lengths of 3 rows, but its first step has batch size 2"):
            three = run.new_cache(prompt_len=torch.tensor([1, 2, 3]))
            model(input_ids=ids, attention_mask=mask, past_key_values=three)
        filled = run.new_cache()
        model(input_ids=ids, attention_mask=mask, past_key_values=filled)
        with pytest.raises(ValueError, match="before its first forward"):
            filled.declare_prompt(WIDTH)
        for bad, error in ((0, ValueError), (2.0, TypeError), (torch.ones(2), ValueError), (True, TypeError)):
            with pytest.raises(error, match="prompt"):
                run.new_cache(prompt_len=bad)


# ---- run.prefill -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 6, WIDTH + 5])
def test_prefill_with_a_full_cache_is_the_unmodified_model(chunk):
    """Nothing evicted: the last chunk's logits are one forward's, and greedy decoding from the helper's cache
    follows the unmodified model's generate()."""
    model = build("qwen2")
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        reference = generate(model, ids, mask, output_logits=True)
    with el.apply(model, el.Policy(budget=None)) as run:
        out = run.prefill(ids, mask, chunk=chunk)
        torch.testing.assert_close(out.logits[:, -1], whole, rtol=1e-5, atol=1e-5)
        out = run.prefill(ids, mask, chunk=chunk, position_ids=positions(mask))  # generate()'s positions
        cache, grown, logits = out.past_key_values, mask, [out.logits[:, -1]]
        with torch.no_grad():
            for _ in range(3):
                token = logits[-1].argmax(-1, keepdim=True)
                grown = torch.cat([grown, torch.ones_like(token)], dim=1)
                step = model(input_ids=token, attention_mask=grown, past_key_values=cache,
                             position_ids=positions(grown)[:, -1:])
                logits.append(step.logits[:, -1])
    torch.testing.assert_close(torch.stack(logits, 1), torch.stack(reference.logits, 1), rtol=1e-5, atol=1e-5)


def test_prefill_validates_its_arguments():
    model = build("llama")
    ids, mask = left_padded(LENGTHS)
    with el.apply(model, policy("float")) as run:
        for chunk, error in ((0, ValueError), (2.5, TypeError), (True, TypeError), (None, TypeError)):
            with pytest.raises(error, match=r"run\.prefill\(chunk="):
                run.prefill(ids, mask, chunk=chunk)
        with pytest.raises(ValueError, match=r"attention_mask\): expected the prompt's \[batch, tokens\]"):
            run.prefill(ids, mask[:, 1:], chunk=4)
        with pytest.raises(ValueError, match=r"input_ids\): expected a \[batch, tokens\] tensor"):
            run.prefill(ids[0], chunk=4)
        with pytest.raises(ValueError, match="prompt is empty"):
            run.prefill(ids[:, :0], chunk=4)
        with pytest.raises(ValueError, match=r"position_ids\): expected positions for the prompt's 20"):
            run.prefill(ids, mask, chunk=4, position_ids=positions(mask)[:, 1:])
        filled = run.prefill(ids, mask, chunk=4).past_key_values
        with pytest.raises(ValueError, match="expected an empty evictlayers cache"):
            run.prefill(ids, mask, chunk=4, cache=filled)
        mine = run.new_cache()
        assert run.prefill(ids, mask, chunk=4, cache=mine).past_key_values is mine
        assert mine.layers[0].store.budget.tolist() == [5, 3]
    with pytest.raises(RuntimeError, match="patch was removed"):
        run.prefill(ids, mask, chunk=4)


def test_a_one_token_prompt_chunk_never_takes_the_compiled_decode_forward(monkeypatch):
    """Under compile=True a one-token chunk of the prompt is a prefill step, run eagerly; the first decode step
    after the prompt may take the compiled forward (spied on here, never compiled)."""
    model = build("llama")
    ids, mask = left_padded(LENGTHS)
    offered = []
    real = CompiledDecodeForward.stores_in_place

    def spy(self):
        offered.append(real(self) is not None)
        return None  # run everything eagerly

    monkeypatch.setattr(CompiledDecodeForward, "stores_in_place", spy)
    with torch.no_grad(), el.apply(model, policy("float"), compile=True) as run:
        cache = run.prefill(ids, mask, chunk=1).past_key_values
        assert offered and not any(offered)
        grown = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        model(input_ids=ids[:, -1:], attention_mask=grown, past_key_values=cache)
    assert offered[-1]
