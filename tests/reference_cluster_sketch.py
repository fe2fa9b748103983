"""Slow references for evictlayers/modules/cluster_sketch.py: ClusterGen's Algorithm 1 written as in
the paper (one head, one token at a time, Python lists), and plain greedy k-center.

The coins are the module's documented counter-based hash re-implemented on Python ints, so a head of
the batched module and ``ReferenceStream`` flip the same coins in the same order: coin ``j`` of the
``n``-th token a head absorbs. Algorithm 1 is followed literally, including line 19's separate
"t copies" branch; the additions are the module's documented capacity rule (a key that finds all
``max_clusters`` in use joins its nearest cluster) and its tie rule (distances within a relative
``TIE`` of the best count as equal, the lowest index wins), without which the two could not agree.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
TIE = 1e-4  # the module's documented TIE_TOLERANCE: distances this close (relative) count as equal
GOLDEN32 = 0x9E3779B9


def hash32(x: int) -> int:
    """lowbias32 on a Python int (the module computes it with split 16-bit multiplies in int64)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def salt(seed: int, layer: int = 0) -> int:
    return hash32(hash32((seed ^ GOLDEN32) & MASK32) ^ (layer & MASK32))


def coin(salt_word: int, head: int, counter: int, j: int) -> float:
    """Coin ``j`` of token ``counter`` of ``head``: a uniform in [0, 1)."""
    x = hash32(head ^ salt_word)
    x = hash32(x ^ (counter & MASK32))
    return hash32(x ^ j) / 2.0**32


def sq_dist(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).square().sum())


class ReferenceStream:
    """Algorithm 1 for one (batch row, KV head): ``D`` as a list of ``[x, S, n]``, ``M`` as a list of
    ``s`` entries ``(k, v, ||v||^2)`` or ``None``, ``mu`` a float."""

    def __init__(self, radius: float, t: int, s: int, max_clusters: int, value_dim: int, salt_word: int, head: int):
        self.radius, self.t, self.s, self.max_clusters, self.value_dim = radius, t, s, max_clusters, value_dim
        self.salt_word, self.head = salt_word, head
        self.clusters: list[list] = []
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, float] | None] = [None] * s
        self.mu = 0.0
        self.absorbed = 0
        self.overflow = 0

    def absorb(self, k: torch.Tensor, v: torch.Tensor) -> None:
        coins = [coin(self.salt_word, self.head, self.absorbed, j) for j in range(self.t + self.s)]
        self.update_softmax_normalizer(k, coins[: self.t])
        self.update_matrix_product(k, v, coins[self.t :])
        self.mu += float(v.float().square().sum())  # line 6
        self.absorbed += 1

    def update_softmax_normalizer(self, k: torch.Tensor, coins: list[float]) -> None:
        """Lines 11-21."""
        best = None
        if self.clusters:  # line 11: argmin, the first within TIE of the minimum on (near-)ties
            dists = [sq_dist(x, k) for x, _, _ in self.clusters]
            lowest = min(dists)
            i = next(i for i, d in enumerate(dists) if d <= lowest * (1 + TIE))
            best = (i, dists[i])
        if best is not None and (best[1] <= self.radius**2 or len(self.clusters) == self.max_clusters):
            if best[1] > self.radius**2:
                self.overflow += 1  # capacity rule: join the nearest although farther than delta
            cluster = self.clusters[best[0]]
            cluster[2] += 1  # line 13
            for j in range(self.t):  # lines 15-17
                if coins[j] < 1.0 / cluster[2]:
                    cluster[1][j] = k.clone()
        else:
            self.clusters.append([k.clone(), [k.clone() for _ in range(self.t)], 1])  # lines 19-20

    def update_matrix_product(self, k: torch.Tensor, v: torch.Tensor, coins: list[float]) -> None:
        """Lines 23-27."""
        w = float(v.float().square().sum())
        if self.mu + w == 0:
            return
        p = w / (self.mu + w)
        for i in range(self.s):
            if coins[i] < p:
                self.pairs[i] = (k.clone(), v.clone(), w)

    def query(self, q: torch.Tensor, scaling: float) -> tuple[torch.Tensor, float]:
        """Lines 28-29 in float64: ``(z, tau)``; ``z / tau`` is line 30's output."""
        q = q.double()
        z = torch.zeros(self.value_dim, dtype=torch.float64)
        for pair in self.pairs:
            if pair is not None:
                k, v, w = pair
                z += self.mu / (self.s * w) * math.exp(scaling * float(q @ k.double())) * v.double()
        tau = 0.0
        for _, samples, n in self.clusters:
            tau += n / self.t * sum(math.exp(scaling * float(q @ k.double())) for k in samples)
        return z, tau


def reference_kcenter(keys: torch.Tensor, candidates: torch.Tensor, k: int) -> list[int]:
    """Greedy k-center for one head: ``keys [N, D]``, ``candidates [N]`` bool -> ``k`` slot indices
    (``-1`` when none is left). Start: the candidate farthest from the candidates' mean."""
    pool = [i for i in range(keys.shape[0]) if bool(candidates[i])]
    if not pool:
        return [-1] * k
    mean = keys[pool].float().mean(0)

    def farthest(rest: list[int], score) -> int:
        """The first (lowest index) within TIE of the largest score."""
        scores = {i: score(i) for i in rest}
        top = max(scores.values())
        return min(i for i in rest if scores[i] >= top * (1 - TIE))

    picks = [farthest(pool, lambda i: sq_dist(keys[i], mean))]
    while len(picks) < k:
        rest = [i for i in pool if i not in picks]
        if not rest:
            picks.append(-1)
            continue
        picks.append(farthest(rest, lambda i: min(sq_dist(keys[i], keys[c]) for c in picks if c >= 0)))
    return picks
