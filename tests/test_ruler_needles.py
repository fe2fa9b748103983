"""``evictlayers needles --task ruler``: each answer's needle located in the prompt's tokens, the
per-head count of its tokens a cache holds (a recent window whose kept positions follow from the
budget, and the full cache), hand-counted summaries, and the command line's errors."""

from __future__ import annotations

import pytest

import evictlayers as el
from evictlayers.cli import main
from evictlayers.eval.ruler_needles import (
    dump_ruler_prompt, markdown, needle_spans, profile, run_ruler_needles, summarize_answers,
)
from evictlayers.eval.suite import RulerTask
from evictlayers.eval.tasks.ruler import ruler_samples
from evictlayers.eval.tasks.documents import read_texts
from evictlayers.eval.tasks.ruler.sources import Books
from test_eval_helpers import char_tokenizer, tiny_llama
from test_ruler_tasks import synthetic_books
from tiny_models import single_thread  # noqa: F401


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return synthetic_books(tmp_path_factory.mktemp("ruler-needle-books"))


def test_needle_spans_are_the_characters_of_each_needles_key_and_value(tok):
    text = ("Intro. One of the special magic numbers for alpha is: 1234567. Filler text. "
            "One of the special magic numbers for beta gamma is: 7654321. What is the number for beta gamma?")
    ids = tok(text, add_special_tokens=True)["input_ids"]
    spans = needle_spans(tok, text, ids, ["7654321", "1234567"], chat=False)
    # one token per character: the indices are the characters' own
    for span, answer, key in zip(spans, ["7654321", "1234567"], ["beta gamma", "alpha"]):
        start = text.index(answer)
        assert span["value_tokens"] == list(range(start, start + len(answer)))
        key_start = text.index(f"for {key} is") + 4
        assert span["key_tokens"] == list(range(key_start, key_start + len(key)))
        assert (span["answer"], span["key"]) == (answer, key)
    with pytest.raises(ValueError, match="value of 0 needles"):
        needle_spans(tok, text, ids, ["1111111"], chat=False)
    with pytest.raises(ValueError, match="ids differ"):
        needle_spans(tok, text, ids[1:], ["1234567"], chat=False)


def _sample(tok, books, task="niah_multivalue", length=700):
    return ruler_samples(tok, task, length, 1, seed=3, books=Books(read_texts(books)), max_new_tokens=3)[0]


@pytest.mark.usefixtures("single_thread")
def test_held_counts_follow_a_recent_windows_kept_positions(tok, books):
    model = tiny_llama(len(tok))  # 2 layers, 2 KV heads
    sample = _sample(tok, books)
    spans = needle_spans(tok, sample.text, sample.input_ids, sample.answers, chat=False)
    n = len(sample.input_ids)
    last = max((s["value_tokens"] for s in spans), key=lambda v: v[0])  # the last needle's value
    # a window ending at the prompt's end and starting one token into the last needle's value
    budget = n - last[0] - 1
    record = dump_ruler_prompt(model, tok, el.Policy(el.RecentWindow(), budget=budget), sample, chat=False)
    assert len(record["answers"]) == len(sample.answers) == 4
    for answer, span in zip(record["answers"], spans):
        value = sum(p >= n - budget for p in span["value_tokens"])
        key = sum(p >= n - budget for p in span["key_tokens"])
        assert answer["value_held"] == [[value, value]] * 2
        assert answer["key_held"] == [[key, key]] * 2
        assert answer["value_tokens"] == len(span["value_tokens"])
    assert sum(a["value_held"][0][0] == len(last) - 1 for a in record["answers"]) == 1
    full = dump_ruler_prompt(model, tok, el.load_recipe("full"), sample, chat=False)
    for answer in full["answers"]:
        assert answer["value_held"] == [[answer["value_tokens"]] * 2] * 2
        assert answer["found"] == (answer["answer"].lower() in full["generated"].lower())


def test_summary_counts_answers_heads_and_layers():
    def answer(found, value_held, key_held):
        return {"found": found, "value_tokens": 2, "key_tokens": 1, "value_held": value_held, "key_held": key_held}

    records = [
        {"task": "a", "answers": [answer(True, [[2, 2], [2, 2]], [[1, 1], [1, 1]]),   # whole, key whole, found
                                  answer(False, [[2, 1], [2, 2]], [[1, 1], [1, 1]])]},  # cut in one head
        {"task": "b", "answers": [answer(True, [[0, 0], [2, 2]], [[0, 0], [1, 1]]),   # cut, found anyway
                                  answer(False, [[2, 2], [2, 2]], [[1, 0], [1, 1]])]},  # whole, key cut, not found
    ]
    s = summarize_answers(records)
    assert (s["answers"], s["found"], s["value_whole"], s["key_and_value_whole"]) == (4, 2, 2, 1)
    assert s["value_head_share"] == (4 + 3 + 2 + 4) / 16
    assert s["found_when_whole"] == (1, 2) and s["found_when_cut"] == (1, 2)
    # layer 0: heads holding both value tokens 2 + 1 + 0 + 2 = 5 of 8; layer 1: 8 of 8
    assert s["value_whole_per_layer"] == [5 / 8, 8 / 8]


@pytest.mark.usefixtures("single_thread")
def test_run_dumps_every_recipe_and_task_and_refuses_tasks_without_needles(tok, books):
    model = tiny_llama(len(tok))
    task = RulerTask(tok, tasks=["niah_single_2", "niah_multikey_1"], lengths=[900], samples=1, data=books,
                     max_new_tokens=2)
    payload = run_ruler_needles(model, tok, ["full", "local"], 0.2, task, command="evictlayers needles ...")
    assert list(payload["summary"]) == ["full", "local"]
    assert list(payload["summary"]["local"]) == ["all", "niah_single_2", "niah_multikey_1"]
    assert payload["summary"]["full"]["all"]["value_whole"] == 2  # one answer per prompt, all held
    assert "| local | niah_multikey_1 |" in markdown(payload)
    assert profile([[2, 2], [2, 1], [0, 0]], 2) == "#+."
    with pytest.raises(ValueError, match="vt are not"):
        run_ruler_needles(model, tok, ["full"], 0.2, RulerTask(tok, tasks=["vt"], lengths=[600], samples=1))


@pytest.mark.parametrize("argv, expected", [
    (["--task", "ruler", "--haystack", "prose"], "--haystack does not apply to --task ruler"),
    (["--lengths", "1024"], "--lengths does not apply to --task passkey"),
    (["--task", "ruler", "--ruler-tasks", "vt"], "invalid choice: 'vt'"),
])
def test_cli_options_belong_to_their_task(capsys, argv, expected):
    with pytest.raises(SystemExit):
        main(["needles", "full", "--out", "unused", *argv])
    assert expected in capsys.readouterr().err
