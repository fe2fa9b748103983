"""The ``ruler`` eval task on a tiny random Llama: both settings against the unmodified model's greedy
generation (full cache), what each setting compresses, the summary against RULER's formula, the
command line (errors and a full run) and the score-vs-compression plot."""

from __future__ import annotations

import json

import pytest
import torch

import evictlayers as el
from evictlayers.cli import main
from evictlayers.eval.module import PolicyEvaluator, run_test
from evictlayers.eval.ruler_report import compression_ratio, plot_ruler, score_of
from evictlayers.eval.ruler_run import generate_query_agnostic, generate_query_aware
from evictlayers.eval.suite import make_task
from evictlayers.eval.tasks.ruler import string_match_all
from test_eval_helpers import char_tokenizer, tiny_llama
from test_ruler_tasks import synthetic_books
from tiny_models import single_thread  # noqa: F401

LENGTH = 1800
TASKS = ["niah_single_1", "niah_multivalue", "vt", "cwe", "fwe"]
STEPS = 6
H2O = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.3)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok))


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return synthetic_books(tmp_path_factory.mktemp("ruler-eval-books"))


@pytest.fixture(scope="module")
def both(model, tok, books):
    """Every task once per setting, under the full cache and H2O at 30%."""
    task = make_task("ruler", tok, tasks=TASKS, lengths=[LENGTH], samples=1, data=books,
                     setting=["query_aware", "query_agnostic"], max_new_tokens=STEPS)
    summaries, records = run_test(PolicyEvaluator(model, task, {"full": el.load_recipe("full"), "h2o": H2O},
                                                  threads=1), batch_size=4, progress=False)
    return task, summaries, records


def _by_setting(records, setting):
    return {r["task"]: r for r in records if r["setting"] == setting}


def test_full_cache_settings_give_the_unmodified_models_greedy_tokens(model, tok, both):
    task, _, records = both
    aware, agnostic = _by_setting(records["full"], "query_aware"), _by_setting(records["full"], "query_agnostic")
    rows = {r["task"]: r for r in task.rows() if r["setting"] == "query_aware"}
    for name in TASKS:
        ids = torch.tensor([rows[name]["input_ids"]])
        with torch.no_grad():  # the reference: no evictlayers at all
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                                 do_sample=False)
        expected = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        assert aware[name]["generated"] == expected
        assert agnostic[name]["generated"] == expected
        assert aware[name]["tokens"] == agnostic[name]["tokens"] == ids.shape[1] + STEPS


def test_query_agnostic_compresses_the_context_before_the_question(both):
    """A fractional budget is a fraction of the first forward: the whole prompt when the question is in
    it, the context alone when the question comes after compression."""
    task, _, records = both
    aware, agnostic = _by_setting(records["h2o"], "query_aware"), _by_setting(records["h2o"], "query_agnostic")
    for name in TASKS:
        row = aware[name]
        assert 0 < row["n_context"] < row["n_tokens"]
        assert aware[name]["budget_tokens"] == int(0.3 * row["n_tokens"] + 0.5)
        assert agnostic[name]["budget_tokens"] == int(0.3 * row["n_context"] + 0.5)
        # the cache holds at most its budget in every layer and head after the question and the answer
        for r in (aware[name], agnostic[name]):
            heads = r["full_slots"] / r["seen_tokens"]  # layers x KV heads
            assert r["retained_slots"] <= r["budget_tokens"] * heads
    # eviction without the question changes what the model says somewhere
    assert any(aware[n]["generated"] != agnostic[n]["generated"] for n in TASKS)


def test_summary_is_rulers_score_per_task_and_setting(both):
    _, summaries, records = both
    for label in ("full", "h2o"):
        summary = summaries[label]
        cells = []
        for setting in ("query_aware", "query_agnostic"):
            for name in TASKS:
                rs = [r for r in records[label] if r["setting"] == setting and r["task"] == name]
                expected = string_match_all([r["generated"] for r in rs], [r["answers"] for r in rs])
                assert summary["scores"][setting][str(LENGTH)][name] == expected
                cells.append(expected)
        assert summary["score"] == pytest.approx(sum(cells) / len(cells))
        assert set(summary["by_group"]) == {"retrieval", "multi-hop tracing", "aggregation"}
        assert summary["by_task"]["cwe"] == pytest.approx(
            (summary["scores"]["query_aware"][str(LENGTH)]["cwe"] + summary["scores"]["query_agnostic"][str(LENGTH)]["cwe"]) / 2)


def test_task_options_are_checked(tok, books, model):
    with pytest.raises(ValueError, match=r"unknown RULER task\(s\) \['qa_2'\] \(qa_2: left out.*\(--ruler-tasks\); "
                                         r"allowed: niah_single_1"):
        make_task("ruler", tok, tasks=["qa_2"], data=books)
    with pytest.raises(ValueError, match=r"ruler setting \['both'\] \(--ruler-setting\): allowed: query_aware, "
                                         "query_agnostic"):
        make_task("ruler", tok, setting="both", data=books)
    task = make_task("ruler", tok, tasks=["vt"], lengths=[1000, 5000])
    with pytest.raises(ValueError, match=r"ruler lengths \[5000\] \(--lengths\) exceed what the model holds "
                                         r"\(max_position_embeddings = 4096\); allowed: lengths <= 4096"):
        task.check_model(model)


# ---- --prefill-chunk: the prompt in chunks -----------------------------------------------------------------

CHUNK = 256  # the 1800-token prompts go in 8 forwards, the last one shorter


def _prompt_forwards(model):
    """The tokens per row of every forward of the model while the context is open (a list filled as it runs)."""
    widths = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    return widths, hook


@pytest.fixture(scope="module")
def chunked(model, tok, books):
    """The runs of ``both``, each prompt fed ``CHUNK`` tokens at a time, and the widths of the forwards."""
    task = make_task("ruler", tok, tasks=TASKS, lengths=[LENGTH], samples=1, data=books,
                     setting=["query_aware", "query_agnostic"], max_new_tokens=STEPS, prefill_chunk=CHUNK)
    widths, hook = _prompt_forwards(model)
    try:
        summaries, records = run_test(PolicyEvaluator(model, task, {"full": el.load_recipe("full"), "h2o": H2O},
                                                      threads=1), batch_size=4, progress=False)
    finally:
        hook.remove()
    return task, summaries, records, widths


def test_prefill_chunk_feeds_the_prompts_in_chunks_and_full_cache_answers_do_not_change(both, chunked):
    one_shot = both[2]
    task, summaries, records, widths = chunked
    assert max(widths) == CHUNK and widths.count(CHUNK) > 2  # no prompt went in as one forward
    assert task.settings()["prefill_chunk"] == CHUNK
    assert summaries["full"]["prefill_chunk"] == summaries["h2o"]["prefill_chunk"] == CHUNK
    for setting in ("query_aware", "query_agnostic"):
        chunked_full, full = _by_setting(records["full"], setting), _by_setting(one_shot["full"], setting)
        for name in TASKS:
            assert chunked_full[name]["generated"] == full[name]["generated"], (setting, name)
            assert chunked_full[name]["retained_slots"] == full[name]["retained_slots"]
        # a fraction of the whole prompt (query-agnostic: of the whole context), not of a chunk
        chunked_h2o, h2o = _by_setting(records["h2o"], setting), _by_setting(one_shot["h2o"], setting)
        for name in TASKS:
            assert chunked_h2o[name]["budget_tokens"] == h2o[name]["budget_tokens"], (setting, name)
            assert chunked_h2o[name]["retained_slots"] == h2o[name]["retained_slots"], (setting, name)


@pytest.mark.parametrize("setting", ["query_aware", "query_agnostic"])
def test_prefill_chunk_holds_per_head_what_one_forward_holds(model, both, setting):
    """After the prompt (one generated token: no decode forward yet) every layer and KV head holds as many
    tokens as one forward of the prompt leaves, under a float budget, for a left-padded batch too."""
    task = both[0]
    rows = [r for r in task.rows() if r["setting"] == setting][:3]

    def held(prefill_chunk):
        widths, hook = _prompt_forwards(model)
        try:
            if setting == "query_aware":
                prompts = [r["input_ids"][: 1500 + 100 * i] for i, r in enumerate(rows)]  # left padding
                caches = [generate_query_aware(model, H2O, prompts, 1, 0, prefill_chunk=prefill_chunk)[1]]
            else:
                caches = [generate_query_agnostic(model, H2O, r["input_ids"], r["n_context"], 1, 0,
                                                  prefill_chunk=prefill_chunk)[1] for r in rows]
        finally:
            hook.remove()
        assert max(widths) <= prefill_chunk if prefill_chunk else max(widths) >= 1500  # else one forward
        return [layer.store.retained() for cache in caches for layer in cache.layers]

    one_shot = held(None)
    for chunk in (CHUNK, 999):
        for a, b in zip(held(chunk), one_shot, strict=True):
            assert torch.equal(a, b), chunk
    assert int(one_shot[0].max()) < 1500  # the budget bound: this is not a full cache


@pytest.mark.parametrize("name, options", [("passkey", dict(lengths=[600], depths=2)),
                                           ("lines", dict(n_prompts=2, n_lines=8))])
def test_prefill_chunk_reaches_passkey_and_lines(model, tok, name, options):
    def answers(prefill_chunk):
        task = make_task(name, tok, max_new_tokens=4, prefill_chunk=prefill_chunk, **options)
        widths, hook = _prompt_forwards(model)
        try:
            summaries, records = run_test(PolicyEvaluator(model, task, {"full": el.load_recipe("full")}, threads=1),
                                          batch_size=2, progress=False)
        finally:
            hook.remove()
        assert summaries["full"]["prefill_chunk"] == task.settings()["prefill_chunk"] == prefill_chunk
        return max(widths), [r["generated"] for r in records["full"]]

    widest, one_shot = answers(None)
    chunked_widest, chunked = answers(64)
    assert chunked_widest == 64 < widest and chunked == one_shot


def test_prefill_chunk_is_checked(tok, books):
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match=r"prefill_chunk \(--prefill-chunk\) must be a positive number of tokens"):
            make_task("ruler", tok, tasks=["vt"], prefill_chunk=bad)
    with pytest.raises(ValueError, match=r"prefill_chunk \(--prefill-chunk\)"):
        make_task("passkey", tok, prefill_chunk=0)
    with pytest.raises(ValueError, match=r"task 'perplexity' has no option\(s\) \['prefill_chunk'\]"):
        make_task("perplexity", tok, data=books, prefill_chunk=8)


# ---- command line ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("ruler-tiny-llama")
    tiny_llama(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--ruler-tasks", "niah_single_9"], "argument --ruler-tasks: invalid choice: niah_single_9 (choose from "
                                             "niah_single_1, niah_single_2"),
        (["--ruler-setting", "aware"], "argument --ruler-setting: invalid choice: aware (choose from query_aware, "
                                       "query_agnostic)"),
        (["--ruler-template", "llama"], "argument --ruler-template: invalid choice: llama (choose from auto, chat, base)"),
        (["--ruler-samples", "0"], "argument --ruler-samples: expected a positive integer, got 0"),
    ],
)
def test_cli_rejects_bad_ruler_options(capsys, extra, expected):
    err = _error(capsys, ["eval", "h2o", "--task", "ruler", "--out", "x", *extra])
    assert expected in err.replace("'", "")  # argparse quotes the choices from Python 3.12 on


def test_cli_ruler_options_belong_to_ruler(capsys):
    err = _error(capsys, ["eval", "h2o", "--task", "passkey", "--ruler-samples", "2", "--out", "x"])
    assert "--ruler-samples does not apply to --task passkey (it applies to: ruler)" in err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--lengths", "5000"], "ruler lengths [5000] (--lengths) exceed what the model holds (max_position_embeddings = 4096)"),
        (["--ruler-template", "chat"], "ruler template='chat' (--ruler-template chat) needs a tokenizer with a chat template"),
    ],
)
def test_cli_errors_that_need_the_model(capsys, checkpoint, books, extra, expected):
    err = _error(capsys, ["eval", "full", "--task", "ruler", "--ruler-tasks", "vt", "--model", str(checkpoint),
                          "--data-dir", str(books), "--out", "x", *extra])
    assert expected in err


def test_cli_run_writes_json_table_and_plot(capsys, checkpoint, books, tmp_path):
    out = tmp_path / "out"
    code = main(["eval", "full", "local", "--task", "ruler", "--ruler-tasks", "niah_single_1", "fwe",
                 "--lengths", "1200", "--ruler-samples", "1", "--ruler-setting", "query_aware", "query_agnostic",
                 "--max-new-tokens", "3", "--budget", "0.2", "0.5", "--model", str(checkpoint), "--data-dir",
                 str(books), "--out", str(out), "--no-progress", "--threads", "1"])
    assert code == 0
    result = json.loads((out / "ruler.json").read_text())
    assert result["settings"]["tasks"] == ["niah_single_1", "fwe"] and result["n_examples"] == 4
    assert [r["label"] for r in result["runs"]] == ["full", "local@0.2", "local@0.5"]
    table = (out / "ruler.md").read_text()
    assert "| policy | budget | setting | length | niah_single_1 | fwe | average |" in table
    assert table.count("| local | 20% | agnostic | 1200 |") == 1
    printed = capsys.readouterr().out
    assert "| full | full | aware | 1200 |" in printed
    pytest.importorskip("matplotlib")
    assert (out / "ruler_score_vs_compression.png").stat().st_size > 0


@pytest.mark.parametrize(
    "task, extra, expected",
    [
        ("ruler", ["--prefill-chunk", "0"], "argument --prefill-chunk: expected a positive integer, got 0"),
        ("passkey", ["--prefill-chunk", "1.5"], "argument --prefill-chunk: expected a positive integer, got '1.5'"),
        ("perplexity", ["--prefill-chunk", "512"], "--prefill-chunk does not apply to --task perplexity (it applies "
                                                   "to: passkey, lines, ruler); --task perplexity has its own --chunk"),
        ("agreement", ["--prefill-chunk", "512"], "--prefill-chunk does not apply to --task agreement (it applies "
                                                  "to: passkey, lines, ruler); --task agreement has its own --chunk"),
    ],
)
def test_cli_rejects_a_bad_prefill_chunk(capsys, task, extra, expected):
    assert expected in _error(capsys, ["eval", "h2o", "--task", task, "--out", "x", *extra])


def test_cli_records_the_prefill_chunk(capsys, checkpoint, books, tmp_path):
    """The results tell a chunked run from a one-shot one: the settings, every run and a table column."""
    common = ["eval", "full", "h2o", "--task", "ruler", "--ruler-tasks", "niah_single_1", "--lengths", "1200", "--ruler-samples",
              "1", "--max-new-tokens", "3", "--budget", "0.3", "--model", str(checkpoint), "--data-dir", str(books),
              "--no-progress", "--threads", "1"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--prefill-chunk", "500", "--out", str(tmp_path / "chunked")]) == 0
    one, chunked = (json.loads((tmp_path / d / "ruler.json").read_text()) for d in ("one", "chunked"))
    assert one["settings"]["prefill_chunk"] is None and chunked["settings"]["prefill_chunk"] == 500
    assert [r["prefill_chunk"] for r in one["runs"]] == [None, None]
    assert [r["prefill_chunk"] for r in chunked["runs"]] == [500, 500]
    assert [r["budget_tokens"] for r in chunked["runs"]] == [r["budget_tokens"] for r in one["runs"]]
    table = (tmp_path / "chunked" / "ruler.md").read_text()
    assert "prefill_chunk=500" in table
    assert "| policy | budget | prefill | setting | length | niah_single_1 | average |" in table
    assert "| h2o | 30% | 500-token chunks | aware | 1200 |" in table
    assert "prefill" not in (tmp_path / "one" / "ruler.md").read_text().split("\n\n", 2)[2]  # no column


# ---- the plot's numbers ------------------------------------------------------------------------------------


def _run(policy, budget, scores, kept=1.0):
    return {"policy": policy, "budget": budget, "full_cache": budget is None, "kept_fraction": kept,
            "scores": {"query_aware": {"1000": scores}}}


def test_compression_ratio_and_group_scores():
    full = _run("full", None, {"vt": 80.0, "cwe": 40.0, "fwe": 60.0})
    h2o = _run("h2o", 0.2, {"vt": 10.0, "cwe": 20.0, "fwe": 30.0})
    tokens = _run("local", 64, {"vt": 0.0}, kept=0.25)
    assert [compression_ratio(r) for r in (full, h2o, tokens)] == [0.0, pytest.approx(0.8), 0.75]
    assert score_of(h2o, "query_aware") == 20.0
    assert score_of(h2o, "query_aware", ("cwe", "fwe")) == 25.0
    assert score_of(h2o, "query_agnostic") is None
    pytest.importorskip("matplotlib")


def test_plot_has_a_panel_row_per_model(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        {"model": name, "settings": {"tasks": ["vt", "cwe"], "setting": ["query_aware"]},
         "runs": [_run("full", None, {"vt": 90.0, "cwe": 50.0}), _run("h2o", 0.2, {"vt": 10.0, "cwe": 20.0}),
                  _run("h2o", 0.5, {"vt": 40.0, "cwe": 30.0})]}
        for name in ("smollm2", "gemma")
    ]
    path = plot_ruler(results, tmp_path / "plot.png")
    assert path.stat().st_size > 0


def test_a_reconstruction_policy_compresses_each_prompt_first_in_both_settings(model, tok, books):
    """KVzip's recipe cannot fill a cache through generate() alone: each setting compresses the prompt (query-aware:
    all but its last token) or the context (query-agnostic) with run.compress_context first. With nothing evicted
    that is the unmodified model's answer; under a budget every head holds at most it."""
    task = make_task("ruler", tok, tasks=["niah_single_1", "vt"], lengths=[LENGTH], samples=1, data=books,
                     setting=["query_aware", "query_agnostic"], max_new_tokens=STEPS)
    policies = {"full": el.load_recipe("full"), "kvzip-all": el.load_recipe("kvzip").replace(budget=None),
                "kvzip": el.load_recipe("kvzip").replace(budget=0.3)}
    _, records = run_test(PolicyEvaluator(model, task, policies, threads=1), batch_size=4, progress=False)
    for setting in ("query_aware", "query_agnostic"):
        full, kept = _by_setting(records["full"], setting), _by_setting(records["kvzip-all"], setting)
        assert {name: r["generated"] for name, r in kept.items()} == {name: r["generated"] for name, r in full.items()}
        for r in _by_setting(records["kvzip"], setting).values():
            heads = r["full_slots"] / r["seen_tokens"]
            assert r["retained_slots"] <= r["budget_tokens"] * heads < r["full_slots"]
