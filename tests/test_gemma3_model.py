"""Gemma 3 270M, the second real model (slow: loads ~1 GB of weights and runs it on PG-19 text).

Gemma 3 is Google's base model (no chat template: prompts are plain text). Five of every six layers
attend over a sliding window of 512 tokens, the sixth over everything: the first prompt below is
longer than the window, so the sliding layers' masks are exercised with left padding. Every test is
skipped, with the pip command, when the model's packages are not installed; the prompts are read
from ``shared/data/pg19-sample`` at run time.
"""

import pytest
import torch

import evictlayers as el
from evictlayers import models
from evictlayers.eval.tasks.documents import default_data_dir, document_windows, read_texts

LENGTHS = (600, 420)  # prompt tokens per row: the first crosses the 512-token window, the second is padded
NEW_TOKENS = 8
BUDGET = 64
TOL = {"rtol": 1e-4, "atol": 1e-4}


def h2o(budget: int) -> el.Policy:
    """The ``h2o`` recipe (half recent tokens, half heavy hitters) with ``budget`` tokens per head."""
    return el.load_recipe("h2o").replace(budget=budget)


@pytest.fixture(scope="module")
def gemma():
    try:
        models._chunk_assembler(models.GEMMA3_270M)
    except FileNotFoundError as err:
        pytest.skip(f"Gemma 3 270M is not installed: {err}")
    return models.load("gemma-3-270m")


@pytest.fixture(scope="module")
def pg19_batch(gemma):
    """A left-padded batch of two PG-19 prompts of ``LENGTHS`` tokens, each from its own book, BOS first."""
    if not default_data_dir().is_dir():
        pytest.skip(f"the PG-19 sample is not at {default_data_dir()} (set $EVICTLAYERS_DATA)")
    _, tokenizer = gemma
    windows = document_windows(tokenizer, read_texts()[:2], n_docs=2, doc_tokens=max(LENGTHS) - 1)
    rows = [[tokenizer.bos_token_id, *w["input_ids"][: n - 1]] for w, n in zip(windows, LENGTHS, strict=True)]
    return tokenizer.pad({"input_ids": rows}, return_tensors="pt")


def greedy(model, inputs, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """The ``new_tokens`` greedy tokens after each row of ``inputs``."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[:, inputs["input_ids"].shape[1] :]


@pytest.mark.slow
def test_loads_a_gemma3_text_model_that_continues_plain_text_deterministically(gemma):
    model, tokenizer = gemma
    config = model.config
    assert config.model_type == "gemma3_text" and type(model).__name__ == "Gemma3ForCausalLM"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (18, 4, 1)
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert not getattr(tokenizer, "chat_template", None), "the base model should have no chat template"

    inputs = tokenizer(["The Eiffel Tower is located in the city of", "One, two, three, four,"],
                       return_tensors="pt", padding=True)
    first, second = greedy(model, inputs), greedy(model, inputs)
    assert torch.equal(first, second)
    paris, count = tokenizer.batch_decode(first, skip_special_tokens=True)
    assert paris.startswith(" Paris"), paris
    assert count.startswith(" five, six, seven"), count


@pytest.mark.slow
def test_nothing_evicted_gives_the_unmodified_logits_and_tokens(gemma, pg19_batch):
    model, _ = gemma
    real = pg19_batch["attention_mask"].bool()
    with torch.no_grad():
        reference_logits = model(**pg19_batch).logits
    reference = greedy(model, pg19_batch)
    with el.apply(model, el.Policy(budget=None)):
        with torch.no_grad():
            logits = model(**pg19_batch).logits
        tokens = greedy(model, pg19_batch)
    torch.testing.assert_close(logits[real], reference_logits[real], **TOL)
    assert torch.equal(tokens, reference)


@pytest.mark.slow
def test_h2o_holds_at_most_its_budget_per_layer(gemma, pg19_batch):
    model, _ = gemma
    with el.apply(model, h2o(BUDGET)) as run:
        greedy(model, pg19_batch)
        layers = run.stats()["layers"]
    config = model.config
    assert len(layers) == config.num_hidden_layers
    for index, (kind, layer) in enumerate(zip(config.layer_types, layers, strict=True)):
        # a sliding-window layer never needs more than its window, whatever the budget
        limit = min(BUDGET, config.sliding_window) if kind == "sliding_attention" else BUDGET
        assert layer["retained_tokens"] <= limit, (index, kind, layer)
        assert layer["seen_tokens"] == max(LENGTHS) + NEW_TOKENS - 1, (index, kind, layer)


@pytest.mark.slow
def test_compiled_decode_step_generates_the_eager_tokens_under_h2o(gemma, pg19_batch):
    model, _ = gemma
    with el.apply(model, h2o(BUDGET)):
        eager = greedy(model, pg19_batch)
    with el.apply(model, h2o(BUDGET), compile=True):
        compiled = greedy(model, pg19_batch)
    assert torch.equal(compiled, eager)
