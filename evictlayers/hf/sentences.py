"""Which tokens end a sentence or a line, from the model's tokenizer, for selectors that rank the
text's sentences (``HeavyHitterSelector(..., refine=[SentenceScores()])``)."""

from __future__ import annotations

import torch

SENTENCE_ENDS = ".!?\n"
"""A token ends a sentence when its text holds one of these characters (a full stop, an exclamation or
question mark, a line break): the spans between such tokens are the text's sentences and lines."""


def sentence_end_table(tokenizer, vocab_size: int) -> torch.Tensor:
    """``[max(vocab_size, len(tokenizer))]`` bool, ``True`` at the ids whose decoded text holds a character of
    ``SENTENCE_ENDS``. ``tokenizer``: a transformers tokenizer (anything with ``batch_decode`` and ``len``)."""
    if not callable(getattr(tokenizer, "batch_decode", None)):
        raise TypeError(
            f"evictlayers.apply(tokenizer={type(tokenizer).__name__}): expected the model's transformers tokenizer "
            "(with batch_decode), used to find the tokens that end a sentence"
        )
    count = len(tokenizer)
    texts = tokenizer.batch_decode([[token] for token in range(count)])
    table = torch.zeros(max(vocab_size, count), dtype=torch.bool)
    table[:count] = torch.tensor([any(end in text for end in SENTENCE_ENDS) for text in texts], dtype=torch.bool)
    return table
