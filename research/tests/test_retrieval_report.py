"""The retrieval section: best recipe per task and budget, the target check, and merging a
partial re-run into saved results, from hand-made numbers."""

from __future__ import annotations

import pytest

from research.claims.saved import merge_runs
from research.passkey_needles import summarize
from research.retrieval_report import best_per_task, retrieval_section, target_check


def _run(policy, budget, correct=None, perplexity=None, n=8, depths=("0.0", "1.0")):
    full = budget is None
    run = {"policy": policy, "label": policy if full else f"{policy}@{budget}", "budget": budget, "full_cache": full,
           "n": n}
    if correct is not None:
        run.update(correct=correct, by_depth={d: 1.0 for d in depths})
    if perplexity is not None:
        run["perplexity"] = perplexity
    return run


def _task(key, runs, budgets=(0.1, 0.2, 0.5)):
    return {"task": "passkey", "runs": runs, "budgets": list(budgets), "settings": {"depths": [0, 1], "lengths": [1000]}}


@pytest.fixture
def results():
    filler = [_run("full", None, 7), _run("h2o", 0.2, 0), _run("mix", 0.2, 7), _run("keys", 0.2, 8),
              _run("h2o", 0.5, 3), _run("mix", 0.5, 7), _run("keys", 0.5, 7)]
    prose = [_run("full", None, 7), _run("h2o", 0.2, 6), _run("mix", 0.2, 7), _run("keys", 0.2, 2),
             _run("h2o", 0.5, 7), _run("mix", 0.5, 7), _run("keys", 0.5, 5)]
    lines = [_run("full", None, 10, n=16), _run("h2o", 0.5, 4, n=16), _run("mix", 0.5, 9, n=16),
             _run("keys", 0.5, 10, n=16)]
    stream = [_run("full", None, perplexity=30.0), _run("h2o", 0.2, perplexity=31.2),
              _run("mix", 0.2, perplexity=31.4), _run("keys", 0.2, perplexity=60.0)]
    return {"retrieval_filler": _task("f", filler, (0.2, 0.5)), "retrieval_prose": _task("p", prose, (0.2, 0.5)),
            "retrieval_lines": _task("l", lines, (0.5,)), "stream": {"task": "agreement", "runs": stream}}


def test_best_recipe_per_task_and_budget(results):
    lines = best_per_task(results)
    assert "- passkey, filler at 20%: `keys` (8/8; full cache 7/8)" in lines
    assert "- passkey, filler at 50%: `mix`, `keys` (7/8; full cache 7/8)" in lines
    assert "- passkey, prose at 50%: `h2o`, `mix` (7/8; full cache 7/8)" in lines
    assert "- lines at 50%: `keys` (10/16; full cache 10/16)" in lines
    assert "- language modelling (streamed perplexity at 20%): `h2o` (31.20, +4.0% vs full)" in lines


def test_target_needs_all_three_parts(results):
    met, notes = target_check(results)
    # mix: 7/8 and 7/8 at 20%, lines 9 vs 10 (within 1/16), perplexity +4.7% (within 5%)
    assert met == ["mix"]
    assert any(n.startswith("- `mix`:") and "meets the target" in n for n in notes)
    assert not any("`keys`" in n for n in notes)  # 2/8 on prose: not a candidate
    results["stream"]["runs"][2]["perplexity"] = 31.6  # +5.3%
    assert target_check(results)[0] == []
    text = "\n".join(retrieval_section(results))
    assert "No recipe meets all three." in text and "| mix | 7/8 | 7/8 | 7/8 | 7/8 | - | 9/16 | +5.3% |" in text
    results["retrieval_prose"]["runs"][2]["correct"] = 5  # mix: 7 + 5 = 12, h2o 0 + 6, keys 8 + 2 = 10
    text = "\n".join(retrieval_section(results))
    assert ("no recipe reaches 7/8 passkey at 20% on both haystacks; the best at 20% over both: `mix` "
            "(filler 7/8, prose 5/8); full cache 7/8 and 7/8") in text


def test_merge_replaces_runs_of_the_same_label_and_records_when():
    old = {"task": "agreement", "settings": {"n": 1}, "budgets": [0.2], "runs": [_run("full", None), _run("h2o", 0.2)]}
    new = {"task": "agreement", "settings": {"n": 1}, "budgets": [0.2], "runs": [_run("h2o", 0.2, perplexity=1.0),
                                                                                 _run("tova", 0.2)]}
    merged = merge_runs(old, new, "today")
    assert [r["label"] for r in merged["runs"]] == ["full", "h2o@0.2", "tova@0.2"]
    assert merged["runs"][1]["perplexity"] == 1.0
    assert merged["measured"][-1] == {"date": "today", "labels": ["h2o@0.2", "tova@0.2"]}
    with pytest.raises(ValueError, match="different settings"):
        merge_runs(old, {**new, "settings": {"n": 2}}, "today")


def test_needle_dumps_close_the_section(results):
    records = [{"correct": True, "key_tokens": 2, "held": [[2, 2], [2, 0]]}]
    payload = {"command": "python -m research.needles h2o ...", "summary": {"h2o": summarize(records)},
               "settings": {"haystack": "prose", "chat": True, "length": 1000, "n_prompts": 1, "budget": 0.2}}
    text = "\n".join(retrieval_section(results, [payload]))
    assert "### Per-head needle dump (prose haystack, chat format, 1 prompts of ~1000 tokens, budget 0.2)" in text
    assert "| h2o | 1/1 | 75% | 0% | 25% | 75% | - |" in text
    assert "- `h2o`: 100 50" in text
    assert "Per-head needle dump" not in "\n".join(retrieval_section(results))
