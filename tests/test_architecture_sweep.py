"""The conformance sweep: every causal-LM architecture transformers ships either works under
``evictlayers.apply`` (the unmodified model's logits and tokens with nothing evicted; an H2O budget
held per layer) or is refused with ``UnsupportedModelError``; a different result fails. The outcome of
each type must also be the one ``docs/models.md`` reports (regenerate it with
``python scripts/models_doc.py``).
"""

from __future__ import annotations

import warnings

import pytest
import transformers

import evictlayers as el
from architecture_sweep import SLOW_TYPES, causal_lm_types, conformance, documented_outcomes
from tiny_models import single_thread  # noqa: F401

MIN_WORKING = 140

TYPES = [pytest.param(t, marks=pytest.mark.slow) if t in SLOW_TYPES else t for t in causal_lm_types()]


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("model_type", TYPES)
def test_architecture_works_or_is_refused(model_type):
    outcome = conformance(model_type, el)
    version, documented = documented_outcomes()
    if version == transformers.__version__:
        assert documented.get(model_type) == (outcome.status, outcome.rolling), (
            f"{model_type}: the sweep finds {outcome.status!r}, rolling {outcome.rolling!r} ({outcome.reason}) but "
            f"docs/models.md says {documented.get(model_type)!r}; regenerate it with `python scripts/models_doc.py`"
        )
    if outcome.status == "skipped":
        pytest.skip(f"transformers cannot build or run the shrunk {model_type}: {outcome.reason}")
    if outcome.status == "refused":
        assert outcome.reason, model_type


def test_documented_sweep_covers_every_type_and_enough_work():
    version, documented = documented_outcomes()
    assert version is not None, "docs/models.md does not name the transformers version it was generated on"
    if version == transformers.__version__:
        assert sorted(documented) == causal_lm_types()
    assert sum(status == "works" for status, _ in documented.values()) >= MIN_WORKING


REFUSALS = {
    "inkling_text": ["model_type='inkling_text'", "layer 0", "position_bias=", "additive position bias"],
    "rwkv": ["model_type='rwkv'", "cache class of its own"],
    "prophetnet": ["model_type='prophetnet'", "encoder-decoder"],
    "mllama": ["layer 3", "MllamaTextCrossAttention", "cross-attention"],
    "diffllama": ["layer 0", "2 times", "other key/value heads", "per-head eviction"],
    "deepseek_v4": ["model_type='deepseek_v4'", "'heavily_compressed_attention'", "not a key per token"],
    "falcon_mamba": ["model_type='falcon_mamba'", "no attention layer"],
    "bloom": ["model_type='bloom'", "layer 0", "BloomAttention", "attention interface"],
    "qwen4_exp_text": ["model_type='qwen4_exp_text'", "layer 3", "'indexed_attention'", "indexer", "QSA"],
    "bart": ["model_type='bart'", "layer 0", "BartAttention", "encoder_attn", "cross-attention", "encoder-decoder"],
}


@pytest.mark.parametrize("model_type", sorted(REFUSALS))
def test_a_refusal_names_the_model_the_layer_and_the_reason(model_type):
    outcome = conformance(model_type, el)
    version, _ = documented_outcomes()
    if outcome.status != "refused" and version != transformers.__version__:
        pytest.skip(f"transformers {transformers.__version__} builds {model_type} differently ({outcome.status})")
    assert outcome.status == "refused", outcome
    for part in REFUSALS[model_type]:
        assert part in outcome.reason, (part, outcome.reason)


def test_the_shrink_keeps_what_makes_the_new_types_different():
    """Per-layer sizes, KV sharing, sparse and recurrent layers and the decoder stack of an encoder-decoder
    type survive the generic shrink (else their sweep rows say little)."""
    from architecture_sweep import LAYERS, causal_lm_types, tiny_config, tiny_model

    gemma4 = tiny_model("gemma4_text")
    assert gemma4.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    # the global layer twice as wide, as in Gemma 4 (a per-layer override in recent transformers, a
    # global_head_dim in older ones)
    assert [layer.self_attn.head_dim for layer in gemma4.model.layers] == [16, 16, 16, 32]
    if "dots3_note_text" in causal_lm_types():
        dots3 = tiny_config("dots3_note_text")
        sliding = dots3.per_layer_config[dots3.layer_types.index("sliding_attention")]
        assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim
        assert sliding.kv_lora_rank != dots3.per_layer_config[0].kv_lora_rank
    gemma3n = tiny_config("gemma3n_text")
    assert gemma3n.num_kv_shared_layers == 2 and set(gemma3n.layer_types[:2]) == set(gemma3n.layer_types[2:])
    if "qwen4_exp_text" in causal_lm_types():
        qwen4 = tiny_config("qwen4_exp_text")
        assert set(qwen4.layer_types) == {"linear_attention", "indexed_attention"}
    assert tiny_config("bart").decoder_layers == LAYERS


def test_gemma4_global_layers_with_their_own_key_value_heads_work():
    """Gemma 4's large variants give their global layers fewer key/value heads than the local ones, and take
    the values from the key projection (attention_k_eq_v): each layer's cache holds its own head count and
    head dim."""
    from architecture_sweep import tiny_config, tiny_model

    if getattr(tiny_config("gemma4_text"), "is_heterogeneous", False):  # per-layer overrides (recent transformers)
        changes = {"attention_k_eq_v": True, "per_layer_config": {3: {"head_dim": 32, "num_key_value_heads": 1}}}
    else:
        changes = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
    model = tiny_model("gemma4_text", **changes)
    assert [layer.self_attn.k_proj.out_features for layer in model.model.layers] == [32, 32, 32, 32]  # 2 x 16, 1 x 32
    assert model.model.layers[3].self_attn.v_proj is None  # the global layer's values come from its key projection
    outcome = conformance("gemma4_text", el, **changes)
    assert outcome.status == "works", outcome


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type", ["gemma3_text", "gpt_oss", "qwen3_next", "smollm3", "gemma4_text", "jetmoe", "deepseek_v3"]
)
def test_compiled_decode_equals_eager_on_new_attention_features(model_type):
    """Sliding windows with local and global layers, learned sinks, a hybrid cache, NoPE layers, per-layer
    head dims, cached heads repeated per expert, a cached latent expanded per head (MLA): the compiled
    decode step gives the eager step's tokens and logits under an H2O budget."""
    import torch

    from architecture_sweep import BUDGET, LENGTHS, NEW_TOKENS, tiny_model
    from tiny_models import greedy, left_padded

    model = tiny_model(model_type)
    ids, mask = left_padded(LENGTHS)
    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=BUDGET)
    runs = []
    for compiled in (False, True):
        with el.apply(model, policy, compile=compiled):
            runs.append(greedy(model, ids, mask, NEW_TOKENS))
    eager, compiled = runs
    assert torch.equal(eager.sequences, compiled.sequences)
    for got, want in zip(compiled.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
