"""The ``evictlayers`` command: clear errors for bad input, and a full eval / generate run on a tiny
checkpoint saved to disk (the real model only in the slow test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from evictlayers.cli import main
from test_eval_helpers import char_tokenizer, teacher_forced_perplexity, tiny_llama
from tiny_models import single_thread  # noqa: F401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and its character tokenizer, saved like any local checkpoint."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = char_tokenizer()
    tiny_llama(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    root = tmp_path_factory.mktemp("books")
    (root / "a.txt").write_text("It was the best of times, it was the worst of times. " * 20)
    (root / "b.txt").write_text("Call me Ishmael. Some years ago, never mind how long. " * 20)
    return root


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["eval", "h2o", "--task", "summaries", "--out", "x"],
         "argument --task: invalid choice: 'summaries'"),
        (["eval", "nothere", "--task", "passkey", "--out", "x"],
         "recipe 'nothere' not found"),
        (["eval", "h2o", "--task", "passkey", "--budget", "1.5", "--out", "x"],
         "bad budget '1.5': a fractional budget must be in (0, 1]"),
        (["eval", "h2o", "--task", "passkey", "--budget", "0", "--out", "x"],
         "bad budget '0': a token budget must be >= 1"),
        (["eval", "h2o", "--task", "passkey", "--budget", "lots", "--out", "x"],
         "bad budget 'lots': not a number"),
        (["eval", "streaming_llm", "--task", "passkey", "--budget", "3", "--out", "x"],
         "recipe 'streaming_llm'"),
        (["eval", "h2o", "--task", "passkey", "--n-docs", "3", "--out", "x"],
         "--n-docs does not apply to --task passkey (it applies to: perplexity, agreement)"),
        (["eval", "h2o", "--task", "perplexity", "--data-dir", "/no/such/dir", "--out", "x"],
         "document directory /no/such/dir does not exist; set $EVICTLAYERS_DATA or pass --data-dir"),
        (["eval", "/no/such/recipe.yaml", "--task", "passkey", "--out", "x"],
         "recipe '/no/such/recipe.yaml' not found"),
        (["generate", "h2o", "hi", "--budget", "-1"], "bad budget '-1'"),
        (["eval", "h2o", "--task", "lines", "--haystack", "prose", "--out", "x"],
         "--haystack does not apply to --task lines (it applies to: passkey)"),
        (["claims", "--only", "retrieval,stream", "--render-only"],
         "unknown experiment(s) ['retrieval']; the experiments are stream, passkey, lines, retrieval_filler"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, expected):
    err = _error(capsys, argv)
    assert expected in err
    assert err.startswith("usage: evictlayers")


def test_unknown_recipe_lists_the_available_ones(capsys):
    err = _error(capsys, ["eval", "nothere", "--task", "passkey", "--out", "x"])
    for name in ("full", "h2o", "local", "streaming_llm"):
        assert name in err


def test_bad_recipe_file_names_the_file_and_key(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("budget: 0.2\nmodules:\n  - _component_: NoSuchThing\n")
    err = _error(capsys, ["eval", str(bad), "--task", "passkey", "--out", str(tmp_path)])
    assert str(bad) in err and "modules[0]._component_" in err and "NoSuchThing" in err


def test_missing_model_directory(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "h2o", "hi", "--model", str(tmp_path / "no-model")])
    assert "no-model" in str(exit_info.value) and "no such directory" in str(exit_info.value)


def test_eval_writes_json_table_and_plots(capsys, checkpoint, books, tmp_path):
    out = tmp_path / "out"
    code = main(["eval", "full", "h2o", "local", "--task", "agreement", "--budget", "0.2", "0.5",
                 "--model", str(checkpoint), "--out", str(out), "--data-dir", str(books), "--n-docs", "2",
                 "--doc-tokens", "65", "--no-progress", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "agreement.json").read_text())
    assert [r["label"] for r in result["runs"]] == ["full", "h2o@0.2", "h2o@0.5", "local@0.2", "local@0.5"]
    full = result["runs"][0]
    assert full["top1"] == 1.0 and abs(full["kl"]) < 1e-5
    assert result["runs"][1]["kept_fraction"] < result["runs"][2]["kept_fraction"] < 1.0
    table = (out / "agreement.md").read_text()
    assert "| h2o | 20% |" in table and "| local | 50% |" in table
    assert "| h2o | 20% |" in printed
    for plot in ("agreement_score_vs_budget.png", "agreement_positions.png"):
        data = (out / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_eval_full_cache_perplexity_matches_unmodified_model(checkpoint, books, tmp_path, capsys, compiled):
    out = tmp_path / "out"
    main(["eval", "full", "--task", "perplexity", "--model", str(checkpoint), "--out", str(out),
          "--data-dir", str(books), "--n-docs", "2", "--doc-tokens", "50", "--start", "0", "--no-progress",
          *(["--compile"] if compiled else [])])
    capsys.readouterr()
    result = json.loads((out / "perplexity.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tok = char_tokenizer()
    docs = torch.tensor([tok.encode((books / name).read_text(), add_special_tokens=False)[:50]
                         for name in ("a.txt", "b.txt")])
    assert result["runs"][0]["perplexity"] == pytest.approx(teacher_forced_perplexity(model, docs), rel=1e-5)


def test_needles_dump_matches_what_a_recent_window_keeps(checkpoint, tmp_path, capsys):
    """``local`` at 50% keeps the last half of each prompt: a head holds exactly the key tokens there."""
    from evictlayers.eval.needles import key_token_indices

    out = tmp_path / "needles"
    main(["needles", "full", "local", "--budget", "0.5", "--haystack", "filler", "--length", "300", "--depths", "3",
          "--model", str(checkpoint), "--out", str(out)])
    payload = json.loads((out / "needles.json").read_text())
    assert "| full | " in (out / "needles.md").read_text()
    assert payload["summary"]["full"]["whole"] == 1.0
    tokenizer = char_tokenizer()
    from evictlayers.eval.suite import PasskeyTask

    rows = PasskeyTask(tokenizer, lengths=[300], depths=3).build_rows()
    for row, record in zip(rows, payload["records"]["local"]):
        n = record["prompt_tokens"]
        kept_from = n - (n + 1) // 2  # budget round_half_up(0.5 n) of the most recent tokens
        expected = sum(i >= kept_from for i in key_token_indices(tokenizer, row["text"], row["answer"]))
        assert all(count == expected for layer in record["held"] for count in layer), (record, expected)
    depths = [r["depth"] for r in payload["records"]["local"]]
    assert depths == [0.0, 0.5, 1.0]


def test_generate_prints_text_and_cache_stats(checkpoint, capsys):
    assert main(["generate", "h2o", "The pass key is 12345. " * 10, "--model", str(checkpoint),
                 "--max-new-tokens", "5", "--budget", "16"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip("\n")) >= 1
    assert "cache keeps 16 of" in captured.err and "5 generated" in captured.err


@pytest.mark.parametrize("module", ["evictlayers.cli", "evictlayers"])
def test_console_script_is_installed(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "{eval,generate,claims,needles}" in done.stdout


@pytest.mark.slow
def test_generate_on_the_embedded_model(capsys):
    assert main(["generate", "h2o", "The capital of France is", "--max-new-tokens", "4", "--budget", "0.5"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
