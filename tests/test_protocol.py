"""The tuning / held-out protocol: the splits share no book, seed or prompt, the tuning split never holds
a held-out family, prompts read only their split's books (checked by reading the prompts back), and bad
combinations fail naming the argument."""

from __future__ import annotations

import random
import re

import pytest

from evictlayers.cli import main
from evictlayers.eval.protocol import FAMILIES, SPLITS, family_of, split_books, split_tasks
from evictlayers.eval.suite import make_task
from evictlayers.eval.tasks.ruler import TASKS
from test_eval_helpers import char_tokenizer

WORD = re.compile(r"[a-z]+")


def marked_books(root, n_books: int = 4):
    """Book ``i`` is sentences of words that all start with ``q`` followed by ``i`` spelled as letters
    (``qa...``, ``qb...``), so every word of a prompt says which book it came from."""
    rng = random.Random(3)
    syllables = ["ka", "lo", "mi", "ne", "tsu", "ra", "vi", "do", "pe", "zo"]
    for b in range(n_books):
        mark = "q" + "abcd"[b]
        words = sorted({mark + "".join(rng.choices(syllables, k=rng.randint(2, 3))) for _ in range(700)})[:500]
        sentences = []
        for _ in range(300):
            body = " ".join(rng.choice(words) for _ in range(rng.randint(6, 12)))
            sentences.append(body + ".")
        (root / f"book{b}.txt").write_text(" ".join(sentences) + "\n")
    return root


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return marked_books(tmp_path_factory.mktemp("protocol-books"))


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_families_cover_every_task_once():
    listed = [t for names in FAMILIES.values() for t in names]
    assert sorted(listed) == sorted(TASKS)
    assert len(listed) == len(set(listed))


def test_the_tuning_split_never_holds_a_held_out_family_and_the_splits_differ():
    tuning, held = SPLITS["tuning"], SPLITS["held_out"]
    new = set(held.families) - set(tuning.families)
    assert new, "at least one haystack family must be held out entirely"
    assert not any(family_of(t) in new for t in tuning.tasks)
    assert tuning.seed != held.seed and tuning.book_parity != held.book_parity
    assert set(held.tasks) == set(TASKS)


def test_books_alternate_between_the_splits():
    texts = [(f"b{i}.txt", "x") for i in (3, 0, 2, 1, 4)]
    tuning = [n for n, _ in split_books(texts, "tuning")]
    held = [n for n, _ in split_books(texts, "held_out")]
    assert tuning == ["b0.txt", "b2.txt", "b4.txt"] and held == ["b1.txt", "b3.txt"]
    with pytest.raises(ValueError, match="at least two books"):
        split_books(texts[:1], "tuning")
    with pytest.raises(ValueError, match="--split.*tuning, held_out"):
        split_books(texts, "validation")


def test_split_tasks_refuses_a_task_outside_the_split():
    assert split_tasks("tuning") == list(SPLITS["tuning"].tasks)
    with pytest.raises(ValueError, match=r"\['vt', 'cwe'\].*noise, words.*tuning"):
        split_tasks("tuning", ["niah_single_2", "vt", "cwe"])
    assert split_tasks("held_out", ["vt"]) == ["vt"]


def _prompt_text(tok, row) -> str:
    return tok.decode(row["input_ids"][: row["n_context"]])


@pytest.mark.parametrize("split", list(SPLITS))
def test_prompts_read_only_their_splits_books(tok, books, split):
    task = make_task("ruler", tok, tasks=["niah_single_2", "niah_multikey_1"], lengths=[1500], samples=2,
                     data=books, split=split)
    assert task.sources == [n for n, _ in split_books([(f"book{i}.txt", "") for i in range(4)], split)]
    marks = {"q" + "abcd"[i] for i in range(4) if i % 2 == SPLITS[split].book_parity}
    seen = set()
    for row in task.rows():
        words = [w for w in WORD.findall(_prompt_text(tok, row)) if w[:2] in ("qa", "qb", "qc", "qd")]
        assert words, "the essay haystack should hold book words"
        seen |= {w[:2] for w in words}
    assert seen == marks


def test_the_splits_share_no_prompt_or_key(tok, books):
    rows = {split: make_task("ruler", tok, tasks=["niah_single_2"], lengths=[1500], samples=3, data=books,
                             split=split).rows() for split in SPLITS}
    answers = {split: {a for r in rs for a in r["answers"]} for split, rs in rows.items()}
    assert not answers["tuning"] & answers["held_out"]
    texts = {split: {_prompt_text(tok, r) for r in rs} for split, rs in rows.items()}
    assert not texts["tuning"] & texts["held_out"]


def test_a_split_fixes_its_seed_and_its_tasks(tok, books):
    task = make_task("ruler", tok, lengths=[1500], samples=1, data=books, split="held_out")
    assert task.seed == SPLITS["held_out"].seed and task.tasks == list(TASKS)
    with pytest.raises(ValueError, match="--seed 5 with --split tuning"):
        make_task("ruler", tok, lengths=[1500], data=books, split="tuning", seed=5)
    with pytest.raises(ValueError, match="noise family.*tuning"):
        make_task("ruler", tok, tasks=["niah_single_1"], lengths=[1500], data=books, split="tuning")


@pytest.mark.parametrize("argv, message", [
    (["--split", "tuning", "--ruler-tasks", "vt"], "noise family, which the tuning split does not hold"),
    (["--split", "tuning", "--seed", "3"], "--seed 3 with --split tuning"),
    (["--split", "test"], "invalid choice: 'test'"),
])
def test_cli_errors_name_the_split(tmp_path, books, capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["eval", "full", "--task", "ruler", "--data-dir", str(books), "--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_perplexity_reads_only_its_splits_books(tok, books):
    for split in SPLITS:
        task = make_task("perplexity", tok, data=books, split=split, n_docs=2, doc_tokens=64)
        marks = {w[:2] for row in task.rows() for w in WORD.findall(tok.decode(row["input_ids"]))
                 if w[:2] in ("qa", "qb", "qc", "qd")}
        assert marks == {"q" + "abcd"[i] for i in range(4) if i % 2 == SPLITS[split].book_parity}
