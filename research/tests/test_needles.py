"""The passkey needle dumps (:mod:`research.passkey_needles`): the pass key's token span, the per-head count of its tokens a
cache holds, and the summary, checked against a character tokenizer, a recent window whose kept
positions follow from the budget, and hand-counted records."""

from __future__ import annotations

import pytest
import torch
import evictlayers as el
from research.passkey_needles import held_key_tokens, key_token_indices, summarize
from test_eval_helpers import char_tokenizer
from tiny_models import build, single_thread  # noqa: F401


def test_key_tokens_are_the_first_occurrence_of_the_key():
    text = "the pass key is 40213. remember it. what is the pass key? 40213"
    assert key_token_indices(char_tokenizer(), text, "40213") == list(range(16, 21))
    with pytest.raises(ValueError, match="does not occur"):
        key_token_indices(char_tokenizer(), text, "99999")


def test_held_key_tokens_count_what_a_recent_window_keeps():
    model = build("llama")  # 2 layers, 2 KV heads
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), el.apply(model, el.Policy(el.RecentWindow(), budget=10)) as run:
        cache = run.new_cache()
        model(input_ids=ids, past_key_values=cache)
        # the window keeps positions 20..29: none of 5..7, both of 25..26, one of 19..20
        assert held_key_tokens(cache, [5, 6, 7]) == [[0, 0], [0, 0]]
        assert held_key_tokens(cache, [25, 26]) == [[2, 2], [2, 2]]
        assert held_key_tokens(cache, [19, 20]) == [[1, 1], [1, 1]]


def test_summary_counts_heads_and_layers():
    records = [
        {"correct": True, "key_tokens": 2, "held": [[2, 2], [2, 0]]},  # 3 of 4 heads whole, 1 none
        {"correct": False, "key_tokens": 2, "held": [[1, 0], [2, 0]]},  # 1 whole, 1 part, 2 none
    ]
    summary = summarize(records)
    assert (summary["correct"], summary["n"]) == (1, 2)
    assert summary["whole"] == 4 / 8 and summary["partial"] == 1 / 8 and summary["none"] == 3 / 8
    assert summary["whole_per_layer"] == [2 / 4, 2 / 4]
    assert summary["whole_when_right"] == 3 / 4 and summary["whole_when_wrong"] == 1 / 4
