"""The benchmark suite in ``--quick`` mode: it runs end to end on a tiny random Llama, writes the results
files where ``--out`` says, and every ratio is the row's value over the same run's baseline row.

Compiled configurations are left out (``--no-compile``): compiling takes ~10 s per graph here, and
tests/test_compile.py covers the compiled decode step.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from tiny_models import single_thread  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ sits beside the package, not inside it

from benchmarks import report  # noqa: E402
from benchmarks.suite import FAMILIES, main  # noqa: E402

METRIC_KEYS = {"value", "samples", "unit", "higher_is_better", "baseline", "ratio"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    returned = main(["--quick", "--no-compile", "--threads", "1", "--out", str(out)])
    return out, returned


def test_quick_run_writes_json_and_markdown_for_this_machine(quick_run):
    out, returned = quick_run
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"{returned['machine']}.json", f"{returned['machine']}.md"]
    written = json.loads((out / f"{returned['machine']}.json").read_text())
    assert written == json.loads(json.dumps(returned))
    assert written["schema"] == report.SCHEMA
    for key in ("date", "torch", "transformers", "threads", "cpu_count"):
        assert key in written["env"]
    assert written["env"]["threads"] == 1
    markdown = (out / f"{returned['machine']}.md").read_text()
    for name in FAMILIES:
        assert f"## {name}" in markdown


def test_every_benchmark_ran_or_says_why_not(quick_run):
    results = quick_run[1]["benchmarks"]
    assert set(results) == set(FAMILIES)
    for name, result in results.items():
        assert result["quick"] is True
        if result["status"] == "skipped":
            assert name == "kernel" and result["reason"]  # CUDA only
            continue
        assert result["status"] == "ok" and result["rows"], name
        for row in result["rows"]:
            assert row["status"] in ("ok", "skipped"), row  # an "error" row means a case raised
            if row["status"] == "skipped":
                assert row["config"].endswith("-compiled") and row["reason"] == "--no-compile"


def test_rows_follow_the_schema(quick_run):
    for result in quick_run[1]["benchmarks"].values():
        for row in result.get("rows", []):
            assert {"config", "params", "status", "metrics", "info"} <= set(row)
            assert all(isinstance(v, int) for v in row["params"].values())
            for m in row["metrics"].values():
                assert set(m) == METRIC_KEYS
                assert m["value"] == statistics.median(m["samples"])
                assert m["value"] > 0


def test_ratios_are_against_the_baseline_of_the_same_run(quick_run):
    checked = 0
    for result in quick_run[1]["benchmarks"].values():
        rows = result.get("rows", [])
        for row in rows:
            for name, m in row["metrics"].items():
                (base,) = [r for r in rows if r["config"] == m["baseline"] and r["params"] == row["params"]]
                assert m["ratio"] == pytest.approx(m["value"] / base["metrics"][name]["value"])
                if row is base:
                    assert m["ratio"] == 1.0
                checked += 1
    assert checked >= 30


def test_decode_reports_the_ideal_ratio_from_bytes_read(quick_run):
    rows = quick_run[1]["benchmarks"]["decode"]["rows"]
    by_key = {(r["config"], r["params"]["prompt"], r["params"]["batch"]): r for r in rows}
    for (config, prompt, batch), r in by_key.items():
        if r["status"] != "ok":
            continue
        base = by_key[("hf-eager", prompt, batch)]
        assert r["info"]["ideal_ratio"] == pytest.approx(base["info"]["step_mib"] / r["info"]["step_mib"])
    # H2O at 20% holds a fifth of the tokens, so it reads fewer bytes per step than the full cache
    for prompt, batch in {(p, b) for _, p, b in by_key}:
        h2o, hf = by_key[("el-h2o", prompt, batch)]["info"], by_key[("hf-eager", prompt, batch)]["info"]
        assert h2o["ideal_ratio"] > 1 and h2o["kv_mib"] < hf["kv_mib"]


def test_memory_matches_the_formula_for_bounded_caches(quick_run):
    for r in quick_run[1]["benchmarks"]["memory"]["rows"]:
        if r["config"] in ("hf", "el-h2o"):
            assert r["info"]["kv_bytes"] == r["info"]["formula_bytes"], r
        else:  # the full slot store grows in steps, so it may hold more than it has seen
            assert r["info"]["kv_bytes"] >= r["info"]["formula_bytes"]


def test_quick_runs_write_nothing_without_out(tmp_path, monkeypatch):
    from benchmarks import common, suite

    monkeypatch.setattr(suite, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    main(["--quick", "--no-compile", "--threads", "1", "--only", "memory"])
    assert not (tmp_path / "results").exists()
