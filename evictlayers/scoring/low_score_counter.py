"""Scissorhands' importance record (Liu et al., 2023, Algorithm 2): how often a token was unimportant."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView
from evictlayers.scoring.windowed import check_window, write_ring


class LowScoreCounter(ScoreAccumulator):
    """``I_j = #{i in the last w query rows : a_{i,j} < threshold_i}``; the most often unimportant go first.

    Scissorhands Algorithm 2 (lines 2-4): over a history window of the last ``window`` steps, count how
    many times each token received attention below the threshold ``1/t`` ("an average score", Sec. 3.2);
    the drop step keeps ``Argsort(I)[:-m]``, i.e. evicts the ``m`` tokens with the highest counts. The
    score is therefore ``-I`` (higher = keep); the drop amount ``m`` is the policy's ``drop`` option
    (``Policy(..., drop=0.5)`` is the paper's ``m = 0.5 B``). The record is maintained at every step (the
    alternative the paper gives under "Overhead Tradeoff": "maintaining the importance record during
    generation steps") in a ring of the last ``window`` rows per slot, so it is exact while decoding; at
    prefill the last ``window`` prompt rows are counted.

    Details:

    - ``threshold="1/t"``: ``t`` is the number of tokens seen at that query (its position + 1), so a row
      is judged against its own step. A float is a fixed probability threshold ``alpha`` in ``(0, 1]``.
    - A row counts for a token only if the token was in the cache at that row and visible to it (not
      from the future): a token inserted later has no entry for earlier rows, so newer tokens are judged
      on fewer rows, as in the paper where ``I`` starts at zero for them.
    - GQA: the threshold is per query head. With ``gqa_reduce="sum"`` the group's reduced probability
      sums to ``G`` per query, so the threshold is multiplied by ``G`` (the group's mean probability is
      below ``1/t``); ``"mean"`` compares the mean with ``1/t`` unchanged (the same test); ``"max"``
      compares the group's maximum with ``1/t``, i.e. a token is unimportant only if it is below the
      threshold in every head of the group.
    - The recent window, ``I[-r:] <- 0`` in Algorithm 2 (printed as ``I[:-r]``; the text says "setting
      the counter for all tokens in the recent window r to 0"): give the policy a ``RecentWindow(r)``,
      which protects those slots outright, the same as a zero count whenever at least ``m`` older tokens
      are left to drop.
    - Tie-break (deterministic): among equal counts the newest token is evicted first. That is
      ``Argsort(I)[:-m]`` taken literally with a stable sort (ties in index order, the last ``m`` of the
      ascending order dropped), and it fits the counter: a newer token reached the same count over fewer
      observed rows, so it was unimportant at a higher rate. The score is
      ``-(I * N + rank)``, ``rank`` = the slot's position rank among the head's ``N`` slots; it is an exact
      float32 integer while ``window * N < 2**24`` (beyond that, ties may break in coarser position groups;
      the counts still order correctly).
    """

    param_names = ("window", "threshold")
    nonnegative = False  # the score is minus a count: it cannot be weighted by a prior
    reads_mass = False  # the last rows only

    def __init__(self, window: int = 32, threshold: str | float = "1/t"):
        super().__init__()
        self.window = check_window("LowScoreCounter", "window", window)
        if isinstance(threshold, str):
            if threshold.replace(" ", "") != "1/t":
                raise ValueError(
                    f"LowScoreCounter(threshold={threshold!r}): expected \"1/t\" or a number in (0, 1]"
                )
            threshold = "1/t"
        elif isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(f"LowScoreCounter(threshold={threshold!r}): expected \"1/t\" or a number in (0, 1]")
        elif not 0.0 < threshold <= 1.0:
            raise ValueError(f"LowScoreCounter(threshold={threshold!r}): a number threshold must be in (0, 1]")
        else:
            threshold = float(threshold)
        self.threshold = threshold

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:  # type: ignore[override]
        return {"low": (self.window,)}

    @property
    def rows_needed(self) -> int:  # type: ignore[override]
        return self.window

    def row_thresholds(self, row_pos: torch.Tensor, group_size: int, gqa_reduce: str) -> torch.Tensor:
        """``[B, R]`` threshold each row's reduced probabilities are compared with."""
        if self.threshold == "1/t":
            base = 1.0 / (row_pos.clamp(min=0) + 1).double()
        else:
            base = torch.full(row_pos.shape, self.threshold, dtype=torch.float64, device=row_pos.device)
        scale = group_size if gqa_reduce == "sum" else 1
        return (base * scale).float()

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        rows, row_pos = observation.rows, observation.row_pos  # [B, H, R, N], [B, R]
        threshold = self.row_thresholds(row_pos, observation.group_size, observation.gqa_reduce)
        visible = view.valid[:, :, None, :] & (view.pos[:, :, None, :] <= row_pos[:, None, :, None])
        low = (rows < threshold[:, None, :, None]) & visible
        write_ring(state["low"], low.float(), row_pos)

    def counts(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, H, N]`` the importance record ``I``: low-score rows within the history window."""
        return state["low"].sum(-1)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        n_slots = view.pos.shape[-1]
        rank = view.pos.argsort(dim=-1, stable=True).argsort(dim=-1)  # 0 = oldest (empty slots first)
        return -(self.counts(state) * n_slots + rank.float())
