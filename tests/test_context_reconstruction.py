"""KVzip's context reconstruction (``ContextReconstruction``, ``run.compress_context``) against the unmodified
model, and the probe step and deferred eviction it runs on.

The reference is independent of evictlayers: transformers' own eager Llama with a ``DynamicCache``, the context
prefilled, then each chunk's ``<repeat prompt> + <chunk>`` run over a copy of that cache with
``output_attentions=True``; a context token's score is the largest probability any of the probe's query rows
and any query head of its KV head's group gives it, over the chunks. The repeat prompts are written out here
from the paper's authors' wording, not imported."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache

import evictlayers as el
from evictlayers.compose import probe_step as probe_module
from evictlayers.compose.positions import RotaryTable
from evictlayers.hf.cache import EvictionCache
from evictlayers.hf.reconstruction import generation_suffix
from evictlayers.scoring import ScoreAccumulator
from tiny_models import VOCAB, _llama_like, left_padded, single_thread  # noqa: F401

N, CHUNK, BUDGET = 40, 24, 12  # a 40-token context reconstructed in two chunks (24 + 16 tokens)


class CharTokenizer:
    """One id per character, no chat template: KVzip's prompts in ids the reference can rebuild."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % (VOCAB - 3) for c in text]


class TemplateTokenizer(CharTokenizer):
    chat_template = "{{ user }}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        assert add_generation_prompt and not tokenize
        return "<user>" + messages[0]["content"] + "</user><assistant>"


def tiny_llama():
    """A GQA Llama (4 query heads over 2 KV heads) with head dim 16, eager attention."""
    config = _llama_like(transformers.LlamaConfig, head_dim=16, max_position_embeddings=512)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def kvzip(budget=BUDGET, *modules):
    return el.Policy(*modules, el.HeavyHitterSelector(el.ContextReconstruction()), budget=budget, gqa_reduce="max")


def context(length=N, seed=3):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def reference_probes(row: torch.Tensor) -> list[torch.Tensor]:
    """KVzip's probes of one context row ``[n]`` (the authors' ``self_task``): before the first chunk the repeat
    prompt, before a later one the continuation prompt and the previous chunk's last 8 tokens; then the
    no-template suffix "\\n\\nAnswer: "; then the chunk."""
    tok = CharTokenizer()
    suffix = tok.encode("\n\nAnswer: ")
    chunks = [row[i : i + CHUNK] for i in range(0, len(row), CHUNK)]
    probes = []
    for i, part in enumerate(chunks):
        if i == 0:
            prompt = tok.encode("\n\nRepeat the previous context exactly.")
        else:
            prompt = tok.encode("\n\nRepeat the part of the previous context exactly, starting with ")
            prompt = prompt + chunks[i - 1][-8:].tolist()
        probes.append(torch.tensor(prompt + suffix + part.tolist())[None])
    return probes


def reference_scores(model, row: torch.Tensor) -> torch.Tensor:
    """``[L, H_kv, n]``: KVzip's score of each context token of ``row`` ``[n]`` per layer and KV head, from the
    unmodified model's attention probabilities."""
    config = model.config
    kv_heads, n = config.num_key_value_heads, len(row)
    group = config.num_attention_heads // kv_heads
    with torch.no_grad():
        prefilled = DynamicCache(config=config)
        model(row[None], past_key_values=prefilled)
        scores = torch.zeros(config.num_hidden_layers, kv_heads, n)
        for probe in reference_probes(row):
            out = model(probe, past_key_values=copy.deepcopy(prefilled), output_attentions=True)
            for layer, attention in enumerate(out.attentions):  # [1, H_q, P, n + P]
                columns = attention[0, :, :, :n].reshape(kv_heads, group, probe.shape[1], n)
                scores[layer] = torch.maximum(scores[layer], columns.amax(dim=(1, 2)))
    return scores


def by_position(store) -> torch.Tensor:
    """``[B, H_kv, n]`` the reconstruction score of the store's held tokens, by position."""
    pos, state = store.pos, store.state["reconstruction"]
    out = torch.full((pos.shape[0], pos.shape[1], int(pos.max()) + 1), float("nan"))
    return out.scatter_(2, pos.clamp(min=0), torch.where(pos >= 0, state, float("nan")))


@pytest.fixture
def before_eviction(monkeypatch):
    """What each layer's store holds when ``evict_deferred`` is called: ``[(scores by position, pos)]`` per layer."""
    seen = []
    original = EvictionCache.evict_deferred

    def recording(cache):
        seen.extend((by_position(store), store.pos.clone()) for store in cache._stores())
        original(cache)

    monkeypatch.setattr(EvictionCache, "evict_deferred", recording)
    return seen


# ---- (a) the scores are the unmodified model's, (b) each head keeps its top budget --------------------------

def test_scores_are_the_reconstructions_largest_probability_and_each_head_keeps_its_top_budget(before_eviction):
    model = tiny_llama()
    ids = context()
    reference = reference_scores(model, ids[0])
    with el.apply(model, kvzip(), tokenizer=CharTokenizer()) as run:
        cache = run.compress_context(ids, chunk=CHUNK)
    assert len(before_eviction) == model.config.num_hidden_layers
    for layer, (scores, pos) in enumerate(before_eviction):
        # the context only, every token held until the probes had run, the probes' own tokens never stored
        assert torch.equal(pos.sort(-1).values, torch.arange(N).expand(1, 2, N))
        torch.testing.assert_close(scores[0], reference[layer], rtol=1e-5, atol=1e-6)
        kept = cache.layers[layer].store.pos[0]  # [H_kv, budget + 1]
        for head in range(2):
            held = sorted(kept[head][kept[head] >= 0].tolist())
            assert held == sorted(reference[layer, head].topk(BUDGET).indices.tolist()), (layer, head)
    assert cache.get_seq_length() == N and int(cache.layers[0].store.seen) == N
    assert max(layer["retained_tokens"] for layer in cache.stats()["layers"]) == BUDGET


def test_probe_rows_in_blocks_score_as_one_block(monkeypatch, before_eviction):
    """A long probe's rows are observed a block at a time (bounded memory): the maxima are the same."""
    model = tiny_llama()
    with el.apply(model, kvzip(), tokenizer=CharTokenizer()) as run:
        run.compress_context(context(), chunk=CHUNK)
        whole = [scores.clone() for scores, _ in before_eviction]
        before_eviction.clear()
        monkeypatch.setattr(probe_module, "PROBE_ROW_ELEMENTS", 2 * N * 3)  # a few rows per block
        run.compress_context(context(), chunk=CHUNK)
    for one, blocked in zip(whole, (scores for scores, _ in before_eviction)):
        torch.testing.assert_close(blocked, one, rtol=0, atol=1e-7)


def test_a_context_prefilled_in_chunks_keeps_what_one_forward_keeps():
    model = tiny_llama()
    with el.apply(model, kvzip(), tokenizer=CharTokenizer()) as run:
        whole = run.compress_context(context(), chunk=CHUNK)
        chunked = run.compress_context(context(), chunk=CHUNK, prefill_chunk=7)
    for a, b in zip(whole.layers, chunked.layers):
        assert torch.equal(a.store.pos.sort(-1).values, b.store.pos.sort(-1).values)


# ---- (c) the probes leave nothing behind --------------------------------------------------------------------

def test_a_full_compressed_cache_answers_as_the_unmodified_model_on_context_and_question():
    """budget=None: after the probes the cache holds exactly the context, so a question's logits are the
    unmodified model's on context + question, and its keys are a plain prefill's."""
    model = tiny_llama()
    ids, question = context(), torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = model(torch.cat([ids, question], 1)).logits[:, N:]
    with el.apply(model, kvzip(budget=None), tokenizer=CharTokenizer()) as run:
        cache = run.compress_context(ids, chunk=CHUNK)
        plain = run.prefill(ids, chunk=N).past_key_values
        for layer, other in zip(cache.layers, plain.layers):
            store = layer.store
            assert store.seq_len == N and int(store.seen) == N and not store.deferred and not store.probing
            assert torch.equal(store.pos[store.pos >= 0].sort().values, torch.arange(N).repeat_interleave(2))
            torch.testing.assert_close(store.keys[..., :N, :], other.store.keys[..., :N, :], rtol=0, atol=0)
        with torch.no_grad():
            out = model(question, attention_mask=torch.ones(1, N + 6, dtype=torch.long), past_key_values=cache)
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-5)


def test_a_probe_changes_nothing_but_the_scorers_state_of_the_held_slots():
    """At the slot store: slots, positions, tokens seen, columns fed and the state of other selectors are what
    they were; the reconstruction score of the held slots is what changed."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 50, 16, generator=g) for h in (4, 2, 2))
    policy = kvzip(8, el.SinkTokens(2))
    store = el.SlotStore(policy)
    store.defer()
    store.step(q[:, :, :30], k[:, :, :30], v[:, :, :30], scaling=0.25)
    before = (store.keys.clone(), store.values.clone(), store.pos.clone(), store.seen.clone(), store.seq_len)
    assert not store.state["reconstruction"].any()  # a deferred token waits for the probes
    store.probing = True
    out = store.step(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], scaling=0.25)
    store.probing = False
    after = (store.keys, store.values, store.pos, store.seen, store.seq_len)
    for a, b in zip(before, after):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert store.state["reconstruction"].gt(0).all() and out.shape == (2, 4, 20, 16)
    store.evict_deferred()
    assert store.capacity == 9 and int(store.retained().max()) == 8 and store.pos[..., :2].ge(0).all()


# ---- batches ------------------------------------------------------------------------------------------------

def test_a_left_padded_batch_compresses_each_row_as_alone(before_eviction):
    model = tiny_llama()
    ids, mask = left_padded([N, 29], seed=5)
    question = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(6))
    references = [reference_scores(model, ids[row][mask[row].bool()]) for row in range(2)]
    with el.apply(model, kvzip(), tokenizer=CharTokenizer()) as run:
        batched = run.compress_context(ids, mask, chunk=CHUNK)
        with torch.no_grad():
            qmask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], 1)
            positions = (qmask.cumsum(1) - 1)[:, -4:]
            batched_logits = model(question, attention_mask=qmask, position_ids=positions,
                                   past_key_values=copy.deepcopy(batched)).logits
        batched_scores = list(before_eviction)
        for row in range(2):
            before_eviction.clear()
            alone = ids[row][mask[row].bool()][None]
            solo = run.compress_context(alone, chunk=CHUNK)
            reference = references[row]
            for layer, (scores, _) in enumerate(before_eviction):
                n = alone.shape[1]
                torch.testing.assert_close(batched_scores[layer][0][row][:, :n], scores[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(scores[0], reference[layer], rtol=1e-5, atol=1e-6)
                kept = lambda p: sorted(p[p >= 0].tolist())  # noqa: E731
                for head in range(2):
                    together = batched.layers[layer].store.pos[row, head]
                    assert kept(together) == kept(solo.layers[layer].store.pos[0, head])
            with torch.no_grad():
                solo_logits = model(question[row : row + 1], attention_mask=torch.ones(1, alone.shape[1] + 4,
                                    dtype=torch.long), past_key_values=solo).logits
            torch.testing.assert_close(batched_logits[row], solo_logits[0], rtol=1e-4, atol=1e-5)


# ---- (d) generate() after compression ------------------------------------------------------------------------

def test_generate_after_compression_stays_within_budget_and_keeps_what_it_writes():
    """The question and the answer score above every context token: after generating, each head holds all of
    them and the best-scored context tokens in the rest of its budget. Generating from a copy of the cache with
    the context's ids before the question's (the mask over both either way) gives the same tokens."""
    model = tiny_llama()
    ids = context()
    question = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(1, N + 4, dtype=torch.long)
    reference = reference_scores(model, ids[0])
    with el.apply(model, kvzip(), tokenizer=CharTokenizer()) as run:
        cache = run.compress_context(ids, chunk=CHUNK)
        twin = copy.deepcopy(cache)
        out = model.generate(question, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
        stats = run.stats()
        again = model.generate(torch.cat([ids, question], 1), attention_mask=mask, past_key_values=twin,
                               max_new_tokens=5, do_sample=False)
    assert torch.equal(out[:, 4:], again[:, N + 4 :])
    assert all(layer["retained_tokens"] <= BUDGET for layer in stats["layers"])
    written = set(range(N, N + 4 + 5 - 1))  # the question and the generated tokens fed back (the last is not)
    for layer, entry in enumerate(cache.layers):
        pos = entry.store.pos[0]
        for head in range(2):
            held = set(pos[head][pos[head] >= 0].tolist())
            best = reference[layer, head].topk(BUDGET - len(written)).indices.tolist()
            assert held == written | set(best), (layer, head)


def test_room_keeps_the_compressed_context_whole_while_answering():
    """``room``: the budget grows by that much after compression, so the question and answer fill it and every
    head keeps its top-``budget`` context tokens, as KVzip's appended question and answer leave the context."""
    model = tiny_llama()
    ids = context()
    question = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
    reference = reference_scores(model, ids[0])
    with el.apply(model, kvzip(), tokenizer=CharTokenizer()) as run:
        cache = run.compress_context(ids, chunk=CHUNK, room=8)
        stores = [layer.store for layer in cache.layers]
        assert all(int(store.budget) == BUDGET + 8 and store.capacity == BUDGET + 9 for store in stores)
        model.generate(question, attention_mask=torch.ones(1, N + 4, dtype=torch.long), past_key_values=cache,
                       max_new_tokens=5, do_sample=False)
        assert all(layer["retained_tokens"] == BUDGET + 8 for layer in run.stats()["layers"])
    written = set(range(N, N + 8))
    for layer, entry in enumerate(cache.layers):
        pos = entry.store.pos[0]
        for head in range(2):
            held = set(pos[head][pos[head] >= 0].tolist())
            assert held == written | set(reference[layer, head].topk(BUDGET).indices.tolist()), (layer, head)


# ---- (e) refusals --------------------------------------------------------------------------------------------

class ProbeSum(ScoreAccumulator):
    """A scorer that observes probes without needing them (to reach the slot store's own refusals)."""

    observes_probes = True
    reads_mass = False
    state_specs = {"probed": ()}

    def update(self, state, observation, view):
        if observation.probe:
            state["probed"] += observation.rows.sum(2)

    def score(self, state, view):
        return state["probed"]


def test_policies_that_cannot_score_by_probes_are_refused_when_built():
    selector = el.HeavyHitterSelector(el.ContextReconstruction())
    with pytest.raises(ValueError, match=r"gqa_reduce='max'"):
        el.Policy(selector, budget=8)
    with pytest.raises(ValueError, match="rolling"):
        el.Policy(el.HeavyHitterSelector(el.ContextReconstruction()), budget=8, gqa_reduce="max", positions="rolling")
    with pytest.raises(ValueError, match="ClusterSketch"):
        el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.ContextReconstruction()), el.ClusterSketch(radius=1.0),
                  budget=8, gqa_reduce="max")
    with pytest.raises(ValueError, match="cannot observe a probe"):
        el.Policy(el.HeavyHitterSelector(el.ContextReconstruction(), share=0.5),
                  el.HeavyHitterSelector(el.Cumulative(), share=0.5), budget=8, gqa_reduce="max")
    with pytest.raises(ValueError, match="cannot observe a probe"):
        el.Policy(el.HeavyHitterSelector(el.ContextReconstruction(), prior=el.ValuePrior()), budget=8, gqa_reduce="max")


def test_plain_generation_without_compression_is_refused():
    model = tiny_llama()
    with el.apply(model, kvzip()) as run:
        with pytest.raises(ValueError, match="run.compress_context"):
            model.generate(context(), max_new_tokens=2, do_sample=False)
        cache = run.compress_context(context(), repeat_prompt=[5, 6, 7], chunk=CHUNK)
        cache.reset()  # a reset cache is a fresh one: it must be compressed again
        with pytest.raises(ValueError, match="run.compress_context"):
            model(context(), past_key_values=cache)
    with el.apply(model, kvzip(budget=None)):  # nothing is evicted, so nothing is ranked: served
        model.generate(context(), max_new_tokens=2, do_sample=False)


def test_compress_context_refuses_bad_policies_and_arguments():
    model = tiny_llama()
    ids = context()
    with el.apply(model, el.load_recipe("h2o")) as run:
        with pytest.raises(ValueError, match="cannot observe"):
            run.compress_context(ids, repeat_prompt=[5])
    with el.apply(model, kvzip()) as run:
        with pytest.raises(ValueError, match="repeat prompt's token ids"):
            run.compress_context(ids)
        for bad in ([], [1.5], "repeat", torch.ones(2, 3, dtype=torch.long)):
            with pytest.raises(ValueError, match="repeat_prompt"):
                run.compress_context(ids, repeat_prompt=bad)
        for chunk in (0, True, 2.0):
            with pytest.raises(ValueError, match="chunk"):
                run.compress_context(ids, repeat_prompt=[5], chunk=chunk)
        with pytest.raises(ValueError, match="prefill_chunk"):
            run.compress_context(ids, repeat_prompt=[5], prefill_chunk=0)
        for room in (-1, 1.5):
            with pytest.raises(ValueError, match="room"):
                run.compress_context(ids, repeat_prompt=[5], room=room)
        with pytest.raises(ValueError, match="input_ids"):
            run.compress_context(ids.float(), repeat_prompt=[5])
        with pytest.raises(ValueError, match="attention_mask"):
            run.compress_context(ids, torch.ones(1, 3), repeat_prompt=[5])
        with pytest.raises(ValueError, match="no real token"):
            run.compress_context(ids.repeat(2, 1), torch.cat([torch.ones(1, N), torch.zeros(1, N)]).long(),
                                 repeat_prompt=[5])
        used = run.compress_context(ids, repeat_prompt=[5], chunk=CHUNK)
        with pytest.raises(ValueError, match="empty evictlayers cache"):
            run.compress_context(ids, repeat_prompt=[5], cache=used)
    with pytest.raises(RuntimeError, match="inside the `with` block"):
        run.compress_context(ids, repeat_prompt=[5])


def rope_table(head_dim: int = 16) -> RotaryTable:
    def compute(rows, device, dtype):
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)

    return RotaryTable(compute)


def test_the_slot_store_refuses_probes_it_cannot_serve():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 12, 16, generator=g) for h in (4, 2, 2))

    def probe(policy, prefill=True, **store_options):
        store = el.SlotStore(policy, **store_options)
        if prefill:
            store.step(q[:, :, :8], k[:, :, :8], v[:, :, :8], scaling=0.25)
        store.probing = True
        return store.step(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], scaling=0.25)

    with pytest.raises(ValueError, match="does not observe probes"):
        probe(el.load_recipe("h2o").replace(budget=4))
    with pytest.raises(ValueError, match="ClusterSketch"):
        probe(el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(ProbeSum()), el.ClusterSketch(radius=1.0), budget=4))
    with pytest.raises(ValueError, match="holds nothing"):
        probe(el.Policy(el.HeavyHitterSelector(ProbeSum()), budget=4), prefill=False)
    with pytest.raises(ValueError, match="chunked-attention"):
        probe(el.Policy(el.HeavyHitterSelector(ProbeSum()), budget=4), chunk=16)
    with pytest.raises(ValueError, match="rolling positions"):
        probe(el.Policy(el.HeavyHitterSelector(ProbeSum()), budget=4, positions="rolling"), rotary=rope_table())
    assert probe(el.Policy(el.HeavyHitterSelector(ProbeSum()), budget=4)).shape == (1, 4, 4, 16)
    # a deferring store decodes nothing until the deferral ends
    store = el.SlotStore(kvzip(4))
    store.defer()
    store.step(q[:, :, :8], k[:, :, :8], v[:, :, :8], scaling=0.25)
    with pytest.raises(ValueError, match="evict_deferred"):
        store.step(q[:, :, 8:9], k[:, :, 8:9], v[:, :, 8:9], scaling=0.25)
    with pytest.raises(ValueError, match="before the store's first step"):
        store.defer()


# ---- (f) the recipe and KVzip's prompts ----------------------------------------------------------------------

def test_the_recipe_is_kvzips_composition_and_runs_end_to_end():
    policy = el.load_recipe("kvzip")
    assert policy == el.Policy(el.SinkTokens(4), el.HeavyHitterSelector(el.ContextReconstruction()), budget=0.3,
                               gqa_reduce="max")
    assert policy.requires_probes and policy.observes_probes and not policy.decode_needs_mass
    model = tiny_llama()
    ids = torch.randint(3, VOCAB, (1, 150), generator=torch.Generator().manual_seed(1))
    with el.apply(model, policy, tokenizer=CharTokenizer()) as run:
        cache = run.compress_context(ids, chunk=64)
        assert all(layer["retained_tokens"] == 45 for layer in cache.stats()["layers"])  # 30% of 150
        out = model.generate(ids[:, :3], attention_mask=torch.ones(1, 153, dtype=torch.long), past_key_values=cache,
                             max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7) and all(layer["retained_tokens"] <= 45 for layer in run.stats()["layers"])


def test_kvzips_prompts_follow_the_chat_template():
    assert generation_suffix(CharTokenizer()) == "\n\nAnswer: "
    assert generation_suffix(TemplateTokenizer()) == "</user><assistant>"
