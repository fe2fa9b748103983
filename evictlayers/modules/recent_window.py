"""The most recent tokens (H2O's "recent" half, the Local baseline, StreamingLLM's window)."""

from __future__ import annotations

import torch

from evictlayers.modules.protection import Protection
from evictlayers.scoring import SlotView


class RecentWindow(Protection):
    """Keeps the ``size`` most recent tokens of each row.

    ``size`` is an ``int`` number of tokens, a ``float`` in ``(0, 1]`` (that fraction of the layer
    budget, rounded down: H2O's recipe is ``RecentWindow(0.5)``, Appendix A "the last K entries are the
    most recent tokens"), or ``None``: whatever the policy's other protections leave, which makes
    ``Policy(RecentWindow(), budget=...)`` the Local baseline and, beside ``SinkTokens``, StreamingLLM.
    """

    param_names = ("size",)

    def __init__(self, size: int | float | None = None):
        super().__init__()
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, (int, float)):
                raise TypeError(f"RecentWindow(size={size!r}): size must be an int, a float in (0, 1] or None")
            if isinstance(size, int) and size < 0:
                raise ValueError(f"RecentWindow(size={size}): an int size must be >= 0 tokens")
            if isinstance(size, float) and not 0.0 < size <= 1.0:
                raise ValueError(f"RecentWindow(size={size}): a float size is a fraction of the budget, in (0, 1]")
        self.size = size

    def fixed_size(self) -> int | None:
        return self.size if isinstance(self.size, int) else None

    def reserved(self, budget: torch.Tensor, reserved_by_others: torch.Tensor) -> torch.Tensor:
        if self.size is None:
            # never negative: a budget below the other protections must fail the policy's fit check
            return (budget - reserved_by_others).clamp(min=0)
        if isinstance(self.size, float):
            return torch.floor(budget.double() * self.size).long()
        return torch.full_like(budget, self.size)

    def protect(self, view: SlotView, reserved: torch.Tensor) -> torch.Tensor:
        return view.valid & (view.pos >= (view.seen - reserved)[:, None, None])
