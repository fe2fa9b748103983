"""``python -m research.needles --task ruler``: each answer's needle located in the prompt's tokens, the
per-head count of its tokens a cache holds (a recent window whose kept positions follow from the
budget, and the full cache), what the question's attention ranks (against the whole prompt's eager
attention), hand-counted summaries, and the command line's errors."""

from __future__ import annotations

import pytest
import torch

import evictlayers as el
from evictlayers.eval.suite import RulerTask
from evictlayers.eval.tasks.documents import read_texts
from evictlayers.eval.tasks.ruler import ruler_samples
from evictlayers.eval.tasks.ruler.sources import Books
from research.needles import main
from research.ruler_needles import (
    dump_ruler_prompt, markdown, needle_spans, profile, question_attention, question_profile, ranking_layers,
    run_ruler_needles, summarize_answers, summarize_question,
)
from test_eval_helpers import char_tokenizer, tiny_llama, tiny_mistral
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


def _last_row_attention(model, ids):
    """``[L][H, n]``: the last token's attention in one eager forward of the whole prompt."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    return [a[0, :, -1] for a in attentions]


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("build", [lambda v: tiny_llama(v), lambda v: tiny_mistral(v, sliding_window=200)],
                         ids=["llama", "mistral-sliding-200"])
def test_question_attention_is_the_last_rows_attention_and_its_top_ranks(tok, books, build):
    model = build(len(tok))
    sample = _sample(tok, books)
    spans = needle_spans(tok, sample.text, sample.input_ids, sample.answers, chat=False)
    ids = torch.tensor([list(sample.input_ids)])
    top = 150
    answers = question_attention(model, ids, spans, top)
    assert model.config._attn_implementation == "sdpa"  # restored
    reference = _last_row_attention(model, ids)
    assert len(answers) == len(spans) == 4
    for answer, span in zip(answers, spans):
        value = span["value_tokens"]
        for layer, row in enumerate(reference):
            torch.testing.assert_close(torch.tensor(answer["value_mass"][layer]), row[:, value].sum(-1),
                                       atol=1e-4, rtol=0)  # kept to 4 decimals
            for head in range(row.shape[0]):
                # the head's top tokens by a full sort, only those it attends to at all
                order = row[head].argsort(descending=True)[:top]
                chosen = {int(j) for j in order if row[head, j] > 0}
                assert answer["value_ranked"][layer][head] == sum(j in chosen for j in value)
    if getattr(model.config, "sliding_window", None):
        # a needle older than the window gets no attention, so no head ranks it, even with a top over the window
        n = ids.shape[1]
        old = [i for i, span in enumerate(spans) if span["value_tokens"][-1] < n - 200]
        assert old
        wide = question_attention(model, ids, spans, n)
        for i in old:
            assert wide[i]["value_ranked"] == [[0] * len(layer) for layer in wide[i]["value_ranked"]]
    with pytest.raises(ValueError, match="top must be >= 1"):
        question_attention(model, ids, spans, 0)


def test_question_summary_and_profile_count_heads_by_hand():
    answers = [
        {"value_tokens": 2, "value_ranked": [[2, 0], [1, 1]], "value_mass": [[0.5, 0.1], [0.2, 0.3]]},
        {"value_tokens": 3, "value_ranked": [[0, 0], [3, 3]], "value_mass": [[0.0, 0.0], [0.4, 0.7]]},
        {"value_tokens": 1, "value_ranked": [[0, 0], [0, 0]], "value_mass": [[0.0, 0.1], [0.0, 0.0]]},
    ]
    s = summarize_question(answers)
    assert (s["answers"], s["whole_somewhere"]) == (3, 2)
    assert s["head_share"] == 3 / 12
    assert s["whole_per_layer"] == [1 / 6, 2 / 6]
    assert s["largest_mass"] == pytest.approx((0.5 + 0.7 + 0.1) / 3)
    assert [question_profile(a["value_ranked"], a["value_tokens"]) for a in answers] == ["#+", ".#", ".."]


def test_ranking_layers_are_those_with_at_least_half_the_largest_share():
    # SmolLM2's tuning dump, rounded: layers 21 and 22 lead (45% and 36%), layer 18 has 14%
    shares = [0.0] * 18 + [0.14, 0.09, 0.10, 0.45, 0.36, 0.10] + [0.05] * 6
    assert ranking_layers(shares) == [21, 22]
    assert ranking_layers([0.2, 0.1, 0.1]) == [0, 1, 2]
    assert ranking_layers([0.0, 0.0]) == [] and ranking_layers([]) == []


def test_summary_counts_answers_heads_and_layers():
    def answer(found, value_held, key_held):
        return {"found": found, "value_tokens": 2, "key_tokens": 1, "value_held": value_held, "key_held": key_held}

    records = [
        {"task": "a", "answers": [answer(True, [[2, 2], [2, 2]], [[1, 1], [1, 1]]),   # whole, key whole, found
                                  answer(False, [[2, 1], [2, 2]], [[1, 1], [1, 1]])]},  # cut in one head
        {"task": "b", "answers": [answer(True, [[0, 0], [2, 2]], [[0, 0], [1, 1]]),   # cut, found anyway
                                  answer(False, [[2, 2], [2, 2]], [[1, 0], [1, 1]])]},  # whole, key cut, not found
    ]
    records[1]["answers"][0]["question_whole"] = True  # cut, yet the question ranks it
    records[0]["answers"][0]["question_whole"] = True  # whole: not counted among the cut
    s = summarize_answers(records)
    assert (s["answers"], s["found"], s["value_whole"], s["key_and_value_whole"]) == (4, 2, 2, 1)
    assert s["cut_question_whole"] == (1, 2)
    assert s["value_head_share"] == (4 + 3 + 2 + 4) / 16
    assert s["found_when_whole"] == (1, 2) and s["found_when_cut"] == (1, 2)
    # layer 0: heads holding both value tokens 2 + 1 + 0 + 2 = 5 of 8; layer 1: 8 of 8
    assert s["value_whole_per_layer"] == [5 / 8, 8 / 8]


@pytest.mark.usefixtures("single_thread")
def test_run_dumps_every_recipe_and_task_and_refuses_tasks_without_needles(tok, books):
    model = tiny_llama(len(tok))
    task = RulerTask(tok, tasks=["niah_single_2", "niah_multikey_1"], lengths=[900], samples=1, data=books,
                     max_new_tokens=2)
    payload = run_ruler_needles(model, tok, ["full", "local"], 0.2, task, command="python -m research.needles ...")
    assert list(payload["summary"]) == ["full", "local"]
    assert list(payload["summary"]["local"]) == ["all", "niah_single_2", "niah_multikey_1"]
    assert payload["summary"]["full"]["all"]["value_whole"] == 2  # one answer per prompt, all held
    assert "| local | niah_multikey_1 |" in markdown(payload)
    # the question's ranking: the budget's tokens of each prompt, every answer once, its flag on each recipe's record
    assert [q["top"] for q in payload["question"]] == [round(0.2 * r["prompt_tokens"]) for r in payload["records"]["full"]]
    assert payload["question_summary"]["all"]["answers"] == 2
    for records in payload["records"].values():
        for q, r in zip(payload["question"], records):
            for a, held in zip(q["answers"], r["answers"]):
                assert held["question_whole"] == any(c == a["value_tokens"] for layer in a["value_ranked"] for c in layer)
    assert "| niah_single_2 | 1 |" in markdown(payload)
    # the suggested ranking layers: those with at least half the largest share; with no head ranking a value
    # whole, none (not CrossLayer(layers=[]), which CrossLayer refuses)
    payload["question_summary"]["all"]["whole_per_layer"] = [0.5, 0.1]
    assert "`CrossLayer(layers=[0])`" in markdown(payload)
    payload["question_summary"]["all"]["whole_per_layer"] = [0.0, 0.0]
    assert "CrossLayer(layers=" not in markdown(payload) and "none: no query head ranks" in markdown(payload)
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
        main(["full", "--out", "unused", *argv])
    assert expected in capsys.readouterr().err
