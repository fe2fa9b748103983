"""The research commands (``python -m research.claims`` / ``needles`` / ``transfer``): each answers
``--help`` from the repository root, refuses bad input with argparse's error, and ``needles`` writes
the dump it prints, on a tiny checkpoint saved to disk."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evictlayers.eval.suite import PasskeyTask
from research.claims.__main__ import main as claims_main
from research.needles import main as needles_main
from research.passkey_needles import key_token_indices
from test_eval_helpers import char_tokenizer, save_tiny_checkpoint
from tiny_models import single_thread  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and its character tokenizer, saved like any local checkpoint."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in ``text``."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]


@pytest.mark.parametrize("command", ["claims", "needles", "transfer"])
def test_each_command_answers_help_from_the_repository_root(command):
    done = subprocess.run([sys.executable, "-m", f"research.{command}", "--help"], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m research.{command}")


def test_claims_names_the_experiments_when_one_is_unknown(capsys):
    with pytest.raises(SystemExit) as exit_info:
        claims_main(["--only", "retrieval,stream", "--render-only"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m research.claims")
    assert "unknown experiment(s) ['retrieval']; the experiments are stream, passkey, lines, retrieval_filler" in err


def test_needles_dump_matches_what_a_recent_window_keeps(checkpoint, tmp_path, capsys):
    """``local`` at 50% keeps the last half of each prompt: a head holds exactly the key tokens there."""
    out = tmp_path / "needles"
    needles_main(["full", "local", "--budget", "0.5", "--haystack", "filler", "--length", "300", "--depths", "3",
          "--model", str(checkpoint), "--out", str(out)])
    printed = capsys.readouterr().out
    payload = json.loads((out / "needles.json").read_text())
    assert payload["command"].startswith("python -m research.needles full local --budget 0.5")
    assert payload["summary"]["full"]["whole"] == 1.0
    tokenizer = char_tokenizer()
    rows = PasskeyTask(tokenizer, lengths=[300], depths=3).build_rows()
    whole = []
    for row, record in zip(rows, payload["records"]["local"], strict=True):
        n = record["prompt_tokens"]
        kept_from = n - (n + 1) // 2  # budget round_half_up(0.5 n) of the most recent tokens
        key = key_token_indices(tokenizer, row["text"], row["answer"])
        expected = sum(i >= kept_from for i in key)
        assert all(count == expected for layer in record["held"] for count in layer), (record, expected)
        whole.append(expected == len(key))
    depths = [r["depth"] for r in payload["records"]["local"]]
    assert depths == [0.0, 0.5, 1.0]
    # printed: the heading from the arguments, a summary row per recipe (the full cache holds every key
    # token in every head; local holds the whole key where it lies in the last half), the files written
    lines = printed.splitlines()
    assert lines[0] == "# Per-head needle dump (filler haystack, 3 prompts of ~300 tokens, budget 0.5)"
    summary = {row[0]: row for row in _table_rows(printed)[2:]}
    assert list(summary) == ["full", "local"]
    assert summary["full"][2:5] == ["100%", "0%", "0%"]
    whole_share = sum(whole) / len(whole)
    assert summary["local"][2] == f"{100 * whole_share:.0f}%"
    for name in ("full", "local"):
        assert re.fullmatch(r"\d/3", summary[name][1]), summary[name]
    assert lines[-1] == f"wrote {out / 'needles.json'}, {out / 'needles.md'}"
    assert _table_rows((out / "needles.md").read_text())[: len(summary) + 2] == _table_rows(printed)[: len(summary) + 2]
