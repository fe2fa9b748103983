"""StreamingLLM's attention sinks: the first tokens of the sequence."""

from __future__ import annotations

import torch

from evictlayers.modules.protection import Protection
from evictlayers.scoring import SlotView


class SinkTokens(Protection):
    """Keeps the first ``count`` real tokens of each row (positions ``0 .. count-1``).

    StreamingLLM (Xiao et al., 2023; the H2O paper's streaming baseline) keeps 4 such "attention
    sinks" beside a recent window. Padding is not counted: a left-padded row keeps its own first tokens.
    """

    param_names = ("count",)

    def __init__(self, count: int = 4):
        super().__init__()
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"SinkTokens(count={count!r}): count must be an int >= 1")
        self.count = count

    def fixed_size(self) -> int:
        return self.count

    def reserved(self, budget: torch.Tensor, reserved_by_others: torch.Tensor) -> torch.Tensor:
        return torch.full_like(budget, self.count)

    def protect(self, view: SlotView, reserved: torch.Tensor) -> torch.Tensor:
        return view.valid & (view.pos < reserved[:, None, None])
