"""The tuning / held-out report on hand-made results: family means and gaps worked out by hand, the best
recipe named from the held-out split only, the bounds check over two models, merging of files, and
the command line (``python -m research.transfer``)."""

from __future__ import annotations

import json

import pytest

from research.transfer import main
from research.transfer_report import family_scores, merge, transfer_section, worst_gap


def _run(policy, budget, cells, setting="query_aware", full=False):
    scores = {}
    for (length, task), value in cells.items():
        scores.setdefault(setting, {}).setdefault(str(length), {})[task] = value
    return {"policy": policy, "budget": None if full else budget, "full_cache": full, "scores": scores,
            "kept_fraction": 1.0 if full else budget}


def _ruler(model, split, runs):
    return {"task": "ruler", "model": model, "settings": {"split": split, "samples": 2, "max_new_tokens": 64, "chat": True},
            "runs": runs}


def _ppl(model, values, split="held_out"):
    return {"task": "perplexity", "model": model, "settings": {"split": split},
            "runs": [{"policy": p, "budget": None if p == "full" else 0.2, "full_cache": p == "full", "score": v}
                     for p, v in values.items()]}


# tuning: A beats B; held-out: B beats A (A loses the noise family)
TUNING = {
    "full": {(1024, "niah_single_2"): 100.0, (1024, "niah_multikey_2"): 50.0},
    "A": {(1024, "niah_single_2"): 100.0, (1024, "niah_multikey_2"): 50.0},
    "B": {(1024, "niah_single_2"): 50.0, (1024, "niah_multikey_2"): 50.0},
}
HELD = {
    "full": {(1024, "niah_single_2"): 100.0, (1024, "niah_multivalue"): 80.0, (1024, "niah_single_1"): 100.0,
             (1024, "vt"): 40.0, (1024, "fwe"): 60.0},
    "A": {(1024, "niah_single_2"): 100.0, (1024, "niah_multivalue"): 60.0, (1024, "niah_single_1"): 50.0,
          (1024, "vt"): 0.0, (1024, "fwe"): 60.0},
    "B": {(1024, "niah_single_2"): 100.0, (1024, "niah_multivalue"): 70.0, (1024, "niah_single_1"): 100.0,
          (1024, "vt"): 30.0, (1024, "fwe"): 50.0},
}


def _model(name, held=HELD, ppl=None):
    runs = lambda table: [_run(p, 0.2, cells, full=p == "full") for p, cells in table.items()]  # noqa: E731
    out = [_ruler(name, "tuning", runs(TUNING)), _ruler(name, "held_out", runs(held))]
    return out + ([_ppl(name, ppl)] if ppl else [])


def test_family_means_and_worst_gap_by_hand():
    merged = merge(_model("m"))
    a, full = merged["m"]["held_out"]["A@20%"], merged["m"]["held_out"]["full"]
    fams = family_scores(a, full, "query_aware")
    # essay: A (100 + 60) / 2 = 80 against (100 + 80) / 2 = 90; noise: (50 + 0) / 2 = 25 against 70; words 60 vs 60
    assert fams == {"essay": (80.0, 90.0), "noise": (25.0, 70.0), "words": (60.0, 60.0)}
    assert worst_gap(a, full, "query_aware") == (45.0, "noise")
    b = merged["m"]["held_out"]["B@20%"]
    assert worst_gap(b, full, "query_aware") == (10.0, "words")  # essay 85 vs 90: 5; noise 65 vs 70: 5; words 50 vs 60


def test_best_recipe_per_task_comes_from_the_held_out_split_only():
    lines = transfer_section(merge(_model("m")))
    assert "| niah_single_1 | 100.0 | `B` 100.0 |" in lines
    assert "| vt | 40.0 | `B` 30.0 |" in lines
    assert "| niah_single_2 | 100.0 | all 100.0 |" in lines
    assert "| fwe | 60.0 | `A` 60.0 |" in lines


def test_bounds_need_every_model_and_the_perplexity():
    both = merge(_model("m1", ppl={"full": 10.0, "A": 10.2, "B": 10.4}) + _model("m2", ppl={"full": 8.0, "B": 8.3}))
    lines = transfer_section(both)
    assert ("Bounds at 20%: on every model, the worst held-out family within 12.5 points (one prompt in eight) of "
            "the full cache and streamed perplexity within 5%:") in lines
    b_line = next(line for line in lines if line.startswith("- `B`:"))
    # B: gap 10 <= 12.5 on both; perplexity +4.0% and +3.75%: within the bounds
    assert "m1: worst family +10.0 (words), perplexity +4.0%" in b_line and b_line.endswith("within the bounds")
    a_line = next(line for line in lines if line.startswith("- `A`:"))
    assert "worst family +45.0 (noise)" in a_line and "m2: worst family +45.0 (noise), perplexity not measured" in a_line
    assert a_line.endswith("outside the bounds")


def test_appendix_orders_by_tuning_and_shows_held_out():
    lines = transfer_section(merge(_model("m")))
    start = lines.index("### Every configuration tried")
    rows = [line for line in lines[start:] if line.startswith("| A ") or line.startswith("| B ")]
    assert rows == ["| A | 20% | 75.0 | 54.0 | +45.0 (noise) |", "| B | 20% | 50.0 | 70.0 | +10.0 (words) |"]


def test_files_merge_by_length_and_a_result_without_split_is_refused():
    short = _ruler("m", "held_out", [_run("A", 0.2, {(1024, "vt"): 10.0}), _run("full", None, {(1024, "vt"): 40.0}, full=True)])
    long = _ruler("m", "held_out", [_run("A", 0.2, {(2048, "vt"): 30.0}), _run("full", None, {(2048, "vt"): 20.0}, full=True)])
    merged = merge([short, long])
    run = merged["m"]["held_out"]["A@20%"]
    assert family_scores(run, merged["m"]["held_out"]["full"], "query_aware") == {"noise": (20.0, 30.0)}
    with pytest.raises(ValueError, match="--split"):
        merge([{**short, "settings": {}}])


def test_a_gap_is_only_taken_on_cells_the_full_cache_ran():
    held = merge([_ruler("m", "held_out", [_run("A", 0.2, {(1024, "vt"): 10.0, (2048, "vt"): 30.0}),
                                           _run("full", None, {(1024, "vt"): 40.0}, full=True)])])["m"]["held_out"]
    assert family_scores(held["A@20%"], held["full"], "query_aware") == {"noise": (20.0, None)}
    assert worst_gap(held["A@20%"], held["full"], "query_aware") is None


def test_command_writes_the_report(tmp_path, capsys):
    paths = []
    for i, result in enumerate(_model("m", ppl={"full": 10.0, "B": 10.1})):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(result))
        paths.append(str(path))
    out = tmp_path / "transfer.md"
    assert main([*paths, "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Retrieval on prompts it was not tuned on" in text and "- `B`: m: worst family +10.0 (words)" in text
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), "--out", str(out)])
    assert "no ruler.json or perplexity.json" in capsys.readouterr().err


def test_command_draws_one_row_of_panels_per_model(tmp_path):
    pytest.importorskip("matplotlib")
    paths = []
    for i, result in enumerate(_model("m1") + _model("m2")):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(result))
        paths.append(str(path))
    plot = tmp_path / "held_out.png"
    assert main([*paths, "--plot", str(plot)]) == 0
    from matplotlib import image

    height, width = image.imread(plot).shape[:2]
    assert plot.stat().st_size > 0 and height > 400  # two rows of ~330-pixel panels


def test_the_recipe_chosen_is_the_best_on_the_tuning_split():
    lines = transfer_section(merge(_model("m")))
    assert "Best on the tuning split by RULER score alone (its best evicting recipe per budget; ties named): 20%: `A` (75.0)." in lines


def test_the_report_says_how_the_runs_were_made():
    lines = transfer_section(merge(_model("m")))
    assert any("Runs: 2 prompts per task and length, up to 64 new tokens, chat template." in line for line in lines)


def test_each_length_gets_its_own_mean():
    merged = merge([_ruler("m", "held_out", [_run("A", 0.2, {(1024, "vt"): 10.0, (2048, "vt"): 30.0, (2048, "fwe"): 50.0}),
                                             _run("full", None, {(1024, "vt"): 40.0, (2048, "vt"): 40.0,
                                                                 (2048, "fwe"): 40.0}, full=True)])])
    row = next(line for line in transfer_section(merged) if line.startswith("| A | 20% |"))
    assert "| 1024: 10.0, 2048: 40.0 |" in row


def test_the_plot_holds_only_recipes_every_model_ran():
    from research.transfer_report import held_out_results

    extra = _ruler("m1", "held_out", [_run("C", 0.2, {(1024, "vt"): 1.0})])
    results = held_out_results(merge(_model("m1") + _model("m2") + [extra]))
    assert [[r["policy"] for r in result["runs"]] for result in results] == [["full", "A", "B"]] * 2


def test_each_setting_gets_its_own_section_from_its_own_cells(tmp_path, capsys):
    """Query-agnostic runs (context compressed before the question) beside query-aware ones: a section
    per setting, each from its own cells; a setting no run holds is refused by name."""
    from research.transfer_report import settings_of, transfer_report

    agnostic = {p: {cell: value / 2 for cell, value in cells.items()} for p, cells in HELD.items()}
    agnostic["full"] = HELD["full"]
    results = _model("m") + [
        _ruler("m", "held_out", [_run(p, 0.2, c, setting="query_agnostic", full=p == "full") for p, c in agnostic.items()])
    ]
    merged = merge(results)
    assert settings_of(merged) == ["query_aware", "query_agnostic"]
    text = "\n".join(transfer_report(merged))
    aware, agnostic_part = text.split("## Retrieval on prompts it was not tuned on: query-agnostic")
    assert "## Retrieval on prompts it was not tuned on: query-aware" in aware
    # B agnostic, halved: essay (50 + 35) / 2 = 42.5 against full's 90 (+47.5), noise 32.5 against 70
    # (+37.5), words 25 against 60 (+35); aware: words is its worst, +10
    assert "- `B`: m: worst family +10.0 (words)" in aware
    assert "- `B`: m: worst family +47.5 (essay)" in agnostic_part
    assert transfer_report(merged, ["query_agnostic"])[0].endswith("query-agnostic")
    with pytest.raises(ValueError, match="query_agnostic.*the runs hold: query_aware"):
        transfer_report(merge(_model("m")), ["query_agnostic"])
    path = tmp_path / "aware.json"
    path.write_text(json.dumps(_model("m")[1]))
    with pytest.raises(SystemExit):
        main([str(path), "--setting", "query_agnostic"])
    assert "the runs hold: query_aware" in capsys.readouterr().err


def test_each_row_shows_the_perplexity_measured_at_its_own_budget():
    """A 50% row reads the 50% perplexity run, a 20% row the 20% one; a budget never measured shows '-',
    and the bounds are still checked at 20% only."""
    ppl = _ppl("m", {"full": 10.0, "B": 10.4})
    ppl["runs"].append({"policy": "B", "budget": 0.5, "full_cache": False, "score": 10.1})
    held = [_run(p, 0.2, c, full=p == "full") for p, c in HELD.items()] + [_run("B", 0.5, HELD["B"]), _run("A", 0.5, HELD["A"])]
    lines = transfer_section(merge([_ruler("m", "tuning", []), _ruler("m", "held_out", held), ppl]))
    row = {line.split(" | ")[0] + " " + line.split(" | ")[1]: line for line in lines if line.startswith(("| A |", "| B |"))}
    assert row["| B 20%"].endswith("| +4.0% |") and row["| B 50%"].endswith("| +1.0% |")
    assert row["| A 50%"].endswith("| - |")
    assert "- `B`: m: worst family +10.0 (words), perplexity +4.0%: within the bounds" in lines


def test_a_setting_section_lists_only_the_runs_that_scored_it():
    """Recipes and models without query-agnostic runs are left out of that section's tables and appendix,
    and the bounds check names a model without such runs as not run."""
    results = _model("m1") + _model("m2") + [
        _ruler("m1", "held_out", [_run(p, 0.2, HELD[p], setting="query_agnostic", full=p == "full") for p in ("full", "B")])
    ]
    lines = transfer_section(merge(results), "query_agnostic")
    start = next(i for i, line in enumerate(lines) if line.startswith("| recipe | budget | tuning | held-out"))
    rows = lines[start + 2 : lines.index("", start)]
    assert [line.split(" | ")[0] for line in rows] == ["| full", "| B"]
    assert "### m2" not in lines and "### m1" in lines
    assert "- `B`: m1: worst family +10.0 (words), perplexity not measured; m2: worst family not run, perplexity not measured: outside the bounds" in lines


def test_perplexity_on_the_tuning_books_sits_beside_the_held_out_one_and_never_counts_for_the_bounds():
    """A tuning-split perplexity run fills the row's tuning column only; the bounds read the held-out one
    (B: +4.0% held-out is within them, though +30% on the tuning books); a result without a split is refused."""
    results = _model("m", ppl={"full": 10.0, "B": 10.4}) + [_ppl("m", {"full": 10.0, "B": 13.0}, split="tuning")]
    lines = transfer_section(merge(results))
    row = next(line for line in lines if line.startswith("| B | 20%"))
    assert row.endswith("| +30.0% | +4.0% |")
    assert "- `B`: m: worst family +10.0 (words), perplexity +4.0%: within the bounds" in lines
    with pytest.raises(ValueError, match=r"a perplexity result of m has no split \(split=None\)"):
        merge([{**_ppl("m", {"full": 10.0}), "settings": {}}])
