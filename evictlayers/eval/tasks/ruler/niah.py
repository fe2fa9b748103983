"""RULER's needle-in-a-haystack family (``scripts/data/synthetic/niah.py``): single, multi-key,
multi-value and multi-query needles in noise, essay or needle haystacks.

Each needle is "One of the special magic {numbers|uuids} for {key} is: {value}."; the question asks
for the values of ``num_queries`` of the ``max(num_keys, num_queries)`` keys. Haystacks:

- ``noise``: RULER's repeated sentence block, one per line; the needles replace nothing, they are
  inserted at seeded random lines;
- ``essay``: book sentences (:mod:`.sources`); each needle goes between two sentences at a depth drawn
  from RULER's 40 evenly spaced depths (0..100%);
- ``needle``: lines that are all needles with other keys and values (the distractors of
  ``niah_multikey_2`` and ``_3``).

A fixed ``depth`` (percent, for a prompt with one needle: the needle heat map) puts the needle after
``floor(units * depth / 100)`` of the haystack's units (essay sentences, noise lines) instead of a drawn
depth, as RULER's fixed ``insertion_percentage`` does: 0 = before the first unit, 100 = after the last.

Deviation: RULER draws distractor keys and values independently and could, rarely, repeat an asked
key or an answer; here every key and value in one prompt is distinct, so an asked key occurs in
exactly one needle and every answer value in exactly one place.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from evictlayers.eval.tasks.ruler.prompt import Parts, join_queries
from evictlayers.eval.tasks.ruler.sources import NOISE, Books, distinct, essay_sentences, random_key

__all__ = ["DEPTHS", "NEEDLE", "niah_sampler"]

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.round(np.linspace(0, 100, 40))


def _template(kind: str, plural: bool, query: str) -> tuple[str, str, str]:
    """(intro, question, answer prefix); RULER turns its plural wording singular when one value is asked."""
    if plural:
        intro = (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 f"I will quiz you about the {kind} afterwards.\n")
        return (intro, f"What are all the special magic {kind} for {query} mentioned in the provided text?",
                f" The special magic {kind} for {query} mentioned in the provided text are")
    one = kind[:-1]
    intro = (f"A special magic {one} is hidden within the following text. Make sure to memorize it. "
             f"I will quiz you about the {one} afterwards.\n")
    return (intro, f"What is the special magic {one} for {query} mentioned in the provided text?",
            f" The special magic {one} for {query} mentioned in the provided text is")


def niah_sampler(args: Mapping, seed: str, books: Books | None, depth: int | None = None):
    """``(make, smallest)``: ``make(n)`` builds the sample ``seed`` with a haystack of ``n`` units (essay
    words, noise lines or distractor needles); ``depth`` (0..100, one needle only): where the needle goes
    (default: drawn, as RULER does).

    Raises:
        ValueError: a ``depth`` outside 0..100, or for a prompt with several needles.
    """
    key_kind, value_kind, haystack = args["key"], args["value"], args["haystack"]
    k, v, q = args["num_keys"], args["num_values"], args["num_queries"]
    k = max(k, q)  # RULER: at least as many keys as questions
    if depth is not None:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 100:
            raise ValueError(f"needle depth {depth!r}: expected a whole percentage from 0 to 100")
        if k * v != 1 or haystack == "needle":
            raise ValueError("a needle depth needs a prompt with one needle, in an essay or noise haystack")
    words = books.vocabulary if books is not None else None

    def make(n: int) -> Parts:
        rng = random.Random(seed)  # the same draws for every n: only the haystack's size changes
        taken: set[str] = set()
        keys = distinct(rng, lambda r: random_key(r, key_kind, words), k, taken)
        values = [distinct(rng, lambda r: random_key(r, value_kind, words), v, taken) for _ in keys]
        needles = [NEEDLE.format(kind=value_kind, key=key, value=x) for key, xs in zip(keys, values) for x in xs]
        rng.shuffle(needles)
        asked = rng.sample(range(k), q)
        answers = tuple(x for i in asked for x in values[i])
        if haystack == "essay":
            book, start = books.start(rng)
            sentences = essay_sentences(books.words_from(book, start, n))
            depths = rng.sample(DEPTHS, len(needles)) if depth is None else [depth]
            cuts = [0, *sorted(len(sentences) * d // 100 for d in depths), len(sentences)]
            pieces = []
            for i in range(1, len(cuts)):
                pieces.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            text = " ".join(p for p in pieces if p)
        else:
            if haystack == "noise":
                lines = [NOISE] * n
            else:
                keys_d = distinct(rng, lambda r: random_key(r, key_kind, words), n, taken)
                values_d = distinct(rng, lambda r: random_key(r, value_kind, words), n, taken)
                lines = [NEEDLE.format(kind=value_kind, key=a, value=b) for a, b in zip(keys_d, values_d)]
            # a fixed depth may be n: after the last line
            spots = rng.sample(range(n), len(needles)) if depth is None else [n * depth // 100]
            # from the last position down, so each needle lands at its drawn line of the original list
            for index, needle in zip(sorted(spots, reverse=True), needles):
                lines.insert(index, needle)
            text = "\n".join(lines)
        intro, question, prefix = _template(value_kind, q * v > 1, join_queries([keys[i] for i in asked]))
        return Parts(context=f"{intro}{text}\n", question=question, answer_prefix=prefix, answers=answers,
                     haystack=n)

    # noise and needle haystacks need a line per needle to insert at; an essay at least a few words
    return make, (k * v if haystack != "essay" else 8)
