"""The claims: verdicts from hand-made numbers (statuses and summaries written out by hand), pending
claims when recipes are missing, merging a partial re-run, and the report end to end on a tiny model
(quick sizes)."""

from __future__ import annotations

import shutil

import pytest

from evictlayers.eval.runner import recipes_dir
from research import claims
from research.claims.command import REPORT, REPORT_ARTIFACTS, default_artifacts
from research.claims.saved import merge_rerun
from research.claims.verdicts.ahakv import claim_ahakv, early_evenness
from research.claims.verdicts.clustergen import claim_clustergen
from research.claims.verdicts.h2o import claim_h2o
from research.claims.verdicts.quantized import claim_int4
from research.claims.verdicts.scissorhands import claim_scissorhands
from test_eval_helpers import char_tokenizer, tiny_llama
from tiny_models import single_thread  # noqa: F401


def _run(policy, budget, **numbers):
    full = budget is None
    return {"policy": policy, "label": policy if full else f"{policy}@{budget}", "budget": budget,
            "full_cache": full, "n": 8, "kv_bytes": 1.0, "kept_fraction": 1.0 if full else budget,
            "histogram": [1] * 20, **numbers}


def _stream(**ppl):
    return {"task": "agreement", "runs": [_run(p, None if p == "full" else 0.2, perplexity=v, top1=0.9, kl=0.1,
                                               score=0.9) for p, v in ppl.items()]}


def _passkey(**correct):
    runs = []
    for p, c in correct.items():
        for budget in ([None] if p == "full" else [0.2]):
            runs.append(_run(p, budget, correct=c, score=c / 8))
    return {"task": "passkey", "runs": runs}


def test_claim_1_holds_partly_or_not_by_the_stated_criteria():
    results = {"stream": _stream(full=20.0, h2o=20.5, local=30.0), "passkey": _passkey(full=7, h2o=7, local=1)}
    verdict = claim_h2o(results, {})
    assert (verdict.status, verdict.summary) == (
        "holds", "on both tasks (perplexity H2O +2.5%, local +50.0% vs full; passkey H2O 7/8, local 1/8, full 7/8)")
    results["passkey"] = _passkey(full=7, h2o=1, local=1)  # retrieval fails: language modelling only
    verdict = claim_h2o(results, {})
    assert (verdict.status, verdict.summary) == (
        "partly", "holds for language modelling, not for passkey retrieval, where H2O fails it too (perplexity H2O "
        "+2.5%, local +50.0% vs full; passkey H2O 1/8, local 1/8, full 7/8)")
    results["stream"] = _stream(full=20.0, h2o=22.0, local=30.0)  # 10% off the full cache
    assert claim_h2o(results, {}).status == "does not hold"


def test_claim_2_scissorhands():
    make = lambda sc: {"stream": _stream(full=20.0, scissorhands=sc, local=40.0)}  # noqa: E731
    verdict = claim_scissorhands(make(20.9), {})
    assert (verdict.status, verdict.summary) == ("holds", "Scissorhands +4.5% from full, local +100.0%")
    verdict = claim_scissorhands(make(25.0), {})
    assert (verdict.status, verdict.summary) == (
        "partly", "beats local (+100.0%) but is +25.0% from full (criterion: 5%)")
    assert claim_scissorhands(make(45.0), {}).status == "does not hold"


def test_claim_3_evenness_decides_the_spread():
    stream = _stream(full=20.0, h2o=21.0, ahakv=21.0)
    early = [10, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5, 5]
    stream["runs"][1]["histogram"] = early
    results = {"stream": stream, "passkey": _passkey(full=7, h2o=2, ahakv=3)}
    results["passkey"]["runs"][1]["histogram"] = early
    assert early_evenness(stream["runs"][2]) == pytest.approx(1.0)
    assert early_evenness(stream["runs"][1]) < 0.5
    assert claim_ahakv(results, {}).status == "holds"
    results["stream"]["runs"][2]["perplexity"] = 25.0  # worse language modelling: spread but not as good
    assert claim_ahakv(results, {}).status == "partly"


def test_claim_4_clustergen_must_beat_both_baselines():
    results = {"lines": _passkey(full=7, h2o=3, streaming_llm=4, clustergen=5)}
    verdict = claim_clustergen(results, {})
    assert (verdict.status, verdict.summary) == ("holds", "ClusterSketch beats H2O and StreamingLLM at every budget")
    results = {"lines": _passkey(full=7, h2o=3, streaming_llm=5, clustergen=5)}  # a tie is not a win
    assert claim_clustergen(results, {}).status == "does not hold"


def test_claim_5_four_bits_within_two_percent():
    results = {"stream": _stream(full=20.0, h2o=20.0, h2o_int4=20.3, scissorhands=21.0, scissorhands_int4=21.0)}
    assert claim_int4(results, {}).status == "holds"  # +1.5% and +0.0%
    del results["stream"]["runs"][3:]  # the Scissorhands pair not measured
    verdict = claim_int4(results, {"scissorhands_int4": "not yet"})
    assert (verdict.status, verdict.summary) == ("partly", "4-bit costs little where measured")
    assert verdict.details[-1] == "not yet measured: `scissorhands_int4` (not yet)"
    results["stream"]["runs"][2]["perplexity"] = 20.5  # +2.5%
    assert claim_int4(results, {}).status == "does not hold"


def test_missing_components_are_pending():
    results = {"stream": _stream(full=20.0, h2o=20.5, local=30.0)}
    verdict = claim_scissorhands(results, {"scissorhands": "recipes/scissorhands.yaml does not exist yet"})
    assert (verdict.status, verdict.summary) == ("pending", "component not landed: `scissorhands`")
    assert verdict.details == ["`scissorhands`: recipes/scissorhands.yaml does not exist yet"]
    assert claim_int4(results, {}).status == "pending"
    assert claim_clustergen(results, {}).status == "pending"


def test_a_rerun_replaces_runs_and_clears_what_now_ran():
    saved = {"stream": {"task": "agreement", "settings": {"n": 1}, "budgets": [0.2],
                        "runs": [_run("full", None), _run("h2o", 0.2)]}}
    rerun = {"stream": {"task": "agreement", "settings": {"n": 1}, "budgets": [0.2], "runs": [_run("tova", 0.2)]}}
    results, unavailable = merge_rerun(saved, {"tova": "recipes/tova.yaml does not exist yet", "clustergen": "no"},
                                       rerun, {"knorm": "bad recipe"}, "today")
    assert [r["label"] for r in results["stream"]["runs"]] == ["full", "h2o@0.2", "tova@0.2"]
    assert unavailable == {"clustergen": "no", "knorm": "bad recipe"}
    assert [r["label"] for r in saved["stream"]["runs"]] == ["full", "h2o@0.2"]  # the saved results stay as they were


@pytest.fixture
def partial_recipes(tmp_path, monkeypatch):
    """A recipes directory with the H2O-era recipes only: Scissorhands and AhaKV have not landed."""
    for name in ("full", "local", "streaming_llm", "h2o", "h2o_averaged"):
        shutil.copy(recipes_dir() / f"{name}.yaml", tmp_path / f"{name}.yaml")
    monkeypatch.setenv("EVICTLAYERS_RECIPES", str(tmp_path))
    return tmp_path


def test_the_committed_report_keeps_its_runs_with_the_raw_runs_and_a_trial_report_beside_itself(tmp_path):
    assert default_artifacts(REPORT) == REPORT_ARTIFACTS == default_artifacts(REPORT.resolve())
    assert default_artifacts(tmp_path / "trial.md") == tmp_path / "trial"


def test_report_end_to_end_on_a_tiny_model(partial_recipes, tmp_path):
    tok = char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prose haystack's chat format
    doc = tmp_path / "docs" / "results.md"
    text = claims.main(doc=doc, quick=True, progress=False, model=tiny_llama(len(tok)), tokenizer=tok, threads=1,
                       model_name="tiny")
    assert doc.read_text() == text
    verdicts = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")
                and line.split("|")[1].strip() in "12345"}
    assert set(verdicts) == {"1", "2", "3", "4", "5"}
    assert "**pending**" not in verdicts["1"]
    for number in ("2", "3", "4", "5"):
        assert "**pending**" in verdicts[number]
    assert "`scissorhands`: recipes/scissorhands.yaml does not exist yet" in text
    artifacts = doc.parent / "results"
    for name in ("stream.json", "passkey.json", "lines.json", "passkey_score_vs_budget.png", "stream_positions.png",
                 "verdicts.json"):
        assert (artifacts / name).is_file(), name
    assert "](results/passkey_score_vs_budget.png)" in text
    # the retrieval section runs every recipe of the directory on both haystacks and lines at 10/20/50%
    for name in ("retrieval_filler.json", "retrieval_prose.json", "retrieval_lines.json"):
        assert (artifacts / name).is_file(), name
    assert "## Retrieval under a budget" in text
    assert "| h2o_averaged |" in text.split("## Retrieval under a budget")[1].split("Best recipe")[0]
    assert "QUICK MODE" in text
