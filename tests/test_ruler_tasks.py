"""RULER's synthetic tasks: prompts checked by reading them back (regular expressions and counting, not
the generators' own data), lengths measured with the tokenizer, determinism, chat rendering, and the
scoring against RULER's formulas worked out by hand."""

from __future__ import annotations

import collections
import random
import re

import pytest

from evictlayers.eval.tasks.documents import read_texts
from evictlayers.eval.tasks.ruler import (
    TASKS, Books, postprocess, ruler_samples, sample_score, string_match_all, string_match_part, use_chat,
)
from evictlayers.eval.tasks.ruler.sources import NOISE
from evictlayers.eval.tasks.ruler.words import zeta, zipf_counts
from test_eval_helpers import char_tokenizer

LENGTH = 2400  # characters = tokens with the character tokenizer
TOLERANCE = 130  # one haystack unit at most: the longest is a line holding a UUID needle (~115 characters)
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: ([0-9a-f-]+)\.")


def synthetic_books(root, n_books: int = 2):
    """Books of made-up words in sentences (600 distinct words, so the vocabulary has ~500 after the
    100 most frequent are dropped)."""
    rng = random.Random(7)
    syllables = ["ka", "lo", "mi", "ne", "tsu", "ra", "vi", "do", "pe", "zo", "gu", "fa"]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(900)})[:600]
    for b in range(n_books):
        sentences = []
        for _ in range(400):
            body = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
            sentences.append(body[0].upper() + body[1:] + rng.choice([".", ".", "!", "?"]))
        (root / f"book{b}.txt").write_text(" ".join(sentences) + "\n")
    return root


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return Books(read_texts(synthetic_books(tmp_path_factory.mktemp("ruler-books"))))


def _samples(tok, books, task, length=LENGTH, n=2, seed=0, **kwargs):
    return ruler_samples(tok, task, length, n_samples=n, seed=seed, books=books, **kwargs)


def _context(sample) -> str:
    return sample.text[: sample.n_context]  # one token per character


# ---- lengths and determinism -------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_fills_the_length_as_ruler_counts_it(tok, books, task):
    for sample in _samples(tok, books, task):
        measured = len(tok(sample.text)["input_ids"])
        assert measured == sample.n_tokens
        # RULER: the prompt plus the tokens to generate fit the length, with the largest haystack that does
        total = measured + TASKS[task].tokens_to_generate
        assert LENGTH - TOLERANCE <= total <= LENGTH, (task, total)


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"])
def test_samples_are_deterministic_per_seed_and_differ_across_seeds(tok, books, task):
    a = _samples(tok, books, task, n=2, seed=3)
    assert a == _samples(tok, books, task, n=2, seed=3)
    b = _samples(tok, books, task, n=2, seed=4)
    assert a[0].text != b[0].text and a[0].answers != b[0].answers
    assert a[0].text != a[1].text
    # sample i does not depend on how many samples are asked for
    assert _samples(tok, books, task, n=1, seed=3)[0] == a[0]


def test_too_short_a_length_says_how_long_the_smallest_prompt_is(tok, books):
    with pytest.raises(ValueError, match=r"RULER task niah_single_1 at length 300 .*smallest prompt takes \d+ tokens"):
        _samples(tok, books, "niah_single_1", length=300)
    with pytest.raises(ValueError, match="fwe: length 200 is too short"):
        _samples(tok, books, "fwe", length=200)


def test_unknown_and_left_out_tasks_are_named(tok, books):
    with pytest.raises(ValueError, match="unknown RULER task 'niah'; the tasks: niah_single_1, niah_single_2"):
        _samples(tok, books, "niah")
    with pytest.raises(ValueError, match="qa_1, qa_2 are left out"):
        _samples(tok, books, "qa_1")
    with pytest.raises(ValueError, match="needs books"):
        ruler_samples(tok, "cwe", LENGTH)


# ---- each answer is where the specification puts it ---------------------------------------------------


def _asked(question: str) -> list[str]:
    keys = re.search(r"for (.+) mentioned in the provided text\?", question).group(1)
    return re.split(r", and |, ", keys)


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_niah_answers_are_the_values_of_the_asked_keys(tok, books, task):
    args = TASKS[task].args
    for sample in _samples(tok, books, task):
        context, question = _context(sample), sample.text[len(_context(sample)):]
        needles = NEEDLE.findall(context)
        asked = _asked(question)
        assert len(asked) == args["num_queries"]
        kind = "uuids" if args["value"] == "uuids" else "numbers"
        assert all(k == kind for k, _, _ in needles)
        # each asked key sits in exactly num_values needles, and their values are the answers
        for key in asked:
            assert sum(n_key == key for _, n_key, _ in needles) == args["num_values"]
        assert sorted(v for _, key, v in needles if key in asked) == sorted(sample.answers)
        # every answer value occurs once in the prompt, in its needle
        assert all(context.count(v) == 1 for v in sample.answers)
        keys = [key for _, key, _ in needles]
        if args["haystack"] == "needle":
            assert len(needles) > 5 and len(set(keys)) == len(keys)  # distractors, with other keys
        else:
            assert len(needles) == max(args["num_keys"], args["num_queries"]) * args["num_values"]
        if args["key"] == "uuids":
            assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", k) for k in keys)
        elif args["key"] == "words":
            assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in keys)
        if args["value"] == "numbers":
            assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in sample.answers)
        body = context.split("afterwards.\n", 1)[1]
        if args["haystack"] == "noise":
            assert {line for line in body.splitlines() if not NEEDLE.fullmatch(line)} == {NOISE}
        if args["haystack"] == "essay":
            # needles sit between sentences: after a sentence end (or first), before a capital (or last)
            for match in NEEDLE.finditer(body):
                before, after = body[: match.start()], body[match.end():]
                assert before == "" or re.search(r"[.!?] $", before)
                assert after.strip() == "" or re.match(r" [A-Z]|\n", after)


def _resolve(statements: list[tuple[str, str]], value: str) -> set[str]:
    """Variables holding ``value`` after the assignments (``(name, number or other name)``), by fixpoint."""
    holding: set[str] = set()
    while True:
        new = {name for name, source in statements if source == value or source in holding}
        if new == holding:
            return holding
        holding = new


def _assignments(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^VAR ([A-Z]+) = (?:VAR )?([A-Z]+|\d+) ?$", text, re.MULTILINE)


def test_variable_tracking_chain_reaches_the_value(tok, books):
    for sample in _samples(tok, books, "vt", n=3):
        context = _context(sample)
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        example, task = context.split(intro)[1:]
        value = re.search(r"assigned the value (\d+) in the text above", sample.text[len(context):]).group(1)
        assert _resolve(_assignments(task), value) == set(sample.answers)
        assert len(sample.answers) == TASKS["vt"].args["num_hops"] + 1
        assert all(re.fullmatch(r"[A-Z]{5}", name) for name in sample.answers)
        # the worked example's answer is right too, three-letter names
        shown_value = re.search(r"assigned the value (\d+), they are: ", example).group(1)
        shown = example.rsplit("they are: ", 1)[1].split()
        assert _resolve(_assignments(example), shown_value) == set(shown) and all(len(n) == 3 for n in shown)
        lines = [line for line in task.splitlines()[:-1] if not line.startswith("VAR ")]
        assert set(lines) == {NOISE}


@pytest.mark.parametrize("length", [LENGTH, 9000])
def test_common_words_answers_are_the_most_frequent_words(tok, books, length):
    for sample in _samples(tok, books, "cwe", length=length):
        lists = re.findall(r"Memorize the ones that appear most often\.\n(.*?)\n", sample.text)
        assert len(lists) == 2  # the worked example, then the task
        for listed, answer in ((lists[0], None), (lists[1], sample.answers)):
            entries = re.findall(r"(\d+)\. (\S+)", listed)
            assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
            counts = collections.Counter(w for _, w in entries).most_common()
            top = {w for w, _ in counts[:10]}
            assert counts[9][1] > counts[10][1]  # the ten are unambiguous
            if answer is not None:
                assert top == set(answer)
                repeats = (6, 1) if length < 4096 else (30, 3)  # RULER's repeats below and above 4k
                assert {c for _, c in counts[:10]} == {repeats[0]} and {c for _, c in counts[10:]} == {repeats[1]}
            else:
                shown = re.findall(r"are: ((?:\d+\. \S+ ?)+)", sample.text)[0]
                assert {w for _, w in re.findall(r"(\d+)\. (\S+)", shown)} == top


def test_frequent_words_answers_are_the_three_most_frequent_coded_words(tok, books):
    for sample in _samples(tok, books, "fwe", n=3):
        text = re.search(r"frequently appeared coded words\. (.*)\nQuestion:", sample.text).group(1)
        counts = collections.Counter(text.split()).most_common()
        assert counts[0][0] == "..."  # RULER's noise word holds the top rank
        coded = counts[1:]
        assert [w for w, _ in coded[:3]] == list(sample.answers)
        assert coded[2][1] > coded[3][1]
        assert all(re.fullmatch(r"[a-z]{6}", w) for w, _ in coded)
        # the counts follow the zeta law: count(rank k) = int(n k^-2 / zeta(2)), zeta(2) = pi^2 / 6
        n = sample.haystack
        assert [c for _, c in counts[:4]] == [int(n / k**2 / (3.141592653589793**2 / 6)) for k in range(1, 5)]


def test_zeta_and_zipf_counts():
    assert zeta(2.0) == pytest.approx(3.141592653589793**2 / 6, rel=1e-12)
    assert zeta(4.0) == pytest.approx(3.141592653589793**4 / 90, rel=1e-12)
    assert zipf_counts(1000, 4, 2.0) == [607, 151, 67, 37]


# ---- the context / question split and the chat template -------------------------------------------------


def test_context_ends_where_the_question_starts(tok, books):
    for task in ("niah_multiquery", "vt", "cwe", "fwe"):
        (sample,) = _samples(tok, books, task, n=1)
        rest = sample.text[len(_context(sample)):]
        assert rest.startswith(("What ", "Question: ")), (task, rest[:40])
        assert sample.input_ids[: sample.n_context] == tuple(tok(_context(sample))["input_ids"])


@pytest.fixture(scope="module")
def chat_tok():
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>\n{% endif %}")
    return tok


def test_chat_template_wraps_the_task_input_and_keeps_the_answer_prefix(chat_tok, books):
    (sample,) = ruler_samples(chat_tok, "niah_single_2", LENGTH, books=books, chat=True)
    assert sample.text.startswith("<user>\nA special magic number is hidden within the following text.")
    assert re.search(r"mentioned in the provided text\?\n<assistant>\nThe special magic number for \S+ mentioned "
                     r"in the provided text is$", sample.text)
    assert sample.n_tokens + 128 <= LENGTH
    # common-words' worked example is an earlier user / assistant turn
    (cwe,) = ruler_samples(chat_tok, "cwe", LENGTH, books=books, chat=True)
    turns = re.findall(r"^<(user|assistant)>$", cwe.text, re.MULTILINE)
    assert turns == ["user", "assistant", "user", "assistant"]
    assert re.search(r"<assistant>\nAnswer: The top 10 words that appear most often in the list are: 1\. ", cwe.text)


def test_template_choice(tok, chat_tok):
    assert use_chat(chat_tok, "auto") and not use_chat(tok, "auto")
    assert not use_chat(chat_tok, "base") and use_chat(chat_tok, "chat")
    with pytest.raises(ValueError, match=r"template='chat' \(--ruler-template chat\) needs a tokenizer with a chat "
                                         r"template.*use 'auto'.*or 'base'"):
        use_chat(tok, "chat")
    with pytest.raises(ValueError, match="expected one of auto, chat, base"):
        use_chat(tok, "llama")


# ---- scoring: RULER's formulas, worked out by hand ------------------------------------------------------


def test_string_match_all_by_hand():
    predictions = ["The numbers are 123 and 456.", "nothing here", "ABC-def, then 789"]
    references = [["123", "456", "789"], ["x"], ["abc-DEF", "789"]]
    # (2/3 + 0 + 2/2) / 3 * 100 = 55.555... -> 55.56
    assert string_match_all(predictions, references) == 55.56
    assert [sample_score(p, r) for p, r in zip(predictions, references)] == [pytest.approx(2 / 3), 0.0, 1.0]


def test_string_match_part_by_hand():
    predictions = ["The numbers are 123 and 456.", "nothing here", "ABC-def"]
    references = [["999", "456"], ["x", "y"], ["abc-DEF"]]
    assert string_match_part(predictions, references) == 66.67  # (1 + 0 + 1) / 3 * 100
    assert sample_score("no", ["x", "no"], "string_match_part") == 1.0


def test_postprocess_as_ruler():
    assert postprocess("  1234567\x00and\t89  ") == "1234567\nand\n89"
    assert postprocess("\n answer \n") == "answer"


# ---- the real tokenizer and books ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("length", [1000, 4096])
def test_real_tokenizer_and_books_fill_the_length(length):
    from evictlayers import models

    _, tokenizer = models.load_default()
    books = Books(read_texts())
    for task, spec in TASKS.items():
        for sample in ruler_samples(tokenizer, task, length, n_samples=2, books=books, chat=True):
            total = len(tokenizer(sample.text, add_special_tokens=False)["input_ids"]) + spec.tokens_to_generate
            # within one haystack unit; the longest is a line holding two UUIDs (~70 tokens)
            assert length - 80 <= total <= length, (task, total)
