"""Task data: LongEval-style lines prompts, Project Gutenberg stripping, document windows, budgets."""

from __future__ import annotations

import re

import pytest

from evictlayers.eval.runner import parse_budget
from evictlayers.eval.tasks import documents
from evictlayers.eval.tasks.documents import document_windows, read_texts, strip_gutenberg
from evictlayers.eval.tasks.lines import lines_prompts, parse_record, score_lines
from test_eval_helpers import char_tokenizer


class WordTokenizer:
    """One token per word or punctuation mark."""

    def encode(self, text, add_special_tokens=True):
        return re.findall(r"\w+|[^\w\s]", text)


# ---- lines --------------------------------------------------------------------------------------


def _record_lines(text: str) -> list[tuple[str, str]]:
    """The record as (name, value) pairs, read with a pattern written here from LongEval's format."""
    return re.findall(r"^line (\S+): REGISTER_CONTENT is <(\d+)>$", text, flags=re.MULTILINE)


@pytest.mark.parametrize("n_lines", [2, 7, 40])
def test_lines_answer_is_the_queried_lines_value(n_lines):
    for prompt in lines_prompts(WordTokenizer(), n_prompts=5, n_lines=n_lines, seed=3):
        record = _record_lines(prompt.text)
        assert len(record) == n_lines
        names = [name for name, _ in record]
        assert len(set(names)) == n_lines
        # the question names one line of the record; its value is the answer
        asked = re.search(r"in line (\S+)\? I need the number", prompt.text).group(1)
        assert asked == prompt.name
        assert dict(record)[asked] == prompt.answer
        assert names.index(asked) == prompt.line
        assert prompt.text.endswith(f"The <REGISTER_CONTENT> in line {asked} is <")
        assert parse_record(prompt.text) == dict(record)
        assert all(1 <= int(v) <= 50000 for _, v in record)


def test_lines_depth_picks_the_line():
    prompts = lines_prompts(WordTokenizer(), n_prompts=5, n_lines=9)
    assert [p.line for p in prompts] == [0, 2, 4, 6, 8]
    assert [p.line for p in lines_prompts(WordTokenizer(), n_prompts=2, n_lines=9, depth=1.0)] == [8, 8]


def test_lines_are_deterministic_per_seed():
    a = lines_prompts(WordTokenizer(), n_prompts=3, n_lines=10, seed=1)
    b = lines_prompts(WordTokenizer(), n_prompts=3, n_lines=10, seed=1)
    c = lines_prompts(WordTokenizer(), n_prompts=3, n_lines=10, seed=2)
    assert a == b
    assert [p.text for p in a] != [p.text for p in c]


def test_lines_report_token_counts():
    tok = char_tokenizer()
    for prompt in lines_prompts(tok, n_prompts=2, n_lines=4):
        assert prompt.n_tokens == len(prompt.text)  # one token per character


@pytest.mark.parametrize(
    "kwargs, match",
    [({"n_lines": 1}, "n_lines"), ({"n_prompts": 0}, "n_prompts"), ({"depth": 1.5}, "depth")],
)
def test_lines_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lines_prompts(WordTokenizer(), **kwargs)


def test_score_lines_takes_the_first_number():
    assert score_lines("4021>\nline x", "4021")
    assert not score_lines("40215>", "4021")
    assert not score_lines("no number", "4021")
    assert not score_lines("12> or 4021", "4021")


# ---- Project Gutenberg stripping ----------------------------------------------------------------

NEW_STYLE = """The Project Gutenberg EBook of A Book, by Someone

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK A BOOK ***




Produced by Some Volunteers



CHAPTER I

It was a dark night.

THE END

*** END OF THIS PROJECT GUTENBERG EBOOK A BOOK ***

***** This file should be named 1.txt *****
Section 1. General Terms of Use
"""

OLD_STYLE = """***The Project Gutenberg Etext of Old Book***

Please take a look at the important information in this header.

***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***
Why is this "Small Print!" statement here?
*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*




This etext was prepared by a volunteer.



OLD BOOK

Once upon a time.

End of the Project Gutenberg Edition of Old Book
"""


def test_strip_new_style():
    assert strip_gutenberg(NEW_STYLE) == "CHAPTER I\n\nIt was a dark night.\n\nTHE END"


def test_strip_old_style():
    assert strip_gutenberg(OLD_STYLE) == "OLD BOOK\n\nOnce upon a time."


def test_plain_text_is_kept():
    assert strip_gutenberg("Just some text.\r\nMore.\n") == "Just some text.\nMore."


BOOK_OPENINGS = {
    "jnglb10.txt": "THE JUNGLE BOOK",
    "nqpmr10.txt": "AN ENQUIRY CONCERNING THE PRINCIPLES OF MORALS",
    "pg12388.txt": "[Illustration",
    "pg2701.txt": "MOBY DICK; OR THE WHALE",
}


@pytest.mark.skipif(not documents.default_data_dir().is_dir(), reason="shared/data/pg19-sample not present")
def test_real_books_lose_header_and_licence():
    texts = dict(read_texts())
    assert set(BOOK_OPENINGS) <= set(texts)
    for name, opening in BOOK_OPENINGS.items():
        text = texts[name]
        assert text.startswith(opening), (name, text[:80])
        for boilerplate in ("SMALL PRINT", "*** START OF", "*** END OF", "START: FULL LICENSE",
                            "End of the Project Gutenberg", "End of Project Gutenberg"):
            assert boilerplate not in text, (name, boilerplate)
    assert texts["pg2701.txt"].rstrip().endswith("only found another\norphan.")


def test_missing_data_dir_names_the_directory_and_the_fix(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*EVICTLAYERS_DATA.*--data-dir"):
        read_texts(missing)
    monkeypatch.setenv("EVICTLAYERS_DATA", str(missing))
    assert documents.default_data_dir() == missing
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_texts()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt files"):
        read_texts(tmp_path / "empty")


def test_document_windows_are_consecutive_slices():
    tok = char_tokenizer()
    texts = [("a.txt", "abcdefghij" * 30), ("b.txt", "0123456789" * 30)]
    docs = document_windows(tok, texts, n_docs=5, doc_tokens=25, start=0.0)
    assert [(d["source"], d["window"]) for d in docs] == [
        ("a.txt", 0), ("b.txt", 0), ("a.txt", 1), ("b.txt", 1), ("a.txt", 2)
    ]
    for doc in docs:
        assert len(doc["input_ids"]) == 25
        text = dict(texts)[doc["source"]]
        k = doc["window"]
        assert tok.decode(doc["input_ids"]) == text[25 * k : 25 * (k + 1)]


def test_document_windows_start_at_a_paragraph():
    tok = char_tokenizer()
    text = "title page\n\n" + "x" * 50 + "\n\nBody starts here and goes on. " * 10
    (doc,) = document_windows(tok, [("t.txt", text)], n_docs=1, doc_tokens=10, start=0.2)
    assert tok.decode(doc["input_ids"]) == "Body start"


def test_document_windows_too_short_says_so():
    with pytest.raises(ValueError, match=r"short\.txt: \d+ tokens .* 2 window\(s\) of 100 tokens need 200"):
        document_windows(char_tokenizer(), [("short.txt", "x" * 150)], n_docs=2, doc_tokens=100, start=0.0)


# ---- budgets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("128", 128), ("0.2", 0.2), ("20%", 0.2), ("1.0", 1.0), ("full", None)])
def test_parse_budget(text, value):
    parsed = parse_budget(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "0.0", "abc", "nan", "150%"])
def test_bad_budgets_say_what_is_allowed(text):
    with pytest.raises(ValueError, match=r"bad budget .*allowed: an integer number of tokens"):
        parse_budget(text)
