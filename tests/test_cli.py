"""The ``evictlayers`` command: clear errors for bad input, and a full eval / generate run on a tiny
checkpoint saved to disk (the real model only in the slow test)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from evictlayers.cli import main
from test_eval_helpers import char_tokenizer, save_tiny_checkpoint, teacher_forced_perplexity
from tiny_models import single_thread  # noqa: F401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and its character tokenizer, saved like any local checkpoint."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


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
        (["eval", "h2o", "--task", "passkey", "--compile", "fast", "--out", "x"],
         "argument --compile: invalid choice: 'fast' (choose from 'max-autotune')"),
        (["claims"], "argument {eval,generate}: invalid choice: 'claims' (choose from 'eval', 'generate')"),
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


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in ``text``."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]


def test_eval_writes_json_table_and_plots(capsys, checkpoint, books, tmp_path):
    out = tmp_path / "out"
    code = main(["eval", "full", "h2o", "local", "--task", "agreement", "--budget", "0.2", "0.5",
                 "--model", str(checkpoint), "--out", str(out), "--data-dir", str(books), "--n-docs", "2",
                 "--doc-tokens", "65", "--no-progress", "--threads", "1", "--min-budget", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "agreement.json").read_text())
    assert [r["label"] for r in result["runs"]] == ["full", "h2o@0.2", "h2o@0.5", "local@0.2", "local@0.5"]
    full = result["runs"][0]
    assert full["top1"] == 1.0 and abs(full["kl"]) < 1e-5
    # 65-token documents stream 64 tokens; a budget is round_half_up(fraction * 64) tokens per head, with no floor
    kept = {0.2: 13 / 64, 0.5: 32 / 64}
    for run in result["runs"][1:]:
        assert run["kept_fraction"] == kept[run["budget"]], run["label"]
    # the printed table: one row per recipe and budget, in the order given; the full cache agrees with
    # itself and keeps every slot; the budgets keep the fraction above
    rows = _table_rows(printed)
    assert rows[0][:6] == ["policy", "budget", "top-1 agreement", "KL (nats)", "perplexity", "KV kept"]
    assert [row[:2] for row in rows[2:]] == [
        ["full", "full"], ["h2o", "20%"], ["h2o", "50%"], ["local", "20%"], ["local", "50%"]
    ]
    assert rows[2][2:4] == ["1.000", "0.0000"] and rows[2][5] == "100.0%"
    assert [row[5] for row in rows[3:]] == ["20.3%", "50.0%", "20.3%", "50.0%"]
    table = (out / "agreement.md").read_text()
    assert _table_rows(table) == rows  # the file holds the table printed
    files = ["agreement.json", "agreement.md", "agreement_score_vs_budget.png", "agreement_positions.png"]
    assert printed.rstrip("\n").splitlines()[-1] == "wrote " + ", ".join(str(out / name) for name in files)
    for plot in files[2:]:
        data = (out / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("compiled", [[], ["--compile"], ["--compile", "max-autotune"]],
                         ids=["eager", "compiled", "max-autotune"])
def test_eval_full_cache_perplexity_matches_unmodified_model(checkpoint, books, tmp_path, capsys, compiled):
    out = tmp_path / "out"
    main(["eval", "full", "--task", "perplexity", "--model", str(checkpoint), "--out", str(out),
          "--data-dir", str(books), "--n-docs", "2", "--doc-tokens", "50", "--start", "0", "--no-progress",
          *compiled])
    capsys.readouterr()
    result = json.loads((out / "perplexity.json").read_text())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tok = char_tokenizer()
    docs = torch.tensor([tok.encode((books / name).read_text(), add_special_tokens=False)[:50]
                         for name in ("a.txt", "b.txt")])
    assert result["runs"][0]["perplexity"] == pytest.approx(teacher_forced_perplexity(model, docs), rel=1e-5)


PROMPT = "The pass key is 12345. " * 10
NEW_TOKENS = 5


def _greedy_reference(model, ids: torch.Tensor, new_tokens: int, window: int | None = None) -> list[int]:
    """Greedy tokens of the unmodified model, recomputing the whole sequence every step with an explicit
    attention mask and no cache: causal over the prompt; with ``window``, a generated token's query sees
    only itself and the ``window`` tokens before it (what a local window of ``window`` tokens per head
    leaves after the prompt was attended in full)."""
    prompt = ids.shape[1]
    for _ in range(new_tokens):
        n = ids.shape[1]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = j <= i
        if window is not None:
            allowed &= (i < prompt) | (j >= i - window)
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt:].tolist()


@pytest.mark.parametrize(
    "recipe, budget, described, window",
    [
        ("full", None, "budget=None (full cache)", None),
        ("local", 16, "budget=16 tokens per head", 16),
        # a budget above the whole sequence: nothing is evicted, the unmodified model's text
        ("h2o", 400, "budget=400 tokens per head", None),
    ],
    ids=["full", "local-16", "h2o-above-the-sequence"],
)
def test_generate_prints_the_greedy_text_and_cache_stats(checkpoint, capsys, recipe, budget, described, window):
    from transformers import AutoModelForCausalLM

    assert main(["generate", recipe, PROMPT, "--model", str(checkpoint), "--max-new-tokens", str(NEW_TOKENS),
                 *(["--budget", str(budget)] if budget else [])]) == 0
    captured = capsys.readouterr()
    tokenizer = char_tokenizer()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    reference = tokenizer.decode(_greedy_reference(model, ids, NEW_TOKENS, window), skip_special_tokens=True)
    assert captured.out == reference + "\n"
    prompt = ids.shape[1]
    seen = prompt + NEW_TOKENS - 1  # the last generated token is never fed back
    kept = seen if window is None else window
    assert re.search(
        rf"^\[{recipe}, {re.escape(described)}, drop=1, gqa_reduce='sum'\] prompt {prompt} tokens, "
        rf"{NEW_TOKENS} generated in [\d.]+ s; cache keeps {kept} of {seen} tokens per head \([\d.]+ MiB\)$",
        captured.err, flags=re.MULTILINE,
    ), captured.err


def test_generate_under_eviction_prints_the_budget_it_keeps(checkpoint, capsys):
    """H2O at 16 tokens per head: every layer holds 16 tokens of the sequence, 2 layers x (k, v) x 2 KV heads
    x 17 slots (the budget and the spare slot) x 8 channels in float32 = 4352 bytes."""
    assert main(["generate", "h2o", PROMPT, "--model", str(checkpoint), "--max-new-tokens", str(NEW_TOKENS),
                 "--budget", "16"]) == 0
    captured = capsys.readouterr()
    prompt = len(char_tokenizer()(PROMPT).input_ids)
    assert len(char_tokenizer()(captured.out.rstrip("\n")).input_ids) <= NEW_TOKENS  # special tokens are skipped
    assert re.search(
        rf"^\[h2o, budget=16 tokens per head, drop=1, gqa_reduce='sum'\] prompt {prompt} tokens, "
        rf"{NEW_TOKENS} generated in [\d.]+ s; cache keeps 16 of {prompt + NEW_TOKENS - 1} tokens per head "
        rf"\({4352 / 2**20:.2f} MiB\)$",
        captured.err, flags=re.MULTILINE,
    ), captured.err


@pytest.mark.parametrize("module", ["evictlayers.cli", "evictlayers"])
def test_console_script_is_installed(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "{eval,generate}" in done.stdout


@pytest.mark.slow
def test_generate_on_the_embedded_model(capsys):
    assert main(["generate", "h2o", "The capital of France is", "--max-new-tokens", "4", "--budget", "0.5"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
