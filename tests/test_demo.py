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
    # every recipe's speed ratio divides by the unmodified run measured right before it
    beside = [r["unmodified_decode_tokens_per_s"] for r in (full, local, h2o)]
    low, high = unmodified["decode_spread"]
    assert low == min(beside) and high == max(beside) and low <= unmodified["decode_tokens_per_s"] <= high
    table = demo.table(results)
    h2o_line = next(line for line in table.splitlines() if line.startswith("| h2o |"))
    assert h2o_line.endswith(f"| {h2o['decode_tokens_per_s'] / beside[2]:.2f}x |")
    assert f"({low:.1f}-{high:.1f})" in table


@pytest.mark.slow
def test_demo_runs_on_gemma_3_270m_with_plain_text_prompts():
    from evictlayers import models

    try:
        models._chunk_assembler(models.GEMMA3_270M)
    except FileNotFoundError as err:
        pytest.skip(f"Gemma 3 270M is not installed: {err}")
    # Gemma's tokenizer writes a number digit by digit: a 5-digit key takes 6 new tokens with its space
    results = demo.run(["full", "h2o"], n_prompts=2, target_tokens=400, max_new_tokens=8, seed=1,
                       model_name="gemma-3-270m")
    unmodified, full, h2o = results
    assert [r["policy"] for r in results] == ["unmodified (HF)", "full", "h2o"]
    assert full["correct"] == unmodified["correct"]
    # 400-token prompts sit inside Gemma's 512-token window: every layer holds about a fifth of them
    assert 0.15 < h2o["kv_bytes"] / unmodified["kv_bytes"] < 0.25
