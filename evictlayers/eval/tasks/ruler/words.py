"""RULER's aggregation tasks: common-words extraction (``common_words_extraction.py``) and frequent-words
extraction (``freq_words_extraction.py``).

``cwe``: a numbered list of words in which ``num_cw`` words appear ``freq_cw`` times and the others
``freq_ucw`` times (below a 4096-token length, RULER's 6 and 1); the answer is the ``num_cw`` common
words. One worked example comes first (40 words, 10 and 3 repeats; below 4096 tokens 20 words, 3
and 1). Words come from the books' vocabulary (:mod:`.sources`) where RULER uses ``wonderwords``.

``fwe``: a text of random six-letter coded words whose counts follow a Zipf (zeta) law with exponent
``alpha``, over a vocabulary of ``(length - tokens to generate) // 50`` words; the most frequent one
is replaced by the noise word ``...``, and the answer is the next three.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Mapping, Sequence

from evictlayers.eval.tasks.ruler.prompt import Parts
from evictlayers.eval.tasks.ruler.sources import distinct

__all__ = ["cwe_sampler", "fwe_sampler", "zeta", "zipf_counts"]

_CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
              "Memorize the ones that appear most often.\n")


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _word_list(rng: random.Random, vocabulary: Sequence[str], n: int, common: int, rare: int, num_cw: int):
    chosen = rng.sample(vocabulary, n)
    listed = chosen[:num_cw] * common + chosen[num_cw:] * rare
    rng.shuffle(listed)
    return _numbered(listed), tuple(chosen[:num_cw])


def cwe_sampler(args: Mapping, seed: str, vocabulary: Sequence[str], length: int):
    """``(make, smallest)``: ``make(n)`` lists ``n`` distinct words."""
    num_cw = args["num_cw"]
    short = length < 4096  # RULER's smaller repeats below 4k tokens
    shot_n, shot_common, shot_rare = (20, 3, 1) if short else (40, 10, 3)
    common, rare = (6, 1) if short else (args["freq_cw"], args["freq_ucw"])
    question = f"Question: What are the {num_cw} most common words in the above list?"
    prefix = f" Answer: The top {num_cw} words that appear most often in the list are:"

    def make(n: int) -> Parts:
        if n > len(vocabulary):
            raise ValueError(f"cwe: a {length}-token list needs more than the {len(vocabulary)} distinct words the "
                             "books give; add books (--data-dir) or use a shorter length")
        rng = random.Random(seed)
        shot_list, shot_answer = _word_list(rng, vocabulary, shot_n, shot_common, shot_rare, num_cw)
        listed, answer = _word_list(rng, vocabulary, n, common, rare, num_cw)
        shot = (f"{_CWE_INTRO}{shot_list}\n{question}", f"{prefix} {_numbered(shot_answer)}")
        return Parts(context=f"{_CWE_INTRO}{listed}\n", question=question, answer_prefix=prefix, answers=answer,
                     shots=(shot,), haystack=n)

    return make, num_cw + 1


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha), alpha > 1: a partial sum plus the Euler-Maclaurin tail (relative error < 1e-12)."""
    head = math.fsum(k**-alpha for k in range(1, terms))
    n = float(terms)
    return head + n ** (1 - alpha) / (alpha - 1) + n**-alpha / 2 + alpha * n ** (-alpha - 1) / 12


def zipf_counts(n: int, vocab_size: int, alpha: float) -> list[int]:
    """RULER's counts: ``int(n * k^-alpha / zeta(alpha))`` for ranks k = 1..vocab_size."""
    z = zeta(alpha)
    return [int(n * k**-alpha / z) for k in range(1, vocab_size + 1)]


def fwe_sampler(args: Mapping, seed: str, length: int, tokens_to_generate: int):
    """``(make, smallest)``: ``make(n)`` writes the coded text for ``n`` words (RULER's ``num_words``)."""
    alpha, wordlen = float(args["alpha"]), int(args["coded_wordlen"])
    if alpha <= 1:
        raise ValueError(f"fwe alpha must be > 1 (a zeta distribution), got {alpha}")
    vocab_size = (length - tokens_to_generate) // 50
    if vocab_size < 5:
        raise ValueError(f"fwe: length {length} is too short: RULER's vocabulary of (length - {tokens_to_generate}) // 50 "
                         f"words must hold at least 5 (length >= {tokens_to_generate + 250})")
    # the smallest n at which the three answers' counts are all above the fifth word's (no ties for third)
    smallest = 1
    while True:
        counts = zipf_counts(smallest, vocab_size, alpha)
        if counts[1] > counts[2] > counts[3] > counts[4]:
            break
        smallest += 1
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"

    def make(n: int) -> Parts:
        rng = random.Random(seed)
        vocab = sorted(distinct(rng, lambda r: "".join(r.choices(string.ascii_lowercase, k=wordlen)), vocab_size, set()))
        rng.shuffle(vocab)
        vocab[0] = "..."  # RULER: the top rank is noise
        text = [w for w, c in zip(vocab, zipf_counts(n, vocab_size, alpha)) for _ in range(c)]
        rng.shuffle(text)
        context = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                   f"frequently appeared coded words. {' '.join(text)}\n")
        return Parts(context=context, question=question, answer_prefix=prefix, answers=tuple(vocab[1:4]), haystack=n)

    return make, smallest
