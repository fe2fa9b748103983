"""AhaKV's step-gain softmax (Gu et al., Eq. 9-12): score with a temperature that grows with the context."""

from __future__ import annotations

import torch

from evictlayers.core import Component


class ScoreTransform(Component):
    """Changes the softmax the scorers see (never the model's output): a factor on the model's logits."""

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the model's (scaled) logits of each query for the scoring softmax, from the
        queries' original positions ``[B, Q]`` (``-1`` = padding) and the layer budget ``[B]``
        (``None`` = full cache); ``None`` scores with the model's own probabilities."""
        raise NotImplementedError


class StepGainSoftmax(ScoreTransform):
    """SG-softmax: the scoring softmax of a query that has seen ``i`` tokens uses the logits scaled so the
    expected attention entropy is ``log k``, the entropy of ``k`` (budget) equally likely tokens.

    AhaKV Eq. 7-12 work with the raw dot product ``w = Q_i^T K_j``: with Gaussian ``w`` of variance ``d``
    (unit-variance query/key entries; Appendix A) the expected entropy of ``softmax(lambda * w)`` is
    ``log i - lambda^2 d / 2`` (Eq. 10); asking for ``log k`` (Eq. 11) gives
    ``lambda = sqrt(2 log(i/k) / d)`` (Eq. 12). The kernel multiplies its factor onto the model's logits,
    which are already scaled: ``QK / sqrt(d)`` for nearly every model. Since
    ``lambda * QK = lambda * sqrt(d) * (QK / sqrt(d))``, the factor is

        gain(i) = lambda * sqrt(d) = sqrt(2 log(i / k)),

    independent of ``d``. (Sanity check: the model's own ``1/sqrt(d)`` is ``gain = 1``, logits of unit
    variance, expected entropy ``log i - 1/2``; the gain above brings it to ``log i - log(i/k) = log k``.)
    Algorithm 1 writes ``SGsoftmax(A)`` with ``A = QK^T / sqrt(d)`` already scaled; applying the full
    ``lambda`` on top of that would scale by ``1/sqrt(d)`` twice and miss the entropy target of Eq. 11, so
    we follow the derivation. For a model with another logit scale (e.g. Gemma's ``query_pre_attn_scalar``)
    the model's own scaled logits play the role of ``QK / sqrt(d)``.

    ``i`` is the number of tokens seen at that query (its position + 1, counting evicted ones, as the
    paper's ``i`` counts every token of the row) and ``k`` the layer's per-head budget. While ``i <= k``,
    ``log(i/k) <= 0`` and Eq. 12 has no real solution; there is also no dilution to correct (the row
    spreads its mass over at most ``k`` tokens), so, as with a full cache, the scorer keeps the model's
    own softmax: gain 1. From ``i = k + 1`` on the gain is Eq. 12's ``sqrt(2 log(i/k))``; it drops there
    to about ``sqrt(2/k)`` (0.14 for ``k = 102``), stays below 1 (flatter than the model's softmax, as
    Eq. 11 asks) up to ``i = sqrt(e) k`` and grows after. With ``budget=None`` (full cache) there is no
    ``k``: no transform, the scorers see the model's probabilities.

    Why not gain 0 (uniform: the maximum entropy, the closest to ``log k``) while ``i <= k``: those rows
    are not over when eviction starts. ``Windowed(r)`` still holds them for the first ``r`` evictions,
    ``Cumulative`` and ``RecentThenCumulative`` for good, and a uniform row gives every older token the
    same ``1/i``. In a streamed run (one token per step from the first, eviction from ``i = k + 1``) the
    attention part of the score would then be flat among the unprotected slots exactly when eviction
    begins, and a multiplicative ``ValuePrior`` would rank them alone: on a streamed PG-19 window the
    priority then follows the prior almost exactly at the first evictions, which drop the stream's attention
    sinks (small ``||v||``) first. With the model's own softmax below the budget (gain 1) the attention keeps
    its say and the sinks stay. ``tests/test_ahakv_stream.py`` pins this.

    Deviation: the gain for ``i <= k`` is ours. In the paper's setting (a prompt longer than the budget)
    every scored row has ``i > k``.
    """

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        if budget is None:
            return None
        seen = (query_pos + 1).clamp(min=1).double()  # padding (-1) -> 1, its row is masked anyway
        ratio = seen / budget.to(query_pos.device).clamp(min=1).double()[:, None]
        gain = torch.sqrt(2.0 * torch.log(ratio).clamp(min=0.0))
        return torch.where(ratio > 1.0, gain, 1.0).float()  # i <= k: the model's own softmax
