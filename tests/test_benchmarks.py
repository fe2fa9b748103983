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
import torch

from tiny_models import single_thread  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ sits beside the package, not inside it

from benchmarks import report  # noqa: E402
from benchmarks.suite import FAMILIES, machine_slug, main  # noqa: E402

METRIC_KEYS = {"value", "samples", "unit", "higher_is_better", "baseline", "ratio"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    returned = main(["--quick", "--no-compile", "--threads", "1", "--out", str(out)])
    return out, returned


def test_quick_run_writes_json_and_markdown_for_this_machine(quick_run):
    out, returned = quick_run
    files = sorted(p.name for p in out.iterdir())
    machine = returned["machine"]
    # gpu_decode has a file of its own, beside the kernel results
    assert files == sorted([f"{machine}.json", f"{machine}.md", f"{machine}-e2e.json", f"{machine}-e2e.md"])
    written = json.loads((out / f"{machine}.json").read_text())
    shared = {name: r for name, r in returned["benchmarks"].items() if name != "gpu_decode"}
    assert written == json.loads(json.dumps({**returned, "benchmarks": shared}))
    assert written["schema"] == report.SCHEMA
    for key in ("date", "torch", "transformers", "threads", "cpu_count"):
        assert key in written["env"]
    assert written["env"]["threads"] == 1
    markdown = (out / f"{machine}.md").read_text()
    for name in shared:
        assert f"## {name}" in markdown
    e2e = json.loads((out / f"{machine}-e2e.json").read_text())
    assert e2e["machine"] == f"{machine}-e2e" and list(e2e["benchmarks"]) == ["gpu_decode"]


def legitimately_skipped(row: dict) -> bool:
    """Whether a skipped row says a reason that holds here: ``--no-compile`` for a compiled configuration, or, for a
    row of the C++ weight-product op (``+cpu_linear``; cpu_linear's ``-bf16`` rows), that the instruction-set level
    (``evictlayers/kernels/cpu_extension.py``) is below the one its loops need."""
    from evictlayers.kernels.cpu_extension import at_least, describe_level

    config, reason = row["config"], row["reason"]
    if reason == "--no-compile":
        return "-compiled" in config  # el-h2o-compiled, el-h2o-compiled+cpu_linear
    needs = "avx512_bf16" if config.endswith("-bf16") else "avx512" if config.endswith("+cpu_linear") else None
    return (needs is not None and not at_least(needs) and f"only at the {needs} instruction-set level" in reason
            and reason.endswith(f"this run's: {describe_level()}"))


def test_every_benchmark_ran_or_says_why_not(quick_run):
    from evictlayers.kernels.cpu_extension import at_least, describe_level

    results = quick_run[1]["benchmarks"]
    assert set(results) == set(FAMILIES)
    for name, result in results.items():
        assert result["quick"] is True
        if result["status"] == "skipped":
            if name == "cpu_linear":  # the op has loops from avx512 up
                assert not at_least("avx512") and result["reason"].endswith(describe_level())
            else:
                assert name in ("kernel", "prefill_kernel") and result["reason"]  # CUDA only
            continue
        assert result["status"] == "ok" and result["rows"], name
        for row in result["rows"]:
            assert row["status"] in ("ok", "skipped"), row  # an "error" row means a case raised
            if row["status"] == "skipped":
                assert legitimately_skipped(row), row


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
        base = by_key[("hf-sdpa", prompt, batch)]
        assert r["info"]["ideal_ratio"] == pytest.approx(base["info"]["step_mib"] / r["info"]["step_mib"])
    # H2O at 20% holds a fifth of the tokens, so it reads fewer bytes per step than the full cache
    for prompt, batch in {(p, b) for _, p, b in by_key}:
        h2o, hf = by_key[("el-h2o", prompt, batch)]["info"], by_key[("hf-sdpa", prompt, batch)]["info"]
        assert h2o["ideal_ratio"] > 1 and h2o["kv_mib"] < hf["kv_mib"]


def test_decode_rows_say_their_share_of_the_bandwidth_limit_and_of_the_fastest_hf_row(quick_run):
    rows = [r for r in quick_run[1]["benchmarks"]["decode"]["rows"] if r["status"] == "ok"]
    bandwidths = {r["info"]["bandwidth_gb_s"] for r in rows}
    assert len(bandwidths) == 1 and 0.1 < bandwidths.pop() < 10_000  # one measurement serves the run
    for r in rows:
        info, tokens = r["info"], r["metrics"]["tokens_per_s"]["value"]
        step_bytes = info["step_mib"] * 2**20
        assert info["limit_tokens_per_s"] == pytest.approx(r["params"]["batch"] * info["bandwidth_gb_s"] * 1e9 / step_bytes)
        assert info["of_limit"] == pytest.approx(tokens / info["limit_tokens_per_s"])
        if r["config"].startswith("hf-"):
            assert info["vs_fastest_hf"] is None
            continue
        hf = [h["metrics"]["tokens_per_s"]["value"] for h in rows
              if h["config"].startswith("hf-") and h["params"] == r["params"]]
        assert info["vs_fastest_hf"] == pytest.approx(tokens / max(hf))


def test_decode_rows_say_the_share_of_their_step_in_the_weight_products(quick_run):
    rows = [r for r in quick_run[1]["benchmarks"]["decode"]["rows"] if r["status"] == "ok"]
    for batch in {r["params"]["batch"] for r in rows}:
        at_batch = [r for r in rows if r["params"]["batch"] == batch]
        assert len({r["info"]["weights_matmul_ms"] for r in at_batch}) == 1  # one measurement per batch
    for r in rows:
        info, tokens = r["info"], r["metrics"]["tokens_per_s"]["value"]
        step_ms = 1e3 * r["params"]["batch"] / tokens
        assert 0 < info["weights_matmul_ms"] and info["weights_matmul_share"] == pytest.approx(
            info["weights_matmul_ms"] / step_ms)


def test_the_weight_products_pass_applies_every_linear_once(monkeypatch):
    from benchmarks.decode import weights_matmul_seconds

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    shapes = []
    linear = torch.nn.functional.linear

    def recorded(x, weight, *args):
        shapes.append((tuple(x.shape), tuple(weight.shape)))
        return linear(x, weight, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", recorded)
    assert weights_matmul_seconds(model, rows=3, repeats=2) > 0
    assert shapes == [((3, 8), (16, 8)), ((3, 16), (4, 16))] * 3  # the untimed pass, then two timed


def test_median_seconds_is_the_median_of_the_timed_calls_after_one_untimed(monkeypatch):
    from benchmarks import common

    clock = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # the three timed calls take 5, 1 and 3 s
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    calls = []
    assert common.median_seconds(lambda: calls.append(1), repeats=3) == 3.0
    assert len(calls) == 4


def test_memory_matches_the_formula_for_bounded_caches(quick_run):
    for r in quick_run[1]["benchmarks"]["memory"]["rows"]:
        if r["config"] in ("hf", "el-h2o"):
            assert r["info"]["kv_bytes"] == r["info"]["formula_bytes"], r
        else:  # the full slot store grows in steps, so it may hold more than it has seen
            assert r["info"]["kv_bytes"] >= r["info"]["formula_bytes"]


def test_cpu_kernel_counts_the_bytes_each_configuration_reads(quick_run):
    """float32 keys and values for the dense rows; 4-bit codes plus a bfloat16 scale and zero point per 32
    channels for int4 (3 KV heads, head dim 64)."""
    rows = quick_run[1]["benchmarks"]["cpu_kernel"]["rows"]
    assert {r["config"] for r in rows} == {"read", "matmul", "slot-ops", "int4-ops"}
    for r in rows:
        slots_read = r["params"]["batch"] * 3 * r["params"]["slots"]
        per_slot = (64 // 2 + 2 * (64 // 32) * 2) if r["config"] == "int4-ops" else 64 * 4
        assert r["info"]["bytes_read"] == 2 * slots_read * per_slot


def test_cpu_linear_reads_every_weight_once_a_pass(quick_run):
    """The quick pass's five weights (out x in: 48 x 32, 16 x 32, 96 x 32, 32 x 96, 256 x 32), 4 bytes an element
    in float32, 2 in bfloat16 (whose rows are skipped where the op has no bfloat16 loops)."""
    from evictlayers.kernels.linear_cpu import served_dtypes

    result = quick_run[1]["benchmarks"]["cpu_linear"]
    if result["status"] == "skipped":
        pytest.skip(result["reason"])
    rows = result["rows"]
    assert {r["config"] for r in rows} == {"read", "blas", "few-rows", "read-bf16", "blas-bf16", "few-rows-bf16"}
    for r in rows:
        bf16 = r["config"].endswith("-bf16")
        if bf16 and torch.bfloat16 not in served_dtypes():
            assert r["status"] == "skipped"
            continue
        assert r["status"] == "ok" and r["info"]["bytes_read"] == (2 if bf16 else 4) * (48 + 16 + 96 + 96 + 256) * 32


def test_quick_runs_write_nothing_without_out(tmp_path, monkeypatch):
    from benchmarks import common, suite

    monkeypatch.setattr(suite, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    main(["--quick", "--no-compile", "--threads", "1", "--only", "memory"])
    assert not (tmp_path / "results").exists()


# ---- --model: a second model, its own results files ---------------------------------------------


@pytest.fixture(scope="module")
def gemma_quick_run(tmp_path_factory):
    """``--quick --model gemma-3-270m``: a tiny random Gemma 3 whose two sliding-window layers (32
    tokens) are shorter than the quick prompts, so they drop tokens as the real model's do past 512."""
    out = tmp_path_factory.mktemp("gemma-results")
    returned = main(["--quick", "--no-compile", "--threads", "1", "--model", "gemma-3-270m",
                     "--only", "memory", "decode", "--out", str(out)])
    return out, returned


def test_default_model_keeps_the_machine_file_name_and_records_the_model(quick_run):
    out, returned = quick_run
    assert returned["model"] == "default" and returned["machine"] == machine_slug()
    for name in ("memory", "decode", "prefill"):
        assert returned["benchmarks"][name]["model"] == "tiny-random-llama"
    # random tensors of SmolLM2's shapes: no model to name
    for name in ("overhead", "cpu_kernel", "cpu_linear", "kernel", "prefill_kernel"):
        assert "model" not in returned["benchmarks"][name]
    assert "on tiny-random-llama" in (out / f"{returned['machine']}.md").read_text()


def test_another_model_writes_its_own_files_and_names_itself(gemma_quick_run):
    out, returned = gemma_quick_run
    assert returned["machine"] == machine_slug("gemma-3-270m") == machine_slug() + "-gemma-3-270m"
    assert sorted(p.name for p in out.iterdir()) == [f"{returned['machine']}.json", f"{returned['machine']}.md"]
    written = json.loads((out / f"{returned['machine']}.json").read_text())
    assert written["model"] == "gemma-3-270m"
    assert {r["model"] for r in written["benchmarks"].values()} == {"tiny-random-gemma3"}
    assert "--model gemma-3-270m" in (out / f"{returned['machine']}.md").read_text()


def test_default_and_second_model_results_do_not_overwrite_each_other(tmp_path):
    for model in ("default", "gemma-3-270m"):
        main(["--quick", "--threads", "1", "--model", model, "--only", "memory", "--out", str(tmp_path)])
    files = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert {d["model"] for d in files.values()} == {"default", "gemma-3-270m"} and len(files) == 2
    assert len(list(tmp_path.glob("*.md"))) == 2


def test_second_model_runs_every_configuration_and_counts_sliding_layers(gemma_quick_run):
    results = gemma_quick_run[1]["benchmarks"]
    for result in results.values():
        assert result["status"] == "ok"
        for row in result["rows"]:
            assert row["status"] == "ok" or row["reason"] == "--no-compile", row
    # hf: a sliding layer holds window - 1 = 31 tokens, the global layer every token; el-h2o: its budget
    for r in results["memory"]["rows"]:
        if r["config"] in ("hf", "el-h2o"):
            assert r["info"]["kv_bytes"] == r["info"]["formula_bytes"], r
    hf = next(r for r in results["memory"]["rows"] if r["config"] == "hf" and r["params"]["batch"] == 1)
    per_token = 2 * 1 * 32 * 4  # keys + values, 1 KV head, head dim 32, fp32
    assert hf["info"]["kv_bytes"] == per_token * (31 + 31 + hf["info"]["seen"])


def test_unknown_model_is_refused():
    with pytest.raises(SystemExit):
        main(["--quick", "--model", "no-such-model"])


def test_the_real_model_is_loaded_by_its_name(monkeypatch):
    """Without --quick the subject comes from ``evictlayers.models.load`` (stubbed: no real model here)."""
    import evictlayers.models

    from benchmarks.common import load_subject, tiny_llama

    asked = []
    monkeypatch.setattr(evictlayers.models, "load", lambda name: asked.append(name) or (tiny_llama(), "tokenizer"))
    assert load_subject(False, "gemma-3-270m").name == "Gemma 3 270M"
    assert load_subject(False).name == "SmolLM2-135M-Instruct"
    assert asked == ["gemma-3-270m", "default"]
    with pytest.raises(ValueError, match="unknown model"):
        load_subject(False, "no-such-model")


def test_prefill_child_loads_the_chosen_model(monkeypatch):
    from benchmarks import prefill

    monkeypatch.setattr(prefill, "_reset_peak", lambda: False)  # leave this process's peak-RSS counter alone
    loaded = []
    real = prefill.load_subject
    monkeypatch.setattr(prefill, "load_subject", lambda quick, model: loaded.append(model) or real(quick, model))
    result = prefill.measure_in_child(True, 1, "el-h2o", 48, "gemma-3-270m")
    assert loaded == ["gemma-3-270m"] and result["seconds"] > 0


def test_configs_and_prompts_restrict_the_plan():
    returned = main(["--quick", "--no-compile", "--threads", "1", "--only", "decode", "--prompts", "48",
                     "--configs", "hf-sdpa", "el-h2o"])
    rows = returned["benchmarks"]["decode"]["rows"]
    assert {(r["config"], r["params"]["prompt"]) for r in rows} == {("hf-sdpa", 48), ("el-h2o", 48)}
    assert all(r["metrics"]["tokens_per_s"]["ratio"] is not None for r in rows)
    with pytest.raises(SystemExit):
        main(["--quick", "--threads", "1", "--only", "decode", "--configs", "no-such-config"])


def test_max_autotune_configurations_run_only_where_configs_names_them():
    # their first compile takes minutes: a plain run plans none of them, --configs plans the ones it names
    plain = main(["--quick", "--no-compile", "--threads", "1", "--only", "decode", "--prompts", "48"])
    planned = {r["config"] for r in plain["benchmarks"]["decode"]["rows"]}
    assert "el-h2o-compiled" in planned and not any(c.endswith("max-autotune") for c in planned)
    named = main(["--quick", "--no-compile", "--threads", "1", "--only", "decode", "--prompts", "48",
                  "--configs", "hf-sdpa", "el-h2o-max-autotune", "hf-static-max-autotune"])
    rows = {r["config"]: r for r in named["benchmarks"]["decode"]["rows"]}
    assert set(rows) == {"hf-sdpa", "el-h2o-max-autotune", "hf-static-max-autotune"}
    skipped = rows["el-h2o-max-autotune"]
    assert skipped["status"] == "skipped" and "--no-compile" in skipped["reason"]


def test_static_copy_of_sliding_window_layers_decodes_as_the_dynamic_cache():
    """hf-static-compiled on Gemma 3: a StaticCache built from a DynamicCache whose sliding layers
    dropped tokens (64-token prompt, 32-token window) decodes the same logits, here without compiling."""
    from benchmarks.common import tiny_gemma3
    from benchmarks.loop import DecodeLoop, attention_implementation, prefill, static_copy, tiled

    model = tiny_gemma3()
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), attention_implementation(model, "sdpa"):
        cache, token = prefill(model, ids)
        logits = {}
        for name, copy in (("dynamic", tiled(cache, 2)), ("static", static_copy(model, cache, 2, 64 + 6))):
            loop, steps = DecodeLoop(model, model, copy, token.expand(2, 1), 64, 6), []
            forward = loop.forward
            loop.forward = lambda **inputs: steps.append(forward(**inputs)) or steps[-1]
            for _ in range(6):
                loop()
            logits[name] = torch.stack([out.logits[:, -1] for out in steps])
    torch.testing.assert_close(logits["static"], logits["dynamic"], atol=1e-5, rtol=1e-5)


def test_interleave_times_each_row_beside_the_baseline(monkeypatch):
    """``--interleave``: a row's timed blocks alternate with ``hf-sdpa`` blocks from the baseline's own
    cache (inside its own attention implementation), and ``vs_hf_sdpa_beside`` is the median over those
    pairs of the row's tokens/s over the baseline's. Block times are faked here (row 0.1 s, baseline
    0.3 s per step) so the ratio is known: 3."""
    from transformers import DynamicCache

    from benchmarks import decode as decode_benchmark

    calls = []

    def fake_blocks(loop, warmup, steps, repeats, sync=None):
        side = "baseline" if type(loop.cache) is DynamicCache else "row"
        if repeats:
            calls.append((side, loop.model.config._attn_implementation))
        return [0.3 if side == "baseline" else 0.1] * repeats, 0

    monkeypatch.setattr(decode_benchmark, "timed_blocks", fake_blocks)
    returned = main(["--quick", "--no-compile", "--threads", "1", "--only", "decode", "--prompts", "48",
                     "--configs", "hf-sdpa", "el-h2o", "--interleave", "--repeats", "3"])
    rows = {(r["config"], r["params"]["batch"]): r for r in returned["benchmarks"]["decode"]["rows"]}
    for batch in (1, 8):
        assert "vs_hf_sdpa_beside" not in rows[("hf-sdpa", batch)]["info"]
        info = rows[("el-h2o", batch)]["info"]
        assert info["vs_hf_sdpa_beside"] == pytest.approx(3.0) and info["beside_range"] == "3.00-3.00"
    # per el-h2o row: row (inside evictlayers.apply), baseline (left, under SDPA), three times
    assert calls[-6:] == [("row", "evictlayers"), ("baseline", "sdpa")] * 3


def test_interleave_runs_for_real():
    returned = main(["--quick", "--no-compile", "--threads", "1", "--only", "decode", "--prompts", "48",
                     "--configs", "hf-sdpa", "hf-eager", "el-full", "--interleave"])
    rows = returned["benchmarks"]["decode"]["rows"]
    for r in rows:
        if r["config"] == "hf-sdpa":
            continue
        low, high = (float(x) for x in r["info"]["beside_range"].split("-"))  # printed to 2 decimals
        assert 0 < low and low - 0.005 <= r["info"]["vs_hf_sdpa_beside"] <= high + 0.005


def test_interleave_beside_another_configuration(capsys):
    """``--interleave CONFIG`` pairs every other row with ``CONFIG`` (here the full cache, from its own
    prefill: a budgeted row's pair partner is another family) and names the ratio after it; an unknown name,
    or a compiled one under ``--no-compile``, is refused naming what is allowed."""
    returned = main(["--quick", "--no-compile", "--threads", "1", "--only", "decode", "--prompts", "48",
                     "--configs", "el-full", "el-h2o", "--interleave", "el-full"])
    rows = returned["benchmarks"]["decode"]["rows"]
    assert {r["config"] for r in rows} == {"el-full", "el-h2o"}
    for r in rows:
        assert "vs_hf_sdpa_beside" not in r["info"]
        if r["config"] == "el-full":
            assert "vs_el_full_beside" not in r["info"]
            continue
        low, high = (float(x) for x in r["info"]["beside_range"].split("-"))
        assert 0 < low and low - 0.005 <= r["info"]["vs_el_full_beside"] <= high + 0.005
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--quick", "--only", "decode", "--interleave", "el-h2o-int8"])
    assert "--interleave el-h2o-int8: not a decode configuration; choose one of hf-sdpa, " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quick", "--no-compile", "--only", "decode", "--interleave", "el-h2o-compiled"])
    assert "--interleave el-h2o-compiled compiles, which --no-compile rules out" in capsys.readouterr().err


def test_decode_loop_hands_every_step_the_mask_in_one_layout():
    """A compiled forward guards on the mask's strides: a last step whose view is the whole (contiguous)
    mask would compile again inside the timed blocks."""
    from benchmarks.common import tiny_llama
    from benchmarks.loop import DecodeLoop, prefill

    model = tiny_llama()
    masks = []

    def forward(**inputs):
        masks.append(inputs["attention_mask"])
        return model(**inputs)

    with torch.inference_mode():
        cache, token = prefill(model, torch.randint(3, 100, (1, 5)))
        cache.reorder_cache(torch.zeros(2, dtype=torch.long))
        loop = DecodeLoop(model, forward, cache, token.expand(2, 1), 5, total_steps=3)
        for _ in range(3):
            loop()
    assert [m.shape[1] for m in masks] == [6, 7, 8]
    assert len({(m.stride(), m.is_contiguous()) for m in masks}) == 1


# ---- gpu_decode: end-to-end decode (CUDA; a tiny random Llama on CPU with --quick) -------------------


@pytest.fixture(scope="module")
def gpu_decode_run(tmp_path_factory):
    """``--quick --only gpu_decode`` with compilation: every configuration at the tiny shape, the compiled ones
    compiled on CPU."""
    out = tmp_path_factory.mktemp("e2e")
    return out, main(["--quick", "--threads", "1", "--only", "gpu_decode", "--out", str(out)])


def test_gpu_decode_quick_runs_every_configuration_and_the_chunked_prompt(gpu_decode_run):
    from benchmarks import gpu_decode

    out, returned = gpu_decode_run
    rows = {r["config"]: r for r in returned["benchmarks"]["gpu_decode"]["rows"]}
    assert set(rows) == set(gpu_decode.CONFIGS) | {gpu_decode.CHUNKED}
    assert all(r["status"] == "ok" for r in rows.values()), [r for r in rows.values() if r["status"] != "ok"]
    for config, (_, compiled) in gpu_decode.CONFIGS.items():
        info, metrics = rows[config]["info"], rows[config]["metrics"]
        assert metrics["tokens_per_s"]["ratio"] is not None and metrics["prefill_ms"]["ratio"] is not None
        assert info["kv_mib"] > 0
        assert info["p10_ms"] <= metrics["ms_per_step"]["value"] <= info["p90_ms"]
        assert info["peak_mib"] is None  # CUDA only
        if compiled:  # compiled in the warm-up steps, none while timed
            assert info["compile_s"] > 0 and info["graphs"] >= 1 and info["timed_graphs"] == 0, config
            assert info["cudagraphs"] == 0
    # reduce-overhead asks for CUDA graphs, which inductor skips on a CPU, and says so
    assert rows["hf-static-compiled"]["info"]["cudagraph_skips"] >= 1
    assert rows["el-h2o"]["info"]["kv_mib"] < rows["hf-sdpa"]["info"]["kv_mib"]
    # the chunked prompt: every token fed, and the cache holds the budget, not the prompt
    chunked = rows[gpu_decode.CHUNKED]
    plan = gpu_decode.QUICK_CHUNKED
    per_token = gpu_decode.kv_bytes_per_token("tiny", element_bytes=4)
    assert chunked["params"]["prompt"] == plan.prompt
    assert plan.budget * per_token <= chunked["info"]["kv_mib"] * 2**20 < (plan.budget + plan.chunk) * per_token
    # its own results files, named after the machine, a table with every configuration under the columns' meaning
    machine = returned["machine"]
    assert sorted(p.name for p in out.iterdir()) == [f"{machine}-e2e.json", f"{machine}-e2e.md"]
    markdown = (out / f"{machine}-e2e.md").read_text()
    assert "`of bw`" in markdown and f"`{gpu_decode.CHUNKED}`" in markdown
    assert all(f"| {config} |" in markdown for config in gpu_decode.CONFIGS)


def test_gpu_decode_needs_cuda_without_quick(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    returned = main(["--threads", "1", "--only", "gpu_decode", "--out", str(tmp_path)])
    result = returned["benchmarks"]["gpu_decode"]
    assert result["status"] == "skipped" and "needs CUDA" in result["reason"]
    assert not list(tmp_path.iterdir())  # no results file that only says skipped


def test_gpu_decode_plan_runs_the_main_size_first_and_follows_prompts():
    from benchmarks import gpu_decode
    from benchmarks.common import Context, Settings

    planned = [(c.config, c.params["layers"], c.params["prompt"], c.params["batch"])
               for c in gpu_decode.cases(Context(Settings()))]
    first = [(config, 16, 8192, 8) for config in gpu_decode.CONFIGS]
    assert planned[: len(first)] == first and planned[len(first)] == (gpu_decode.CHUNKED, 16, 131072, 1)
    assert (("el-h2o-compiled", 32, 4096, 1)) in planned  # the 8B shape
    # --prompts: the 1B shape at those lengths, batch 65536 // prompt (1 to 8)
    planned = {(c.config, c.params["prompt"], c.params["batch"])
               for c in gpu_decode.cases(Context(Settings(prompts=(16384, 131072))))}
    assert {("el-h2o", 16384, 4), ("hf-sdpa", 131072, 1)} <= planned


def test_gpu_decode_skips_a_row_past_the_time_budget():
    from benchmarks import gpu_decode
    from benchmarks.common import Context, Settings

    bench = gpu_decode.Bench(Context(Settings()))
    assert bench.guarded("el-h2o", {"prompt": 1}, lambda: 1.0, lambda: "measured") == "measured"
    late = bench.guarded("el-h2o", {"prompt": 1}, lambda: gpu_decode.TIME_BUDGET_S, lambda: "measured")
    assert late["status"] == "skipped" and "time budget" in late["reason"] and "--configs el-h2o" in late["reason"]
