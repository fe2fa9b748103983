"""Every supported family, eager and (where offered) SDPA: with nothing to evict, the patched model is the
unmodified model; after the ``with`` block it is the unmodified model again; unsupported models are refused.

The reference is always the same model run before ``evictlayers.apply`` (or after a checked restore):
never the library's own output.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import evictlayers as el
from tiny_models import FAMILIES, FAMILY_IMPLEMENTATIONS, VOCAB, build, greedy, left_padded, single_thread  # noqa: F401

TOL = dict(rtol=1e-5, atol=1e-5)
LENGTHS = [20, 13]  # a left-padded batch of two prompts of different lengths
NEW_TOKENS = 10  # 30 tokens in all: below the budget of the "h2o-64" policy

CASES = [pytest.param(name, impl, id=f"{name}-{impl}") for name, impl in FAMILY_IMPLEMENTATIONS]
POLICIES = {
    "full": lambda: el.Policy(budget=None),
    "h2o-64": lambda: el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=64),
}


def _forward(model, ids, mask, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kwargs).logits


def _generate(model, ids, mask):
    return greedy(model, ids, mask, NEW_TOKENS)


def _sliding_windows(model) -> list[int | None]:
    """Each layer's sliding window as transformers' own cache for the model sizes it (``None``: full)."""
    cache = transformers.DynamicCache(config=model.config)
    return [getattr(layer, "sliding_window", None) for layer in cache.layers]


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def test_every_family_is_covered_with_its_edge_cases():
    """The tiny configs really exercise what makes each family different (else the tests below are weak)."""
    assert {name for name, impl in FAMILY_IMPLEMENTATIONS if impl == "sdpa"} == set(FAMILIES) - {"gemma2"}
    models = {name: build(name) for name in FAMILIES}
    for name in ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"]:  # grouped-query attention
        assert models[name].config.num_key_value_heads < models[name].config.num_attention_heads, name
    gemma2 = models["gemma2"]
    assert [layer.self_attn.sliding_window for layer in gemma2.model.layers] == [8, None]
    assert gemma2.config.attn_logit_softcapping == 2.0 and gemma2.config.final_logit_softcapping == 5.0
    assert gemma2.config.query_pre_attn_scalar != gemma2.config.head_dim
    assert models["mistral"].config.sliding_window < max(LENGTHS) + NEW_TOKENS
    assert models["qwen3"].model.layers[0].self_attn.q_norm is not None
    for name in ["phi3", "gpt_neox"]:  # partial rotary: RoPE on half of each head
        model = models[name]
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        rotary = next(module for path, module in model.named_modules() if path.endswith("rotary_emb"))
        assert rotary.inv_freq.numel() * 2 == head_dim // 2, name
    # learned absolute positions
    assert isinstance(models["gpt2"].transformer.wpe, torch.nn.Embedding)
    assert isinstance(models["opt"].model.decoder.embed_positions, torch.nn.Embedding)


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("name, impl", CASES)
def test_no_eviction_matches_unmodified_model(name, impl, policy_name):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    real = mask.bool()
    reference_logits = _forward(model, ids, mask)
    reference = _generate(model, ids, mask)

    with el.apply(model, POLICIES[policy_name]()) as run:
        logits = _forward(model, ids, mask)
        generated = _generate(model, ids, mask)
        stats = run.stats()

    torch.testing.assert_close(logits[real], reference_logits[real], **TOL)
    assert torch.equal(generated.sequences, reference.sequences)
    # every decoding step's logits, not only their argmax
    for step, (got, want) in enumerate(zip(generated.logits, reference.logits, strict=True)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, step=step: f"decode step {step}: {m}")
    # the cache really held every token a later query can see: nothing else was evicted (a sliding layer
    # holds its window less the query itself, as transformers' own sliding cache layer does)
    total = max(LENGTHS) + NEW_TOKENS - 1  # the last generated token is never fed back
    held = [
        total if window is None else min(total, window - 1) for window in _sliding_windows(model)
    ]
    assert [layer["retained_tokens"] for layer in stats["layers"]] == held


@pytest.mark.parametrize("name, impl", CASES)
def test_use_cache_false_matches_unmodified_model(name, impl):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    real = mask.bool()
    reference = _forward(model, ids, mask, use_cache=False)
    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=4)
    with el.apply(model, policy):
        out = _forward(model, ids, mask, use_cache=False)
    torch.testing.assert_close(out[real], reference[real], **TOL)


@pytest.mark.parametrize("name, impl", CASES)
def test_model_is_restored_after_the_block(name, impl):
    model = build(name, impl)
    ids, mask = left_padded(LENGTHS)
    real = mask.bool()
    reference = _forward(model, ids, mask)
    modules = _attention_modules(model)
    assert len(modules) == model.config.num_hidden_layers
    classes = [type(m) for m in modules]
    configs = {id(c): (c, c._attn_implementation) for c in [model.config, *(m.config for m in modules)]}
    state_keys = list(model.state_dict())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = {id(m): len(m._forward_pre_hooks) for m in model.modules()}

    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=6)
    with el.apply(model, policy):
        for module, original in zip(modules, classes, strict=True):
            assert type(module) is not original and isinstance(module, original), "attention was not replaced"
        assert list(model.state_dict()) == state_keys
        patched = _forward(model, ids, mask)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    assert [type(m) for m in modules] == classes
    for config, implementation in configs.values():
        assert config._attn_implementation == implementation == impl
    assert list(model.state_dict()) == state_keys
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert {id(m): len(m._forward_pre_hooks) for m in model.modules()} == hooks
    assert not any(hasattr(m, "_evictlayers_run") for m in model.modules())
    torch.testing.assert_close(_forward(model, ids, mask), reference, rtol=0, atol=0)
    # inside the block, a prefill attends to the whole prompt before evicting: even under a budget of 6
    # its logits are the unmodified model's
    torch.testing.assert_close(patched[real], reference[real], **TOL)


def test_model_is_restored_when_the_block_raises():
    model = build("llama", "sdpa")
    ids, mask = left_padded(LENGTHS)
    reference = _forward(model, ids, mask)
    classes = [type(m) for m in _attention_modules(model)]
    with pytest.raises(KeyError, match="boom"):
        with el.apply(model, el.Policy(budget=8)):
            _forward(model, ids, mask)
            raise KeyError("boom")
    assert [type(m) for m in _attention_modules(model)] == classes
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(_forward(model, ids, mask), reference, rtol=0, atol=0)


def test_apply_twice_raises_and_leaves_the_first_run_working():
    model = build("llama", "eager")
    ids, mask = left_padded(LENGTHS)
    real = mask.bool()
    reference = _forward(model, ids, mask)
    classes = [type(m) for m in _attention_modules(model)]
    with el.apply(model, el.Policy(budget=None)) as run:
        with pytest.raises(RuntimeError, match="already applied"):
            el.apply(model, el.Policy(budget=4))
        with pytest.raises(RuntimeError):
            with el.apply(model, el.Policy(budget=None)):
                pass
        torch.testing.assert_close(_forward(model, ids, mask)[real], reference[real], **TOL)
        assert run.stats()["layers"][0]["retained_tokens"] == max(LENGTHS)
    assert [type(m) for m in _attention_modules(model)] == classes
    torch.testing.assert_close(_forward(model, ids, mask), reference, rtol=0, atol=0)
    with el.apply(model, el.Policy(budget=None)):  # applicable again once the first block exited
        pass


def _tiny_bloom():
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(config).eval(), "BloomAttention"


def _tiny_mpt():
    # MPT adds an ALiBi bias inside its own attention code (GPT-J, which did as well, calls the attention
    # interface from transformers 5.24 on and is served there)
    config = transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    torch.manual_seed(0)
    return transformers.MptForCausalLM(config).eval(), "MptAttention"


@pytest.mark.parametrize("make", [_tiny_bloom, _tiny_mpt], ids=["bloom", "mpt"])
def test_unsupported_model_raises_naming_the_attention_class(make):
    model, attention_class = make()
    ids, mask = left_padded(LENGTHS)
    reference = _forward(model, ids, mask)
    implementation = model.config._attn_implementation
    with pytest.raises(el.UnsupportedModelError, match=attention_class):
        el.apply(model, el.Policy(budget=8))
    # refused before touching anything
    assert type(next(m for m in model.modules() if type(m).__name__ == attention_class)).__name__ == attention_class
    assert model.config._attn_implementation == implementation
    assert not hasattr(model, "_evictlayers_run")
    torch.testing.assert_close(_forward(model, ids, mask), reference, rtol=0, atol=0)


def test_soft_capped_logits_under_sdpa_are_refused():
    """transformers' sdpa attention does not soft-cap (5.14-5.20 offer it for Gemma2 and drop the cap;
    later releases raise): the unmodified model is not defined there, so evictlayers refuses."""
    model = build("gemma2", "eager")
    for config in {id(c): c for c in [model.config, *(m.config for m in _attention_modules(model))]}.values():
        config._attn_implementation_internal = "sdpa"  # as a release that offers sdpa for Gemma2 sets it
    ids, mask = left_padded(LENGTHS)
    with pytest.raises(el.UnsupportedModelError, match="model_type='gemma2'.*layer 0.*soft-caps.*attn_implementation='eager'"):
        with el.apply(model, el.Policy(budget=None)):
            _forward(model, ids, mask)
    assert not hasattr(model, "_evictlayers_run")


def test_keys_changed_after_the_cache_update_are_refused_at_the_attention_call():
    """Keys the attention call receives that are neither what the cache received, nor its heads repeated,
    nor the module's expand_kv of a cached latent: the slot store would attend over other keys, so the call
    refuses, naming the layer (a model that scales its keys after cache.update stands in for one)."""
    from transformers import AttentionInterface

    from evictlayers.hf import attention

    model = build("llama")
    ids, mask = left_padded(LENGTHS)

    def scaled_keys(module, query, key, value, *args, **kwargs):
        return attention.evicting_attention(module, query, key * 2, value, *args, **kwargs)

    with el.apply(model, el.Policy(budget=None)):
        AttentionInterface.register(attention.ATTENTION_NAME, scaled_keys)
        try:
            refusal = r"model_type='llama', LlamaAttention \(layer 0\) changes its keys"
            with pytest.raises(el.UnsupportedModelError, match=refusal):
                _forward(model, ids, mask)
        finally:
            attention.register()
