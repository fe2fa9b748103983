"""Per-layer budget allocation: how a policy's budget is split across the model's layers.

The policy budget is the *mean* per-layer budget; an allocation gives each layer a weight (the
weights average to 1) and rounds with the largest-remainder method, so the layers' budgets add up to
exactly ``budget * num_layers`` for every row.
"""

from __future__ import annotations

import torch

from evictlayers.core import Component


class Allocation(Component):
    """Splits a budget across layers."""

    def weights(self, num_layers: int) -> torch.Tensor:
        """``[L]`` float64 weights with mean 1."""
        raise NotImplementedError

    def layer_budgets(self, budget: torch.Tensor, num_layers: int) -> torch.Tensor:
        """``[L, B]`` int64 budgets: ``budget`` ``[B]`` per layer on average, summing to ``budget * L``."""
        ideal = self.weights(num_layers)[:, None] * budget.double()[None, :]
        floor = ideal.floor().long()
        short = budget * num_layers - floor.sum(0)  # [B] tokens still to hand out
        # largest remainders first; ties go to the later layer (stable order on the reversed index)
        order = (ideal - floor).flip(0).argsort(dim=0, descending=True, stable=True)
        order = num_layers - 1 - order
        bonus = (torch.arange(num_layers)[:, None] < short[None, :]).long()
        return floor.scatter_add(0, order, bonus)


class Uniform(Allocation):
    """Every layer gets the same budget."""

    def weights(self, num_layers: int) -> torch.Tensor:
        return torch.ones(num_layers, dtype=torch.float64)


class _Linear(Allocation):
    param_names = ("spread",)

    def __init__(self, spread: float = 0.5):
        super().__init__()
        if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not 0.0 <= spread < 1.0:
            raise ValueError(f"{type(self).__name__}(spread={spread!r}): spread must be a number in [0, 1)")
        self.spread = float(spread)

    def _ramp(self, num_layers: int) -> torch.Tensor:
        if num_layers == 1:
            return torch.ones(1, dtype=torch.float64)
        return 1.0 - self.spread + 2.0 * self.spread * torch.arange(num_layers, dtype=torch.float64) / (num_layers - 1)


class Ramp(_Linear):
    """Later layers get more: weights rise linearly from ``1 - spread`` to ``1 + spread``.

    Scissorhands (Sec. 4.1 "Allocating Budgets", Fig. 2): later layers show lower persistence of
    importance, so "allocate more budget to later layers"; the total is preserved.
    """

    def weights(self, num_layers: int) -> torch.Tensor:
        return self._ramp(num_layers)


class Pyramid(_Linear):
    """Earlier layers get more: weights fall linearly from ``1 + spread`` to ``1 - spread``
    (PyramidKV's shape: attention is broad in early layers and concentrated later)."""

    def weights(self, num_layers: int) -> torch.Tensor:
        return self._ramp(num_layers).flip(0)
