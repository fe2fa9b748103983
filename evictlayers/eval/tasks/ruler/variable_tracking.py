"""RULER's variable tracking (``scripts/data/synthetic/variable_tracking.py``): multi-hop tracing.

A chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (``num_hops`` hops, so ``num_hops + 1`` variables
of five random upper-case letters) is scattered, in order, over lines of RULER's noise; the question
gives the number and asks for every variable that ends up holding it. With several chains, only the
first one's value is asked.

As RULER does, one worked example comes first: a chain of three-letter names in noise sized to at
most 500 tokens (the smallest such example where none fits), with its question, answer prefix and
answer, written inside the task input.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping

from evictlayers.eval.tasks.ruler.prompt import Parts, fit
from evictlayers.eval.tasks.ruler.sources import NOISE, distinct

__all__ = ["ICL_TOKENS", "vt_sampler"]

ICL_TOKENS = 500  # RULER sizes its worked example to 500 tokens


def _chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int) -> tuple[list[list[str]], list[str]]:
    """(statements per chain, the first chain's variable names)."""
    names = distinct(rng, lambda r: "".join(r.choices(string.ascii_uppercase, k=name_len)),
                     (num_hops + 1) * num_chains, set())
    values = distinct(rng, lambda r: str(r.randint(10000, 99998)), num_chains, set())  # numpy's randint(10000, 99999)
    chains = []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        # RULER's statements; the trailing space of the copy statements is RULER's too
        chains.append([f"VAR {chain[0]} = {values[c]}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(num_hops)])
    return chains, names[: num_hops + 1]


def _parts(rng: random.Random, n: int, num_chains: int, num_hops: int, name_len: int, before: str = "") -> Parts:
    chains, answer = _chains(rng, num_chains, num_hops, name_len)
    value = chains[0][0].rsplit("= ", 1)[1]
    lines = [NOISE] * n
    for chain in chains:
        # each statement at a seeded line, in chain order (RULER's positions + offset)
        for j, position in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(position + j, chain[j])
    context = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               + "\n".join(lines) + "\n")
    return Parts(
        context=before + context,
        question=f"Question: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=(f" Answer: According to the chain(s) of variable assignment in the text above, "
                       f"{num_hops + 1} variables are assigned the value {value}, they are: "),
        answers=tuple(answer),
        haystack=n,
    )


def vt_sampler(args: Mapping, seed: str, count: Callable[[str], int]):
    """``(make, smallest)`` for sample ``seed``; ``count(text)`` measures plain text (the worked example)."""
    num_chains, num_hops = args["num_chains"], args["num_hops"]
    icl_hops = min(10, num_hops)

    def example(n: int) -> Parts:
        return _parts(random.Random(seed + ":example"), n, num_chains, icl_hops, 3)

    shot = fit(example, lambda p: count(p.context + p.question + p.answer_prefix), ICL_TOKENS, icl_hops + 1,
               "vt worked example", strict=False)
    # RULER: the example with its answer and a newline, then a newline, then the task
    before = shot.context + shot.question + shot.answer_prefix + " " + " ".join(shot.answers) + "\n\n"

    def make(n: int) -> Parts:
        return _parts(random.Random(seed), n, num_chains, num_hops, 5, before)

    return make, num_hops + 1
