"""Scissorhands' and AhaKV's scorers written as plainly as the papers state them: one head, plain Python.

Independent of the library: Python lists, dicts and per-row softmax over the tokens present. The cache
runs as the slot store does (a multi-token step keeps the best ``budget`` tokens, a one-token step over
the budget drops ``drop`` at once), and every scorer is computed from its equation over the full
history of attention rows:

- Windowed (AhaKV Eq. 5): ``S_j = sum_{i in last r rows} a_{i,j}``; with ``reduce="max"``,
  ``S_j = max_{i in last r rows} a_{i,j}`` (0 when no row saw ``j``);
- LowScoreCounter (Scissorhands Alg. 2): ``I_j = #{i in last w rows : j present and visible at i,
  a_{i,j} < 1/t_i}``, ``t_i = i + 1``; drop the highest counts, the newest first among equal counts;
- SG-softmax (AhaKV Eq. 9, 12): row ``i`` scores with ``softmax(lambda_i * q_i . k_j)``,
  ``lambda_i = sqrt(2 log(t_i / k) / d)`` on the raw dot product (the model's ``1 / sqrt(d)`` while
  ``t_i <= k``);
- value prior (AhaKV Eq. 13-15): ``nu_j = ||v_j||^2`` averaged over the neighbours ``|i - j| <= pool//2``
  that shared the cache with ``j``, divided by its maximum over the tokens held, times the score.

Protected tokens (the last ``recent``, the first ``sinks``) are kept first; if the drop amount exceeds
the unprotected tokens, protected ones leave oldest first.
"""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread for a test module (import this fixture to use it): these tiny ops gain
    nothing from threads, and on a busy 2-core machine OpenMP spinning makes them several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a.tolist(), b.tolist()))


def sg_lambda(i: int, budget: int | None, d: int) -> float:
    """AhaKV Eq. 12, ``lambda = sqrt(2 log(t / k) / d)`` on the raw dot product of the query at position ``i``
    (``t = i + 1`` tokens seen); while ``t <= k`` (no real solution) and without a budget, the model's own
    ``1 / sqrt(d)``."""
    t = i + 1
    if budget is None or t <= budget:
        return 1.0 / math.sqrt(d)
    return math.sqrt(2 * math.log(t / budget) / d)


class ReferenceCache:
    """One head under a budget, fed chunk by chunk.

    ``scorer`` is ``("cumulative",)``, ``("windowed", r)``, ``("windowed_max", r)`` or ``("low", w, threshold)`` with threshold
    ``"1/t"`` or a float; ``sg`` turns on SG-softmax; ``pool`` (odd) turns on the value prior.
    """

    def __init__(self, q, k, v, *, budget: int | None, scorer: tuple, recent: int = 0, sinks: int = 0,
                 drop: int = 1, sg: bool = False, pool: int | None = None):
        self.q, self.k, self.v = q, k, v
        self.d = q.shape[-1]
        self.budget, self.scorer, self.recent, self.sinks, self.drop = budget, scorer, recent, sinks, drop
        self.sg, self.pool = sg, pool
        self.retained: list[int] = []
        self.rows: list[tuple[int, dict[int, float]]] = []  # (query position, {token: probability})
        self.neighbours: dict[int, set[int]] = {}
        self.seen = 0

    # ---- the equations ---------------------------------------------------------------------------

    def attention_row(self, i: int, present: list[int]) -> dict[int, float]:
        visible = [j for j in present if j <= i]
        dots = [_dot(self.q[i], self.k[j]) for j in visible]
        return dict(zip(visible, _softmax([sg_lambda(i, self.budget, self.d) * x for x in dots] if self.sg
                                          else [x / math.sqrt(self.d) for x in dots])))

    def accumulated(self, j: int) -> float:
        if self.scorer[0] == "cumulative":
            return sum(row.get(j, 0.0) for _, row in self.rows)
        if self.scorer[0] == "windowed":
            return sum(row.get(j, 0.0) for _, row in self.rows[-self.scorer[1]:])
        if self.scorer[0] == "windowed_max":
            return max(row.get(j, 0.0) for _, row in self.rows[-self.scorer[1]:])
        raise ValueError(self.scorer)

    def low_count(self, j: int) -> int:
        window, threshold = self.scorer[1], self.scorer[2]
        count = 0
        for i, row in self.rows[-window:]:
            limit = 1.0 / (i + 1) if threshold == "1/t" else threshold
            if j in row and row[j] < limit:
                count += 1
        return count

    def gamma(self, j: int) -> float:
        members = self.neighbours[j]
        return sum(float(self.v[i].pow(2).sum()) for i in members) / len(members)

    def scores(self, tokens: list[int]) -> dict[int, float]:
        """The score of each token in ``tokens`` (the value prior normalises over them)."""
        if self.scorer[0] == "low":
            return {j: -float(self.low_count(j)) for j in tokens}
        score = {j: self.accumulated(j) for j in tokens}
        if self.pool is not None:
            top = max(self.gamma(j) for j in tokens)
            score = {j: self.gamma(j) / top * s for j, s in score.items()}
        return score

    # ---- the cache -----------------------------------------------------------------------------------

    def key(self, j: int, score: dict[int, float]):
        """Sort key, higher = kept longer."""
        if j >= self.seen - self.recent or j < self.sinks:
            return (1, 0.0, j)  # protected; leave oldest first if they must
        # equal counts: the newest goes first (Argsort(I)[:-m], stable); equal float scores: the oldest
        return (0, score[j], -j if self.scorer[0] == "low" else j)

    def step(self, stop: int) -> None:
        """Feed the tokens ``self.seen .. stop-1`` as one step."""
        first = not self.rows
        chunk = list(range(self.seen, stop))
        present = self.retained + chunk
        for i in chunk:
            self.rows.append((i, self.attention_row(i, present)))
        self.seen = stop
        if self.pool is not None:
            half = self.pool // 2
            for j in present:
                self.neighbours.setdefault(j, set()).update(i for i in present if abs(i - j) <= half)
        if self.budget is None:
            self.retained = present
            return
        score = self.scores(present)
        ranked = sorted(present, key=lambda j: self.key(j, score), reverse=True)
        if len(chunk) > 1 or first:
            self.retained = sorted(ranked[: self.budget])
        elif len(present) > self.budget:
            self.retained = sorted(ranked[: len(present) - self.drop])
        else:
            self.retained = present


class ReferenceAlgorithm1:
    """AhaKV Algorithm 1 for one head, as written: Python floats, one generated token at a time.

    ``prefill(n)`` (lines 5-12): ``A`` over the first ``n`` tokens (causal); ``F_s[j] = sum of
    SGsoftmax(A)[i, j]`` over the last ``recent`` rows ``i`` (line 8); ``gamma = AvgPool(||V||^2)`` over the
    prompt, a window of ``pool`` centred on each token, averaged over the neighbours that exist (line 9);
    ``F_hat = gamma / max(gamma) * F_s`` (line 10); keep the last ``recent`` tokens (``S^r``) and the
    ``budget - recent`` best of the others by ``F_hat`` (lines 11-12, ranked by ``F_hat``: line 11's
    ``F_s`` read as the weighted score that line 19 carries on). ``pool=None``: no prior.

    ``generate(i)`` (lines 23-30) for token ``i``: ``A`` = its query against the kept tokens and itself;
    ``F_t = SGsoftmax(A) + F_{t-1}`` (line 27; the new token starts from its own entry); keep the last
    ``recent`` tokens and the best ``budget - recent`` others, i.e. drop the lowest ``F`` of the others
    when over budget (the oldest among equal scores).

    ``SGsoftmax``: ``softmax(lambda_i * q_i . k_j)`` with ``sg_lambda`` (Eq. 12, ``k = budget``).
    """

    def __init__(self, q, k, v, *, budget: int, recent: int, pool: int | None):
        self.q, self.k, self.v = q, k, v
        self.d = q.shape[-1]
        self.budget, self.recent, self.pool = budget, recent, pool
        self.retained: list[int] = []
        self.F: dict[int, float] = {}
        self.seen = 0

    def _row(self, i: int, present: list[int]) -> dict[int, float]:
        visible = [j for j in present if j <= i]
        lam = sg_lambda(i, self.budget, self.d)
        return dict(zip(visible, _softmax([lam * _dot(self.q[i], self.k[j]) for j in visible])))

    def _select(self, tokens: list[int]) -> list[int]:
        recent = [j for j in tokens if j >= self.seen - self.recent]
        others = sorted((j for j in tokens if j < self.seen - self.recent), key=lambda j: (self.F[j], j), reverse=True)
        return sorted(recent + others[: max(self.budget - len(recent), 0)])

    def prefill(self, n: int) -> None:
        tokens = list(range(n))
        self.F = dict.fromkeys(tokens, 0.0)
        for i in tokens[max(n - self.recent, 0):]:
            for j, a in self._row(i, tokens).items():
                self.F[j] += a
        if self.pool is not None:
            half = self.pool // 2
            nu = [float(self.v[j].pow(2).sum()) for j in tokens]
            gamma = [sum(nu[max(j - half, 0) : j + half + 1]) / len(nu[max(j - half, 0) : j + half + 1])
                     for j in tokens]
            top = max(gamma)
            self.F = {j: gamma[j] / top * self.F[j] for j in tokens}
        self.seen = n
        self.retained = tokens if n <= self.budget else self._select(tokens)
        self.F = {j: self.F[j] for j in self.retained}

    def generate(self, i: int) -> None:
        assert i == self.seen
        present = self.retained + [i]
        self.F[i] = 0.0
        for j, a in self._row(i, present).items():
            self.F[j] += a
        self.seen = i + 1
        self.retained = present if len(present) <= self.budget else self._select(present)
        self.F = {j: self.F[j] for j in self.retained}
