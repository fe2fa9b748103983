"""The claims runner: verdicts from given numbers, pending claims when recipes are missing, and the
report end to end on a tiny model (quick sizes)."""

from __future__ import annotations

import shutil

import pytest

from evictlayers.eval import claims
from evictlayers.eval.runner import recipes_dir
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
    assert claims.claim_h2o(results, {}).status == "holds"
    results["passkey"] = _passkey(full=7, h2o=1, local=1)  # retrieval fails: language modelling only
    assert claims.claim_h2o(results, {}).status == "partly"
    results["stream"] = _stream(full=20.0, h2o=22.0, local=30.0)  # 10% off the full cache
    assert claims.claim_h2o(results, {}).status == "does not hold"


def test_claim_2_scissorhands():
    make = lambda sc: {"stream": _stream(full=20.0, scissorhands=sc, local=40.0)}  # noqa: E731
    assert claims.claim_scissorhands(make(20.9), {}).status == "holds"
    assert claims.claim_scissorhands(make(25.0), {}).status == "partly"
    assert claims.claim_scissorhands(make(45.0), {}).status == "does not hold"


def test_claim_3_evenness_decides_the_spread():
    stream = _stream(full=20.0, h2o=21.0, ahakv=21.0)
    early = [10, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5, 5]
    stream["runs"][1]["histogram"] = early
    results = {"stream": stream, "passkey": _passkey(full=7, h2o=2, ahakv=3)}
    results["passkey"]["runs"][1]["histogram"] = early
    assert claims.early_evenness(stream["runs"][2]) == pytest.approx(1.0)
    assert claims.early_evenness(stream["runs"][1]) < 0.5
    assert claims.claim_ahakv(results, {}).status == "holds"
    results["stream"]["runs"][2]["perplexity"] = 25.0  # worse language modelling: spread but not as good
    assert claims.claim_ahakv(results, {}).status == "partly"


def test_missing_components_are_pending():
    results = {"stream": _stream(full=20.0, h2o=20.5, local=30.0)}
    verdict = claims.claim_scissorhands(results, {"scissorhands": "recipes/scissorhands.yaml does not exist yet"})
    assert verdict.status == "pending" and "scissorhands" in verdict.summary
    assert claims.claim_int4(results, {}).status == "pending"
    assert claims.claim_clustergen(results, {}).status == "pending"


@pytest.fixture
def partial_recipes(tmp_path, monkeypatch):
    """A recipes directory with the H2O-era recipes only: Scissorhands and AhaKV have not landed."""
    for name in ("full", "local", "streaming_llm", "h2o", "h2o_averaged"):
        shutil.copy(recipes_dir() / f"{name}.yaml", tmp_path / f"{name}.yaml")
    monkeypatch.setenv("EVICTLAYERS_RECIPES", str(tmp_path))
    return tmp_path


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
