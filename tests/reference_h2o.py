"""H2O Algorithm 1 written as plainly as the paper states it: one head, one token at a time.

Independent of the library: plain Python lists and per-token softmax. Accumulation starts with the
first query (as the authors' code does; see scoring/cumulative.py for the deviation note), and an
optional recent window protects the last ``recent`` tokens (Appendix A: "the last K entries").
"""

from __future__ import annotations

import math

import torch


def h2o_reference(query: torch.Tensor, key: torch.Tensor, budget: int, recent: int = 0, averaged: bool = False):
    """Run H2O over ``query``/``key`` (``[n, d]``) and return the retained set after every step."""
    n, d = query.shape
    retained: list[int] = []
    score: dict[int, float] = {}
    history: list[set[int]] = []
    for i in range(n):
        candidates = retained + [i]
        logits = [float(query[i] @ key[j]) / math.sqrt(d) for j in candidates]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        score[i] = 0.0
        for j, w in zip(candidates, weights):
            score[j] += w / total
        if len(candidates) > budget:
            protected = {j for j in candidates if j > i - recent}
            def rank(j):
                return score[j] / (i + 1 - j) if averaged else score[j]
            victim = min((j for j in candidates if j not in protected), key=rank)
            candidates.remove(victim)
        retained = candidates
        history.append(set(retained))
    return history
