"""Where RULER's haystacks and random items come from, offline.

- **Noise**: RULER's repeated sentence block, one per line.
- **Essay**: RULER concatenates Paul Graham's essays (downloaded by its scripts); here the words come
  from the PG-19 sample books read at run time (:func:`evictlayers.eval.tasks.documents.read_texts`),
  each sample from its own seeded book and sentence start, whitespace collapsed as RULER does.
- **Words**: RULER draws NIAH keys as adjective-noun pairs and common-words lists from the
  ``wonderwords`` package's lists. Here both come from one vocabulary computed from the books
  (:func:`vocabulary`): lowercase alphabetic words of 4 to 10 letters seen at least twice, without the
  100 most frequent (mostly function words), sorted. A key is two such words joined by a hyphen, so
  keys look like RULER's ("word-word") but are not adjective-noun pairs.
- Numbers (7 digits), UUIDs (version 4 from 128 seeded random bits) and variable names (upper-case
  letters) are drawn as RULER draws them, from the sample's seeded generator.
"""

from __future__ import annotations

import collections
import random
import re
import uuid
from collections.abc import Sequence

__all__ = [
    "NOISE", "Books", "distinct", "essay_sentences", "random_key", "random_number", "random_uuid", "vocabulary",
]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_WORD = re.compile(r"(?<![\w'-])[a-z]+(?![\w'-])")
# sentence ends: . ! ? optionally followed by one closing quote or bracket, then whitespace (RULER uses
# nltk's punkt; a regular expression needs no download and splits prose nearly the same way)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]\u201d\u2019])\s+")


def vocabulary(texts: Sequence[tuple[str, str]], drop_most_common: int = 100) -> list[str]:
    """Sorted words of the books for keys and word lists (see the module docstring)."""
    counts = collections.Counter()
    for _, text in texts:
        counts.update(_WORD.findall(text))
    common = {w for w, _ in counts.most_common(drop_most_common)}
    return sorted(w for w, c in counts.items() if c >= 2 and 4 <= len(w) <= 10 and w not in common)


class Books:
    """The books, split into words once (whitespace collapsed), and their vocabulary."""

    def __init__(self, texts: Sequence[tuple[str, str]]):
        if not texts:
            raise ValueError("RULER's essay haystacks and word lists need at least one book")
        self.names = [name for name, _ in texts]
        self.words = [text.split() for _, text in texts]
        empty = [n for n, w in zip(self.names, self.words) if len(w) < 100]
        if empty:
            raise ValueError(f"book(s) {empty} have fewer than 100 words; give longer plain-text books")
        self.vocabulary = vocabulary(texts)

    def start(self, rng: random.Random) -> tuple[int, int]:
        """A seeded (book, word index) at a sentence start."""
        book = rng.randrange(len(self.words))
        words = self.words[book]
        i = rng.randrange(len(words))
        for _ in range(len(words)):  # walk to the word after a sentence end
            if words[(i - 1) % len(words)][-1:] in ".!?":
                break
            i = (i + 1) % len(words)
        return book, i

    def words_from(self, book: int, start: int, n: int) -> list[str]:
        """``n`` words of ``book`` from ``start``, wrapping round to its beginning when it runs out (RULER
        repeats its essays the same way when a haystack needs more words than they have)."""
        words = self.words[book]
        return [words[(start + i) % len(words)] for i in range(n)]


def essay_sentences(words: Sequence[str]) -> list[str]:
    """The sentences of the text the words make (RULER inserts its needles between sentences)."""
    return [s for s in _SENTENCE_END.split(" ".join(words).strip()) if s]


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_key(rng: random.Random, kind: str, words: Sequence[str] | None) -> str:
    """A key or value of ``kind`` (``numbers``, ``uuids`` or ``words``: two vocabulary words)."""
    if kind == "numbers":
        return random_number(rng)
    if kind == "uuids":
        return random_uuid(rng)
    if kind == "words":
        return f"{rng.choice(words)}-{rng.choice(words)}"
    raise ValueError(f"unknown needle kind {kind!r}; expected numbers, uuids or words")


def distinct(rng: random.Random, draw, count: int, taken: set[str]) -> list[str]:
    """``count`` draws of ``draw(rng)`` unlike each other and anything in ``taken`` (which grows), so that
    an asked key or an answer value occurs in exactly one needle."""
    out = []
    for _ in range(count):
        for _ in range(1000):
            item = draw(rng)
            if item not in taken:
                break
        else:
            raise ValueError(f"could not draw {count} distinct items; the vocabulary is too small")
        taken.add(item)
        out.append(item)
    return out
