"""RULER's needle heat map (``--ruler-depths``): the needle read back from the prompt sits at the asked
depth of an essay and a noise haystack, the default prompts are the ones generated before depths existed,
bad depths are refused with every problem named, the summary and the report's cells from hand-made
results, and the command line end to end on a tiny model."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from evictlayers.cli import main
from evictlayers.eval.needle_map import map_cells, needle_map_tables, plot_needle_map, write_needle_map
from evictlayers.eval.ruler_run import summarize_ruler
from evictlayers.eval.suite import make_task
from evictlayers.eval.tasks.documents import read_texts
from evictlayers.eval.tasks.ruler import SINGLE_NEEDLE, Books, check_depths, ruler_samples
from evictlayers.eval.tasks.ruler.sources import NOISE, essay_sentences
from test_eval_helpers import char_tokenizer, tiny_llama
from test_ruler_tasks import synthetic_books
from tiny_models import single_thread  # noqa: F401

LENGTH = 2400  # characters = tokens with the character tokenizer
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: ([0-9a-f-]+)\.")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def book_dir(tmp_path_factory):
    return synthetic_books(tmp_path_factory.mktemp("ruler-depth-books"))


@pytest.fixture(scope="module")
def books(book_dir):
    return Books(read_texts(book_dir))


def _haystack(sample) -> str:
    """The haystack with its needle: between the instruction's line and the question's (with or without a
    chat template around them)."""
    start = sample.text.index(" afterwards.\n") + len(" afterwards.\n")
    return sample.text[start : sample.text.index("\nWhat is the special magic", start)]


def _units_around_needle(sample, haystack: str) -> tuple[int, int]:
    """(haystack units before the needle, units after it), read back from the prompt text."""
    text = _haystack(sample)
    needles = list(NEEDLE.finditer(text))
    assert len(needles) == 1
    start, end = needles[0].span()
    if haystack == "essay":
        count = lambda part: len(essay_sentences(part.split()))  # noqa: E731
        return count(text[:start]), count(text[end:])
    lines = text.split("\n")
    where = next(i for i, line in enumerate(lines) if NEEDLE.fullmatch(line))
    assert all(line == NOISE for i, line in enumerate(lines) if i != where)
    return where, len(lines) - 1 - where


# ---- where the needle lands --------------------------------------------------------------------------------


@pytest.mark.parametrize("task, haystack", [("niah_single_2", "essay"), ("niah_single_3", "essay"),
                                            ("niah_single_1", "noise")])
@pytest.mark.parametrize("depth", [0, 50, 100])
def test_the_needle_lands_at_the_asked_depth(tok, books, task, haystack, depth):
    samples = ruler_samples(tok, task, LENGTH, n_samples=2, seed=3, books=books, depth=depth)
    for sample in samples:
        assert sample.depth == depth
        before, after = _units_around_needle(sample, haystack)
        units = before + after
        assert units > 20  # a real haystack, so one unit is a small share of it
        if haystack == "noise":
            assert units == sample.haystack  # every line of the haystack is there, none replaced
        # within one unit (a sentence, a line) of the asked fraction; the ends exactly
        assert abs(before / units - depth / 100) <= 1 / units, (before, units)
        if depth == 0:
            assert before == 0
        if depth == 100:
            assert after == 0


def test_a_cells_prompts_do_not_depend_on_the_other_depths_asked(tok, book_dir):
    def rows(depths):
        task = make_task("ruler", tok, tasks=["niah_single_2"], lengths=[1500], samples=2, depths=depths,
                         data=book_dir)
        return {(r["depth"], r["sample"]): r["input_ids"] for r in task.rows()}

    one, other = rows([50, 0]), rows([100, 50, 50])
    assert sorted({d for d, _ in one}) == [0, 50] and sorted({d for d, _ in other}) == [50, 100]
    assert one[(50, 0)] == other[(50, 0)] and one[(50, 1)] == other[(50, 1)]
    assert one[(0, 0)] != one[(50, 0)]  # each depth draws its own prompts


# ---- the default: RULER's drawn depths, prompts as before ------------------------------------------------

# sha256 (first 16 hex digits) of two samples' text, ids, context split, answers and haystack size at
# LENGTH, as the generator produced them before depths existed (synthetic books, character tokenizer)
BEFORE = {
    ("niah_single_1", 0): "380325f89460cf19", ("niah_single_1", 2): "43b37920976a86dd",
    ("niah_single_2", 0): "f96c8972485f0a6d", ("niah_single_2", 2): "1b482f777dccedcd",
    ("niah_single_3", 0): "4f568401e88ac835", ("niah_single_3", 2): "239b74a8b94730a7",
    ("niah_multikey_1", 0): "100ff8c8299bf9f0", ("niah_multikey_1", 2): "7ee55caded6bf024",
    ("niah_multikey_2", 0): "c9e8055d5ebd00ae", ("niah_multikey_2", 2): "b43937eafa8a3be2",
    ("niah_multiquery", 0): "046d42835264e9c4", ("niah_multiquery", 2): "052b9e932779b0b6",
}


def _digest(samples) -> str:
    blob = json.dumps([[s.text, list(s.input_ids), s.n_context, list(s.answers), s.haystack] for s in samples])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@pytest.mark.parametrize("task, seed", list(BEFORE))
def test_without_depths_the_prompts_are_the_ones_from_before(tok, books, task, seed):
    samples = ruler_samples(tok, task, LENGTH, n_samples=2, seed=seed, books=books)
    assert _digest(samples) == BEFORE[(task, seed)]
    assert all(s.depth is None for s in samples)


def test_without_depths_rows_and_settings_carry_no_depth(tok, book_dir):
    task = make_task("ruler", tok, tasks=["niah_single_1", "vt"], lengths=[1800], samples=1, data=book_dir)
    assert task.tasks == ["niah_single_1", "vt"] and "depths" not in task.settings()
    assert all("depth" not in row for row in task.rows())


# ---- bad depths ---------------------------------------------------------------------------------------------


def test_bad_depths_are_refused_with_every_problem(tok, books, book_dir):
    assert SINGLE_NEEDLE == ("niah_single_1", "niah_single_2", "niah_single_3")
    assert check_depths([100, 0, 50, 50]) == [0, 50, 100]
    with pytest.raises(ValueError) as error:
        check_depths([-5, 50, 150], ["niah_single_2", "niah_multikey_1", "vt"])
    message = str(error.value)
    assert message.startswith("ruler depths (--ruler-depths): [-5, 150] not whole percentages from 0 to 100")
    assert ("task(s) ['niah_multikey_1', 'vt'] (--ruler-tasks) do not hold exactly one needle; a depth applies "
            "only to the single-needle tasks niah_single_1, niah_single_2, niah_single_3") in message
    with pytest.raises(ValueError, match=r"no depth given"):
        check_depths([])
    with pytest.raises(ValueError, match=r"\[12.5\] not whole percentages"):
        check_depths([12.5])
    with pytest.raises(ValueError, match=r"\[101\] not whole percentages from 0 to 100"):
        ruler_samples(tok, "niah_single_2", LENGTH, books=books, depth=101)
    with pytest.raises(ValueError, match=r"\['niah_multivalue'\] \(--ruler-tasks\) do not hold exactly one needle"):
        ruler_samples(tok, "niah_multivalue", LENGTH, books=books, depth=10)
    with pytest.raises(ValueError, match=r"\['niah_multikey_2'\] \(--ruler-tasks\) do not hold exactly one needle"):
        make_task("ruler", tok, tasks=["niah_multikey_2"], depths=[10], data=book_dir)


def test_depths_keep_the_split_protocol(tok, book_dir):
    """Without --ruler-tasks the split's single-needle tasks run (the noise one only on the held-out split);
    the held-out-only family is still refused on the tuning split."""
    held_out = make_task("ruler", tok, depths=[0, 100], split="held_out", lengths=[1200], samples=1, data=book_dir)
    assert held_out.tasks == ["niah_single_1", "niah_single_2", "niah_single_3"] and held_out.seed == 2
    assert held_out.settings()["depths"] == [0, 100]
    assert sorted({(r["task"], r["depth"]) for r in held_out.rows()}) == [
        (t, d) for t in ("niah_single_1", "niah_single_2", "niah_single_3") for d in (0, 100)]
    tuning = make_task("ruler", tok, depths=[50], split="tuning", lengths=[1200], samples=1, data=book_dir)
    assert tuning.tasks == ["niah_single_2", "niah_single_3"]
    with pytest.raises(ValueError, match=r"noise family, which the tuning split does not hold"):
        make_task("ruler", tok, tasks=["niah_single_1"], depths=[50], split="tuning", data=book_dir)


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_cli_refuses_bad_depths_before_the_model_loads(capsys, book_dir):
    common = ["eval", "full", "--task", "ruler", "--data-dir", str(book_dir), "--model", "no/such-model", "--out", "x"]
    err = _error(capsys, [*common, "--ruler-depths", "-10", "50", "120", "--ruler-tasks", "niah_single_2", "vt"])
    assert "ruler depths (--ruler-depths): [-10, 120] not whole percentages from 0 to 100" in err
    assert "task(s) ['vt'] (--ruler-tasks) do not hold exactly one needle" in err
    err = _error(capsys, [*common, "--ruler-depths", "12.5"])
    assert "argument --ruler-depths: expected a whole percentage from 0 to 100, got '12.5'" in err
    err = _error(capsys, ["eval", "h2o", "--task", "passkey", "--ruler-depths", "10", "--out", "x"])
    assert "--ruler-depths does not apply to --task passkey (it applies to: ruler)" in err


# ---- the summary and the report ------------------------------------------------------------------------------


def _record(depth, length, task, found, setting="query_aware"):
    return {"setting": setting, "length": length, "task": task, "depth": depth, "answers": ["1234567"],
            "generated": "it is 1234567" if found else "no idea"}


def test_summary_has_a_cell_per_setting_depth_and_length():
    records = [_record(0, 1000, "niah_single_2", True), _record(0, 1000, "niah_single_2", False),
               _record(0, 1000, "niah_single_3", True), _record(0, 1000, "niah_single_3", True),
               _record(100, 1000, "niah_single_2", False), _record(100, 1000, "niah_single_3", False),
               _record(100, 2000, "niah_single_2", True), _record(100, 2000, "niah_single_3", True)]
    summary = summarize_ruler(records)
    grid = summary["needle_map"]["query_aware"]
    assert grid["0"]["1000"] == {"score": 75.0, "n": 4, "by_task": {"niah_single_2": 50.0, "niah_single_3": 100.0}}
    assert grid["100"]["1000"]["score"] == 0.0 and grid["100"]["2000"]["score"] == 100.0
    assert "2000" not in grid["0"]
    assert "needle_map" not in summarize_ruler([{k: v for k, v in r.items() if k != "depth"} for r in records])


def _result(runs, depths=(0, 50, 100)):
    return {"task": "ruler", "model": "tiny", "runs": runs,
            "settings": {"tasks": ["niah_single_2"], "lengths": [1000, 2000], "depths": list(depths), "seed": 2,
                         "split": "held_out", "setting": ["query_aware"]}}


def _cell(score, n=2):
    return {"score": score, "n": n, "by_task": {"niah_single_2": score}}


HAND_MADE = {"query_aware": {
    "0": {"1000": _cell(100.0), "2000": _cell(50.0)},
    "100": {"1000": _cell(100.0), "2000": _cell(100.0)},
    "50": {"1000": _cell(0.0), "2000": _cell(50.0)},
}}


def test_report_table_has_depth_rows_and_length_columns():
    run = {"policy": "h2o", "budget": 0.2, "full_cache": False, "needle_map": HAND_MADE}
    full = {"policy": "full", "budget": None, "full_cache": True,
            "needle_map": {"query_aware": {"0": {"1000": _cell(100.0, 3)}, "50": {"1000": _cell(100.0, 2)}}}}
    text = needle_map_tables(_result([full, run]))
    lines = text.splitlines()
    h2o = lines.index("### tiny: h2o, budget 20%, query-aware")
    assert lines[h2o + 2] == "RULER score (0-100) of task niah_single_2; 2 prompt(s) per cell."
    assert lines[h2o + 4 : h2o + 9] == [
        "| depth \\ length | 1000 | 2000 |",
        "|---|---|---|",
        "| 0% | 100.0 | 50.0 |",
        "| 50% | 0.0 | 50.0 |",
        "| 100% | 100.0 | 100.0 |",
    ]
    # unequal cells: each says how many prompts it holds
    assert "| 0% | 100.0 (3) |" in text and "| 50% | 100.0 (2) |" in text
    assert "### tiny: full, full cache, query-aware" in text
    # several runs' results: one table per map
    assert needle_map_tables([_result([run]), _result([run])]).count("| 50% | 0.0 | 50.0 |") == 2


def test_report_works_from_the_examples_and_writes_the_files(tmp_path):
    examples = [_record(d, n, "niah_single_2", found) for d, n, found in
                [(0, 1000, True), (0, 2000, False), (100, 1000, True), (100, 2000, True)]]
    run = {"policy": "local", "budget": 64, "full_cache": False, "examples": examples}  # no needle_map key
    assert map_cells(run)["query_aware"][100][2000]["score"] == 100.0
    result = _result([run], depths=[0, 100])
    written = write_needle_map(result, tmp_path)
    text = written["needle_map"].read_text()
    assert text.startswith("# RULER needle heat map on tiny")
    assert "| 0% | 100.0 | 0.0 |" in text and "| 100% | 100.0 | 100.0 |" in text and "held_out split" in text
    assert write_needle_map({**result, "settings": {**result["settings"], "depths": None}}, tmp_path / "no") == {}
    pytest.importorskip("matplotlib")
    assert written["needle_map_plot"].stat().st_size > 0
    several = plot_needle_map([result, _result([{"policy": "h2o", "budget": 0.2, "full_cache": False,
                                                 "needle_map": HAND_MADE}])], tmp_path / "several.png")
    assert several.stat().st_size > 0


# ---- the command line end to end -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("ruler-depths-tiny-llama")
    tiny_llama(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_writes_the_needle_map(capsys, checkpoint, book_dir, tmp_path):
    out = tmp_path / "out"
    code = main(["eval", "full", "local", "--task", "ruler", "--ruler-tasks", "niah_single_2", "--ruler-depths", "0",
                 "100", "--ruler-samples", "1", "--lengths", "1200", "--max-new-tokens", "3", "--budget", "0.2",
                 "--model", str(checkpoint), "--data-dir", str(book_dir), "--out", str(out), "--no-progress",
                 "--threads", "1"])
    assert code == 0
    result = json.loads((out / "ruler.json").read_text())
    assert result["settings"]["depths"] == [0, 100] and result["n_examples"] == 2
    for run in result["runs"]:
        assert sorted(e["depth"] for e in run["examples"]) == [0, 100]
        assert set(run["needle_map"]["query_aware"]) == {"0", "100"}
    table = (out / "ruler_needle_map.md").read_text()
    assert "### " in table and "| depth \\ length | 1200 |" in table
    assert re.search(r"\| 0% \| \d+\.\d \|", table) and re.search(r"\| 100% \| \d+\.\d \|", table)
    assert "1 prompt(s) per cell" in table
    assert "ruler_needle_map.md" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert (out / "ruler_needle_map.png").stat().st_size > 0
