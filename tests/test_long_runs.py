"""The long-run benchmark entries in their small modes: ``benchmarks.long_stream --quick``
(5 context windows of a tiny random Llama whose context is 128) and ``benchmarks.soak`` (a few hundred
steps). Each writes its files and reports a bounded cache; the KV bytes are checked against the formula
``layers * 2 * H_kv * slots * head_dim * 4`` (float32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tiny_models import single_thread  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ sits beside the package, not inside it

from benchmarks import long_stream, soak  # noqa: E402
from benchmarks.common import tiny_llama  # noqa: E402

_CONFIG = tiny_llama().config  # the model both benchmarks run with --quick


def _kv_bytes(slots: int) -> int:
    return _CONFIG.num_hidden_layers * 2 * _CONFIG.num_key_value_heads * slots * _CONFIG.head_dim * 4


def test_long_stream_quick_writes_results_and_holds_the_budget(tmp_path):
    payload = long_stream.main(["--quick", "--threads", "1", "--out", str(tmp_path)])
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"long_stream-quick.{suffix}").stat().st_size > 0
    assert json.loads((tmp_path / "long_stream-quick.json").read_text())["settings"]["tokens"] == 5 * 128
    rows = {r["config"]: r for r in payload["results"]}
    assert set(rows) == {"hf", "hf-windows", *(f"el-{n}-{p}" for n in ("streaming_llm", "h2o") for p in ("rolling", "absolute"))}
    budget = payload["settings"]["budget"]
    assert rows["hf"]["kv_bytes"] == _kv_bytes(5 * 128)  # every token streamed
    assert rows["hf-windows"]["kv_bytes"] == _kv_bytes(128)  # a fresh cache per window
    assert rows["hf-windows"]["per_window_vs_hf_windows"] is None  # it is the reference
    for name, row in rows.items():
        assert len(row["perplexity_per_window"]) == 5
        if name != "hf-windows":
            assert len(row["per_window_vs_hf_windows"]) == 5
        if name.startswith("el-"):
            assert row["kv_bytes"] == _kv_bytes(budget + 1)  # the budget plus the spare slot


def test_soak_records_every_block_within_budget(tmp_path):
    payload = soak.main(["--steps", "200", "--every", "50", "--recipes", "h2o", "--out", str(tmp_path)])
    assert (tmp_path / "soak.md").read_text().startswith("# Soak")
    assert [r["config"] for r in payload["results"]] == ["el-h2o-absolute", "el-h2o-rolling"]
    for row in payload["results"]:
        assert [b["step"] for b in row["blocks"]] == [50, 100, 150, 200]
        assert row["all_finite"] and row["max_retained"] == 24
