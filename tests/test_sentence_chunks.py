"""Sentence chunks (``HeavyHitterSelector(..., refine=[SentenceScores(cap)])``): where each token's
sentence starts, from the sentence-end marks, against a plain loop; the selection against a loop over the
held tokens' sentence sums; the tokenizer's sentence-end table; the errors a user meets."""

from __future__ import annotations

import pytest
import torch

import evictlayers as el
from evictlayers.hf.sentences import sentence_end_table
from reference_retrieval import keynorm_scores
from tiny_models import VOCAB, CharTokenizer, build, left_padded, single_thread  # noqa: F401


def reference_starts(ends: list[bool]) -> list[int]:
    """Where each token's sentence starts: the position after the last end before it (0 for the first)."""
    starts, start = [], 0
    for position, end in enumerate(ends):
        starts.append(start)
        if end:
            start = position + 1
    return starts


def reference_sums(scores: dict[int, float], starts: list[int], cap: int, reduce: str = "sum") -> dict[int, float]:
    """Each held token's score becomes the sum (or mean) over the held tokens of its sentence piece: the
    sentence cut into runs of ``cap`` tokens counted from its start."""
    def piece(j: int) -> tuple[int, int]:
        return starts[j], (j - starts[j]) // cap
    out = {}
    for j in scores:
        members = [v for i, v in scores.items() if piece(i) == piece(j)]
        out[j] = sum(members) / (len(members) if reduce == "mean" else 1)
    return out


def _held(store: el.SlotStore, row: int = 0, head: int = 0) -> set[int]:
    pos = store.pos[row, head]
    return set(pos[pos >= 0].tolist())


@pytest.mark.parametrize("cap,budget,reduce", [(32, 12, "sum"), (4, 9, "sum"), (3, 20, "sum"), (32, 12, "mean"),
                                              (4, 9, "mean")], ids=str)
def test_sentence_selection_matches_reference(cap, budget, reduce):
    """A 30-token prefill then one token a step; every ~5th token ends a sentence (some sentences longer
    than ``cap``): the held set after every step is the reference's (lowest piece sum out, oldest first)."""
    torch.manual_seed(cap * 13 + budget)
    n, prompt, d = 48, 30, 8
    keys = torch.randn(1, n, d) * 2
    q, v = torch.randn(1, n, d), torch.randn(1, n, d)
    ends = (torch.rand(n) < 0.2).tolist()
    starts = reference_starts(ends)
    options = {"cap": cap} if cap != 32 else {}  # 32: the default
    if reduce != "sum":
        options["reduce"] = reduce
    selector = el.HeavyHitterSelector(el.KeyNorm(), refine=[el.SentenceScores(**options)])
    store = el.SlotStore(el.Policy(selector, budget=budget))
    held = []
    expected = []
    for start, stop in [(0, prompt)] + [(i, i + 1) for i in range(prompt, n)]:
        marks = torch.tensor([ends[start:stop]])
        store.step(q[None, :, start:stop], keys[None, :, start:stop], v[None, :, start:stop], scaling=d**-0.5,
                   sentence_ends=marks)
        held.append(_held(store))
        candidates = (expected[-1] if expected else set()) | set(range(start, stop))
        scores = reference_sums(keynorm_scores(keys[0], sorted(candidates)), starts, cap, reduce)
        expected.append(set(sorted(candidates, key=lambda j: (-scores[j], -j))[:budget]))
    assert held == expected


def test_sentence_starts_follow_the_marks_across_steps_and_padding():
    """Two left-padded rows, a prefill in two chunks, then decode steps: every held slot's sentence start
    is the plain loop's over that row's real tokens (padding neither ends nor starts a sentence)."""
    torch.manual_seed(2)
    lengths, steps, d = [17, 11], 9, 8
    width = max(lengths)
    real = torch.tensor([[i >= width - n for i in range(width)] for n in lengths])
    real = torch.cat([real, torch.ones(2, steps, dtype=torch.bool)], dim=1)
    total = real.shape[1]
    marks = torch.rand(2, total) < 0.3
    marks[1, 0] = True  # a padding token marked as an end must not count
    q, k, v = (torch.randn(2, 1, total, d) for _ in range(3))
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.KeyNorm(), refine=[el.SentenceScores()]), budget=1000))
    for start, stop in [(0, 10), (10, width)] + [(i, i + 1) for i in range(width, total)]:
        store.step(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], real[:, start:stop],
                   scaling=d**-0.5, sentence_ends=marks[:, start:stop])
    for row in range(2):
        row_marks = marks[row][real[row]].tolist()
        expected = reference_starts(row_marks)
        pos = store.pos[row, 0]
        got = {int(p): int(s) for p, s in zip(pos.tolist(), store.state["sentence_start"][row, 0].tolist()) if p >= 0}
        assert got == dict(enumerate(expected))


def test_sentence_end_table_marks_ids_whose_text_ends_a_sentence():
    table = sentence_end_table(CharTokenizer(), VOCAB + 4)
    text = CharTokenizer.TEXT
    expected = [text[i % len(text)] in ".!?\n" for i in range(VOCAB)] + [False] * 4
    assert table.tolist() == expected
    with pytest.raises(TypeError, match="tokenizer=.*batch_decode"):
        sentence_end_table(object(), VOCAB)


def _sentence_policy(budget=8):
    return el.Policy(el.SinkTokens(1), el.HeavyHitterSelector(el.Windowed(4), refine=[el.SentenceScores(4)]),
                     budget=budget)


def test_apply_marks_sentences_from_the_input_ids():
    """Through a model: after a prefill, each layer's held slots carry the sentence starts the plain loop
    finds from the prompt's ids (the tokenizer's table, looked up per forward, decode steps included)."""
    model = build("llama")
    ids, mask = left_padded([20, 13])
    tokenizer = CharTokenizer()
    table = sentence_end_table(tokenizer, VOCAB)
    with torch.no_grad(), el.apply(model, _sentence_policy(budget=1000), tokenizer=tokenizer) as run:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        cache = run.cache
    for row in range(2):
        tokens = out[row][torch.cat([mask[row].bool(), torch.ones(out.shape[1] - ids.shape[1], dtype=torch.bool)])]
        expected = reference_starts(table[tokens[:-1]].tolist())  # the last token was never fed back
        for layer in cache.layers:
            store = layer.store
            pos = store.pos[row, 0]
            starts = store.state["sentence_start"][row, 0].tolist()
            got = {int(p): int(s) for p, s in zip(pos.tolist(), starts) if p >= 0}
            assert got == dict(enumerate(expected))


def test_sentence_policy_errors_name_what_is_missing():
    model = build("llama")
    with pytest.raises(ValueError, match=r"tokenizer=tokenizer"):
        el.apply(model, _sentence_policy())
    ids, _ = left_padded([12, 12])
    with torch.no_grad(), el.apply(model, _sentence_policy(), tokenizer=CharTokenizer()):
        with pytest.raises(ValueError, match="input_ids"):
            model(inputs_embeds=model.get_input_embeddings()(ids))
    store = el.SlotStore(_sentence_policy())
    x = torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match=r"sentence_ends"):
        store.step(x, x, x, scaling=1.0)
    with pytest.raises(ValueError, match=r"\[B, Q\] = \[1, 6\] bool"):
        store.step(x, x, x, scaling=1.0, sentence_ends=torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"SentenceScores\(reduce='max'\): expected one of \('sum', 'mean'\)"):
        el.SentenceScores(reduce="max")
    with pytest.raises(ValueError, match=r"SentenceScores\(cap=0\): the longest sentence chunk must be an int >= 1"):
        el.SentenceScores(cap=0)


def test_other_policies_ignore_the_tokenizer():
    """A policy that does not rank sentences runs the same with or without a tokenizer."""
    model = build("llama")
    ids, mask = left_padded([20, 13])
    policy = el.Policy(el.SinkTokens(1), el.HeavyHitterSelector(el.Windowed(4), refine=[el.ChunkScores(3)]), budget=8)
    outs = []
    for tokenizer in (None, CharTokenizer()):
        with torch.no_grad(), el.apply(model, policy, tokenizer=tokenizer):
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                       pad_token_id=0))
    assert torch.equal(*outs)


def test_beam_reorder_moves_each_rows_last_sentence_end():
    """Rows [0, 1] reordered to [1, 1] after the prompt (as beam search does) then decoded equal rows
    [1, 1] fed from the start: the sentence a decoded token continues is its new row's."""
    from evictlayers.hf.cache import EvictionLayer

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, 20, 8) for _ in range(3))
    marks = torch.zeros(2, 20, dtype=torch.bool)
    marks[0, 10], marks[1, 4] = True, True  # the rows' last ends before the decode steps differ
    policy = el.Policy(el.HeavyHitterSelector(el.KeyNorm(), refine=[el.SentenceScores(4)]), budget=8)

    def store_after(rows, reorder=None):
        layer = EvictionLayer(policy)
        layer.store.step(q[rows, :, :12], k[rows, :, :12], v[rows, :, :12], scaling=0.3, sentence_ends=marks[rows, :12])
        if reorder is not None:
            layer.reorder_cache(torch.tensor(reorder))
        for i in range(12, 20):
            layer.store.step(q[[1, 1], :, i : i + 1], k[[1, 1], :, i : i + 1], v[[1, 1], :, i : i + 1], scaling=0.3,
                             sentence_ends=marks[[1, 1], i : i + 1])
        return layer.store

    reordered, direct = store_after([0, 1], reorder=[1, 1]), store_after([1, 1])
    assert torch.equal(reordered.pos, direct.pos)
    assert torch.equal(reordered.state["sentence_start"], direct.state["sentence_start"])
