"""The README demo on the embedded model (slow: loads SmolLM2 and generates)."""

import pytest

from evictlayers import demo


@pytest.mark.slow
def test_demo_prints_its_table_and_full_cache_matches_the_unmodified_model(capsys):
    results = demo.run(["full", "local", "h2o"], n_prompts=2, target_tokens=400, max_new_tokens=6, seed=1)
    assert [r["policy"] for r in results] == ["unmodified (HF)", "full", "local", "h2o"]
    unmodified, full, local, h2o = results
    # with nothing evicted the library reproduces the unmodified model's answers
    assert full["correct"] == unmodified["correct"]
    # a 20% budget holds about a fifth of the unmodified cache (plus one spare slot per head)
    for row in (local, h2o):
        assert 0.15 < row["kv_bytes"] / unmodified["kv_bytes"] < 0.25
    table = demo.table(results)
    assert table.count("\n") == len(results) + 1 and "| h2o |" in table
