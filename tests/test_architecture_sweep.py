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

MIN_WORKING = 90

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
    "llama4_text": ["model_type='llama4_text'", "layer 0", "chunked attention"],
    "rwkv": ["model_type='rwkv'", "cache class of its own"],
    "prophetnet": ["model_type='prophetnet'", "encoder-decoder"],
    "mllama": ["layer 3", "MllamaTextCrossAttention", "cross-attention"],
    "diffllama": ["layer 0", "2 times"],
    "falcon_mamba": ["model_type='falcon_mamba'", "no attention layer"],
    "deepseek_v3": ["model_type='deepseek_v3'", "DeepseekV3Attention (layer 0)", "latent"],
    "bloom": ["model_type='bloom'", "layer 0", "BloomAttention", "attention interface"],
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


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss", "qwen3_next", "smollm3"])
def test_compiled_decode_equals_eager_on_new_attention_features(model_type):
    """Sliding windows with local and global layers, learned sinks, a hybrid cache, NoPE layers: the
    compiled decode step gives the eager step's tokens and logits under an H2O budget."""
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
