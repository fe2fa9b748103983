"""Per-layer budget allocation: how a policy's budget is split across the model's layers.

The policy budget is the *mean* per-layer budget; an allocation gives each layer a weight (the
weights average to 1) and rounds with the largest-remainder method, so the layers' budgets add up to
exactly ``budget * num_layers`` for every row. ``sliding`` is the set of the model's sliding-window
layers (indices), for the allocations that weigh layers by kind.
"""

from __future__ import annotations

import torch

from evictlayers.core import Component


class Allocation(Component):
    """Splits a budget across layers."""

    def weights(self, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
        """``[L]`` float64 weights with mean 1."""
        raise NotImplementedError

    def layer_budgets(self, budget: torch.Tensor, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
        """``[L, B]`` int64 budgets: ``budget`` ``[B]`` per layer on average, summing to ``budget * L``."""
        ideal = self.weights(num_layers, sliding)[:, None] * budget.double()[None, :]
        floor = ideal.floor().long()
        short = budget * num_layers - floor.sum(0)  # [B] tokens still to hand out
        # largest remainders first; ties go to the later layer (stable order on the reversed index)
        order = (ideal - floor).flip(0).argsort(dim=0, descending=True, stable=True)
        order = num_layers - 1 - order
        bonus = (torch.arange(num_layers)[:, None] < short[None, :]).long()
        return floor.scatter_add(0, order, bonus)


class Uniform(Allocation):
    """Every layer gets the same budget."""

    def weights(self, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
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

    def weights(self, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
        return self._ramp(num_layers)


class Pyramid(_Linear):
    """Earlier layers get more: weights fall linearly from ``1 + spread`` to ``1 - spread``
    (PyramidKV's shape: attention is broad in early layers and concentrated later)."""

    def weights(self, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
        return self._ramp(num_layers).flip(0)


class ByLayerKind(Allocation):
    """A sliding-window layer gets ``sliding`` times a full-attention layer's budget (weights rescaled to
    mean 1, so the model holds as many tokens in all as under ``Uniform``); a model without sliding-window
    layers gets ``Uniform``'s budgets.

    Not from the seed papers. Why: a sliding-window layer attends to its last ``window`` tokens only, so
    the long-range tokens a small budget must choose among are the full-attention layers'. Measured on
    Gemma 3 270M (15 sliding-window layers of 512 tokens, 3 full-attention layers), streamed perplexity
    over two 1,025-token windows of the tuning split's books at 20%, ``tova_keydiff_chunk5`` against the
    full cache: +13.9% under ``Uniform``, +9.3% / +9.4% / +8.1% / +29% with ``sliding`` 0.5 / 0.35 / 0.25
    / 0.1 (below ~100 tokens the sliding layers lose what their window still shows); 0.25 is the default
    (docs/benchmarks.md, "Tuning and held-out splits", has the commands and the held-out figures). A
    sliding layer's budget above its ``window - 1`` is capped there (``SlotStore``); the excess is not
    handed to other layers.
    """

    param_names = ("sliding",)

    def __init__(self, sliding: float = 0.25):
        super().__init__()
        if isinstance(sliding, bool) or not isinstance(sliding, (int, float)) or not 0.0 < sliding <= 1.0:
            raise ValueError(f"ByLayerKind(sliding={sliding!r}): sliding must be a number in (0, 1]")
        self.sliding = float(sliding)

    def weights(self, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
        outside = sorted(i for i in sliding if not 0 <= i < num_layers)
        if outside:
            raise ValueError(f"ByLayerKind: sliding-window layers {outside} are not among the {num_layers} layers")
        weights = torch.ones(num_layers, dtype=torch.float64)
        weights[sorted(sliding)] = self.sliding
        return weights * (num_layers / weights.sum())
