"""The Lightning eval loop against independent references, on tiny random models.

References: the unmodified model's one-pass teacher-forced perplexity (full cache), an unmodified
Mistral with a sliding window (the local-window stream is banded attention), the unmodified model's
own ``generate`` (full-cache generation tasks), slot counts computed from the config (histograms),
and the single-process run (DDP).
"""

from __future__ import annotations

import math

import pytest
import torch

import evictlayers as el
from evictlayers.eval.module import PolicyEvaluator, merge_records, run_test
from evictlayers.eval.runner import evaluate, expand_budgets, inline_spec, resolve_recipe
from evictlayers.eval.suite import make_task
from test_eval_helpers import char_tokenizer, teacher_forced_perplexity, tiny_llama, tiny_mistral
from tiny_models import single_thread  # noqa: F401

FULL = el.Policy(budget=None)
H2O = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.2)
LOCAL = el.Policy(el.RecentWindow(), budget=0.2, min_budget=1)  # the tiny model's short streams: no floor


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok))


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """Two small plain-text 'books' (the real ones are exercised by the slow tests and the claims)."""
    root = tmp_path_factory.mktemp("books")
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly vex a jumbo sphinx".split()
    for i, name in enumerate(("one.txt", "two.txt")):
        gen = torch.Generator().manual_seed(i)
        picks = torch.randint(0, len(words), (400,), generator=gen)
        (root / name).write_text(" ".join(words[j] for j in picks) + ".\n")
    return root


def _evaluate(model, task, policies, **kwargs):
    kwargs.setdefault("progress", False)
    return run_test(PolicyEvaluator(model, task, policies, threads=1), **kwargs)


def _docs(task) -> torch.Tensor:
    return torch.tensor([row["input_ids"] for row in task.rows()])


# ---- perplexity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5])
def test_full_cache_stream_equals_one_pass_perplexity(model, tok, books, chunk):
    task = make_task("perplexity", tok, data=books, n_docs=3, doc_tokens=48, chunk=chunk)
    summaries, records = _evaluate(model, task, {"full": FULL, "big": el.Policy(el.RecentWindow(), budget=64)},
                                   batch_size=2)
    reference = teacher_forced_perplexity(model, _docs(task))
    assert summaries["full"]["perplexity"] == pytest.approx(reference, rel=1e-5)
    # a budget above the document length never evicts: the same perplexity
    assert summaries["big"]["perplexity"] == pytest.approx(reference, rel=1e-5)
    for record in records["full"]:
        alone = teacher_forced_perplexity(model, torch.tensor([task.rows()[record["index"]]["input_ids"]]))
        assert record["perplexity"] == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("window", [6, 15])
def test_local_window_stream_equals_banded_attention(tok, books, window):
    """Streaming with a local window of w tokens: each token attends to itself and the w before it, which
    is what an unmodified Mistral with sliding_window = w + 1 computes in one pass."""
    evicting = tiny_mistral(len(tok), sliding_window=None)
    banded = tiny_mistral(len(tok), sliding_window=window + 1)
    task = make_task("perplexity", tok, data=books, n_docs=2, doc_tokens=40)
    summaries, _ = _evaluate(evicting, task, {"local": el.Policy(el.RecentWindow(), budget=window)}, batch_size=2)
    docs = _docs(task)
    assert summaries["local"]["perplexity"] == pytest.approx(teacher_forced_perplexity(banded, docs), rel=1e-5)
    assert summaries["local"]["perplexity"] != pytest.approx(teacher_forced_perplexity(evicting, docs), rel=1e-3)


def test_float_budget_is_a_fraction_of_the_streamed_tokens(model, tok, books):
    task = make_task("perplexity", tok, data=books, n_docs=1, doc_tokens=51)  # 50 tokens streamed
    summaries, records = _evaluate(model, task, {"local": LOCAL})
    assert records["local"][0]["budget_tokens"] == 10
    assert summaries["local"]["budget_tokens"] == 10
    # the same as asking for 10 tokens directly
    direct, _ = _evaluate(model, task, {"local": el.Policy(el.RecentWindow(), budget=10)})
    assert direct["local"]["perplexity"] == summaries["local"]["perplexity"]


def test_a_streamed_fraction_is_lifted_to_the_floor(model, tok, books):
    task = make_task("perplexity", tok, data=books, n_docs=1, doc_tokens=51)  # 50 tokens streamed: 10 at 0.2
    summaries, _ = _evaluate(model, task, {"local": el.Policy(el.RecentWindow(), budget=0.2, min_budget=16)})
    assert summaries["local"]["budget_tokens"] == 16


# ---- agreement ----------------------------------------------------------------------------------


def test_agreement_of_the_full_cache_is_perfect(model, tok, books):
    task = make_task("agreement", tok, data=books, n_docs=2, doc_tokens=60)
    summaries, _ = _evaluate(model, task, {"full": FULL, "local": LOCAL}, batch_size=2)
    assert summaries["full"]["top1"] == 1.0
    assert summaries["full"]["score"] == 1.0
    assert abs(summaries["full"]["kl"]) < 1e-5
    # eviction is visible: the local window disagrees somewhere and has a positive divergence
    assert summaries["local"]["top1"] < 1.0
    assert summaries["local"]["kl"] > 1e-3
    # the perplexity of the agreement stream is the plain perplexity
    assert summaries["full"]["perplexity"] == pytest.approx(teacher_forced_perplexity(model, _docs(task)), rel=1e-5)


def test_agreement_kl_matches_a_direct_computation(tok, books):
    """KL(full || local window) per position, computed here from two unmodified Mistrals (full and banded)."""
    full_model = tiny_mistral(len(tok), sliding_window=None)
    banded = tiny_mistral(len(tok), sliding_window=9)
    task = make_task("agreement", tok, data=books, n_docs=2, doc_tokens=30)
    summaries, _ = _evaluate(full_model, task, {"local": el.Policy(el.RecentWindow(), budget=8)}, batch_size=2)
    docs = _docs(task)[:, :-1]
    with torch.no_grad():
        p = torch.log_softmax(full_model(input_ids=docs).logits.float(), -1)
        q = torch.log_softmax(banded(input_ids=docs).logits.float(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    top1 = (p.argmax(-1) == q.argmax(-1)).float().mean()
    assert summaries["local"]["kl"] == pytest.approx(float(kl), rel=1e-4, abs=1e-7)
    assert summaries["local"]["top1"] == pytest.approx(float(top1))


# ---- generation tasks ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, options", [("passkey", {"lengths": [320], "depths": 3}),
                                           ("lines", {"n_prompts": 3, "n_lines": 3})])
def test_full_cache_generation_equals_unmodified_generate(model, tok, name, options):
    task = make_task(name, tok, max_new_tokens=6, **options)
    _, records = _evaluate(model, task, {"full": FULL}, batch_size=2)
    for record in records["full"]:
        text = task.rows()[record["index"]]["text"]
        inputs = tok(text, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert record["generated"] == tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _first_number(text: str) -> str | None:
    """The first run of digits, found without regular expressions."""
    start = next((i for i, c in enumerate(text) if c.isdigit()), None)
    if start is None:
        return None
    end = start
    while end < len(text) and text[end].isdigit():
        end += 1
    return text[start:end]


def test_generation_scores_count_correct_answers(model, tok):
    task = make_task("passkey", tok, lengths=[300], depths=2)
    summaries, records = _evaluate(model, task, {"full": FULL, "h2o": H2O}, batch_size=2)
    for label in ("full", "h2o"):
        expected = [_first_number(r["generated"]) == r["answer"] for r in records[label]]
        assert [r["correct"] for r in records[label]] == expected
        assert summaries[label]["correct"] == sum(expected)
    # a random model answers nothing right, so check the counting on records with known answers
    fake = [dict(records["full"][0], generated=g, answer="12345", depth=d)
            for g, d in (("12345.", 0.0), (" 12345 is", 0.0), ("1234", 1.0), ("x", 1.0))]
    assert [task.score(r["generated"], r) for r in fake] == [True, True, False, False]
    for record in fake:
        record["correct"] = task.score(record["generated"], record)
    summary = task.summarize(fake)
    assert (summary["correct"], summary["score"], summary["by_depth"]) == (2, 0.5, {"0.0": 1.0, "1.0": 0.0})


def test_lines_in_record_share(model, tok):
    task = make_task("lines", tok, n_prompts=2, n_lines=3)
    base = dict(task.rows()[0], correct=False, seconds=0.0, kv_bytes=0, retained_slots=1, full_slots=1,
                budget_tokens=None, histogram=[1], prompt_tokens=1, tokens=1)
    values = base["record_values"]
    records = [dict(base, generated=f"{values[0]}>"), dict(base, generated="99999999>")]
    assert task.summarize(records)["in_record"] == 0.5


# ---- memory metrics -----------------------------------------------------------------------------


def test_histogram_counts_equal_retained_slots(model, tok, books):
    doc_tokens, budget = 41, 12  # 40 tokens streamed
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    task = make_task("perplexity", tok, data=books, n_docs=2, doc_tokens=doc_tokens, n_bins=8)
    policies = {"full": FULL, "h2o": H2O.replace(budget=budget), "local": el.Policy(el.RecentWindow(), budget=budget)}
    summaries, records = _evaluate(model, task, policies, batch_size=2)
    n = doc_tokens - 1
    for record in records["h2o"] + records["local"]:
        assert sum(record["histogram"]) == budget * kv_heads * layers == record["retained_slots"]
        assert record["full_slots"] == n * kv_heads * layers
    for record in records["full"]:
        # every position is kept: bin b holds the positions p with floor(8 p / n) == b, in every head and layer
        expected = [sum(1 for p in range(n) if 8 * p // n == b) * kv_heads * layers for b in range(8)]
        assert record["histogram"] == expected
    for record in records["local"]:
        # the local window keeps positions n - budget .. n - 1 only
        first_bin = 8 * (n - budget) // n
        assert all(c == 0 for c in record["histogram"][:first_bin])
    assert summaries["h2o"]["kept_fraction"] == pytest.approx(budget / n)
    assert summaries["full"]["kept_fraction"] == 1.0
    # retained KV bytes: budget + 1 slots of K and V per head and layer, float32
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert summaries["local"]["kv_bytes"] == (budget + 1) * kv_heads * layers * 2 * head_dim * 4


# ---- scale-out ----------------------------------------------------------------------------------


def _comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("seconds", "tokens_per_s")}


def test_merge_drops_padding_duplicates():
    shards = [{"a": [{"index": 0, "x": 1}, {"index": 2, "x": 3}]}, {"a": [{"index": 1, "x": 2}, {"index": 0, "x": 1}]}]
    assert merge_records(shards) == {"a": [{"index": 0, "x": 1}, {"index": 1, "x": 2}, {"index": 2, "x": 3}]}


def test_ddp_on_two_processes_equals_one_process(model, tok, books):
    """Lightning DDP (CPU, devices=2) shards 3 documents 2 + 2 (one repeated by the sampler); the merged
    summary equals the single-process one."""
    policies = {"full": FULL, "h2o": H2O}
    task = make_task("agreement", tok, data=books, n_docs=3, doc_tokens=33)
    one, records_one = _evaluate(model, task, policies, batch_size=1, devices=1)
    two, records_two = _evaluate(model, task, policies, batch_size=1, devices=2)
    for label in policies:
        assert [r["index"] for r in records_two[label]] == [0, 1, 2]
        a, b = _comparable(one[label]), _comparable(two[label])
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
            else:
                assert b[key] == a[key], key


# ---- runner -------------------------------------------------------------------------------------


def test_replace_keeps_everything_but_the_changed_keys():
    scissorhands = resolve_recipe("scissorhands").policy
    new = scissorhands.replace(budget=0.5)
    assert new.budget == 0.5 and scissorhands.budget == 0.2  # a new policy; the original is unchanged
    assert new.modules_in_order == scissorhands.modules_in_order
    assert (new.drop, new.allocation, new.gqa_reduce, new.storage, new.positions) == (
        scissorhands.drop, scissorhands.allocation, scissorhands.gqa_reduce, scissorhands.storage, scissorhands.positions
    )
    rolling = scissorhands.replace(budget=64, positions="rolling")
    assert (rolling.budget, rolling.positions, rolling.drop) == (64, "rolling", 0.5)


def test_replace_refuses_unknown_keys_and_bad_values_naming_the_change():
    h2o = resolve_recipe("h2o").policy
    with pytest.raises(el.RecipeError, match=r"(?s)Policy.replace\(budgets=0.5\).*budgets: unknown key"):
        h2o.replace(budgets=0.5)
    with pytest.raises((el.RecipeError, ValueError), match="positions"):
        h2o.replace(positions="sideways")


def test_budget_that_cannot_hold_the_protections_is_refused():
    streaming = resolve_recipe("streaming_llm")
    with pytest.raises(ValueError, match=r"(?s)streaming_llm.*budget 3.*SinkTokens\(4\)"):
        expand_budgets([streaming], [3])


def test_full_recipe_runs_once_and_labels(model, tok):
    specs = [resolve_recipe("full"), resolve_recipe("h2o"), inline_spec("h2_only", {
        "budget": 0.2, "modules": [{"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Cumulative"}}]
    })]
    result = evaluate(model, tok, specs, "passkey", budgets=[0.2, 0.5], task_options={"lengths": [300], "depths": 1},
                      progress=False, threads=1)
    assert [r["label"] for r in result["runs"]] == ["full", "h2o@0.2", "h2o@0.5", "h2_only@0.2", "h2_only@0.5"]
    assert [r["budget"] for r in result["runs"]] == [None, 0.2, 0.5, 0.2, 0.5]
    assert result["runs"][0]["full_cache"] and not result["runs"][1]["full_cache"]
    halves = {r["label"]: r["kept_fraction"] for r in result["runs"]}
    assert halves["h2o@0.5"] > halves["h2o@0.2"]
    assert math.isclose(halves["full"], 1.0)


def test_unknown_task_and_option(tok):
    with pytest.raises(ValueError, match="unknown task 'nope'; available tasks: passkey, lines, perplexity, agreement"):
        make_task("nope", tok)
    with pytest.raises(ValueError, match=r"task 'passkey' has no option\(s\) \['n_docs'\]; its options: lengths"):
        make_task("passkey", tok, n_docs=3)


# ---- the embedded model -------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_full_cache_stream_on_pg19():
    """SmolLM2-135M on a PG-19 window: the streamed full cache is the one-pass perplexity, agrees
    everywhere, and H2O at 20% stays between the full cache and the local window."""
    from evictlayers.models import load_default

    model, tok = load_default()
    task = make_task("agreement", tok, n_docs=2, doc_tokens=161)
    summaries, _ = _evaluate(model, task, {"full": FULL, "h2o": H2O, "local": LOCAL}, batch_size=2)
    assert summaries["full"]["perplexity"] == pytest.approx(teacher_forced_perplexity(model, _docs(task)), rel=1e-4)
    assert summaries["full"]["top1"] == 1.0 and abs(summaries["full"]["kl"]) < 1e-4
    assert summaries["full"]["perplexity"] < summaries["h2o"]["perplexity"] < summaries["local"]["perplexity"]
