"""Plain-loop references for the retrieval scorers and selection options.

One head, Python lists, scores recomputed from scratch at every step (no running state): KeyDiff
(Park et al. 2025: evict the key most similar, by cosine, to the mean normalised key of the cache),
key norm (Devoto et al. 2024: evict the largest key norm), SnapKV-style pooling of scores over
neighbouring positions, and a budget split between selectors by share.
"""

from __future__ import annotations

import math

import torch


def keydiff_scores(keys: torch.Tensor, held: list[int]) -> dict[int, float]:
    """``-cos(k_j, mean_i k_i/|k_i|)`` over the held tokens, from scratch."""
    unit = [keys[j] / keys[j].norm() for j in held]
    anchor = torch.stack(unit).sum(0)
    return {j: -float(keys[j] @ anchor) / float(keys[j].norm() * anchor.norm()) for j in held}


def keynorm_scores(keys: torch.Tensor, held: list[int]) -> dict[int, float]:
    return {j: -float(keys[j].norm()) for j in held}


def pooled(scores: dict[int, float], width: int, reduce: str, side: str = "both") -> dict[int, float]:
    """Each held token's score replaced by the mean/max over the ``width`` held tokens around it in
    position order (``side="both"``), or over it and the ``width - 1`` held tokens before it
    (``"before"``); fewer at the ends."""
    order = sorted(scores)
    before, after = (width - 1, 0) if side == "before" else (width // 2, width // 2)
    out = {}
    for i, j in enumerate(order):
        window = [scores[order[m]] for m in range(max(0, i - before), min(len(order), i + after + 1))]
        out[j] = max(window) if reduce == "max" else sum(window) / len(window)
    return out


def split_keep(score_fns, shares, candidates: list[int], keep: int, held: list[int] | None = None) -> list[int]:
    """The tokens kept out of ``candidates`` when selectors split ``keep`` slots: the first takes its
    ``round_half_up(share * keep)`` best, the next its best of the rest, ..., the last fills the remainder.
    Scores are computed over ``held`` (all held tokens, protected ones included; default: the candidates)."""
    counts = [math.floor(s * keep + 0.5) for s in shares[:-1]]
    counts.append(keep - sum(counts))
    left, kept = list(candidates), []
    for fn, count in zip(score_fns, counts):
        scores = fn(held if held is not None else candidates)
        best = sorted(left, key=lambda j: (-scores[j], -j))[:count]  # ties: the newest
        kept += best
        left = [j for j in left if j not in best]
    return sorted(kept)


def run_reference(keys: torch.Tensor, prompt: int, budget: int, keep_fn) -> list[set[int]]:
    """Prefill ``prompt`` tokens (keep ``keep_fn(held, budget)``), then one token per step: add it, and
    when over budget keep ``keep_fn(held, budget)``. Returns the retained set after each step."""
    held = list(range(prompt))
    if len(held) > budget:
        held = keep_fn(held, budget)
    history = [set(held)]
    for i in range(prompt, keys.shape[0]):
        held = held + [i]
        if len(held) > budget:
            held = keep_fn(held, budget)
        history.append(set(held))
    return history
