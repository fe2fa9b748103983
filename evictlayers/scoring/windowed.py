"""AhaKV's Recent Accumulation (Gu et al., Eq. 5): attention summed over the last ``r`` query rows only
(or its largest single row, ``reduce="max"``)."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView


def check_window(owner: str, name: str, value: object) -> int:
    """``value`` as a window length (an int >= 1), or a ValueError naming it and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be an int >= 1 (query rows)")
    return value


def write_ring(ring: torch.Tensor, rows: torch.Tensor, row_pos: torch.Tensor) -> None:
    """Store each real query row of ``rows`` in the ring of the last ``r`` rows, in place.

    Args:
        ring: ``[B, H, N, r]`` per-slot ring; entry ``s`` holds what the slot got from the real query
            row whose original position is ``s`` modulo ``r``.
        rows: ``[B, H, R, N]`` one value per (query row, slot), ``R <= r``.
        row_pos: ``[B, R]`` original position of each row, ``-1`` for padding (not stored).

    The ring is indexed by the row's original position (the count of real tokens before it), not by its
    column: a padding column never takes the place of a real row, so every batch row keeps exactly its
    own last ``r`` real queries. A step's real rows have consecutive positions, so they never collide.
    """
    batch, heads, n_slots, size = ring.shape
    n_rows = rows.shape[2]
    if n_rows == 0:
        return
    real = row_pos >= 0
    index = torch.where(real, row_pos % size, 0)  # [B, R]
    if n_rows == 1:
        # a decode step: overwrite one column (a padding row writes back what was there), instead of
        # clearing and adding over the whole ring, which writes every column of every slot
        column = index[:, None, None, :].expand(batch, heads, n_slots, 1)
        new = torch.where(real[:, None, None, :], rows.transpose(2, 3).to(ring.dtype), ring.gather(3, column))
        ring.scatter_(3, column, new)
        return
    written = torch.zeros(batch, size, dtype=torch.long, device=ring.device)
    written.scatter_add_(1, index, real.long())
    ring.masked_fill_(written[:, None, None, :] > 0, 0.0)
    source = rows.transpose(2, 3) * real[:, None, None, :]  # [B, H, N, R], padding rows add nothing
    ring.scatter_add_(3, index[:, None, None, :].expand(batch, heads, n_slots, n_rows), source.to(ring.dtype))


class Windowed(ScoreAccumulator):
    """``S_j = sum_{i = n-r+1}^{n} a_{i,j}``: the attention token ``j`` received from the last ``rows``
    query rows only (AhaKV Eq. 5, "Recent Accumulation").

    Every token is scored by the same number of terms, which removes the cumulative score's bias toward
    old tokens (AhaKV Eq. 4: ``E(S_{j+1} - S_j) < 0`` for the full sum). The state is a ring of the last
    ``r`` rows per slot (``[B, H, C, r]``, entry ``position % r``), so the window is exact while decoding:
    a row that leaves the window is overwritten by the row that enters it. At prefill (any multi-token
    step) the last ``r`` rows of the chunk are recorded, so a prompt is scored by its last ``r`` rows as
    in AhaKV Algorithm 1 (line 8, "Recent B_r Token" rows); a token inserted after a row was processed
    has a zero entry for it (it was not there to be attended). Padding rows are skipped: each batch row
    keeps its own last ``r`` real queries.

    Deviation: Algorithm 1 line 27 keeps adding every generated row onto the prefill score
    (``F_t = SGsoftmax(A) + F_{t-1}``); this applies Eq. 5 at every step instead, since the equal number of
    terms is what the paper's bias argument (Sec. 4.1) needs (``evictlayers/recipes/ahakv_windowed.yaml``).
    ``RecentThenCumulative`` is Algorithm 1 as written (``evictlayers/recipes/ahakv.yaml``).

    ``reduce="max"`` (not in AhaKV; an option of this library): ``S_j = max_{i in the window} a_{i,j}``,
    the most attention any one of the last ``rows`` queries gave token ``j``. A sum over a window lets
    the rows that agree outvote the one row that singles a token out; with several needles asked at
    once, each is singled out by a different token of the question (the key it names), so a token one
    row attends to strongly keeps its place however the other rows spread theirs. Measured on RULER's
    tuning split it did worse than the last query alone (docs/benchmarks.md, the fourth search round).
    """

    param_names = ("rows", "reduce")
    reads_mass = False  # the last rows only
    REDUCTIONS = ("sum", "max")

    def __init__(self, rows: int = 32, reduce: str = "sum"):
        super().__init__()
        self.rows = check_window("Windowed", "rows", rows)
        if reduce not in self.REDUCTIONS:
            raise ValueError(f"Windowed(reduce={reduce!r}): reduce must be one of {', '.join(map(repr, self.REDUCTIONS))}")
        self.reduce = reduce

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:  # type: ignore[override]
        return {"window": (self.rows,)}

    @property
    def rows_needed(self) -> int:  # type: ignore[override]
        return self.rows

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        write_ring(state["window"], observation.rows, observation.row_pos)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        window = state["window"]
        return window.amax(-1) if self.reduce == "max" else window.sum(-1)
