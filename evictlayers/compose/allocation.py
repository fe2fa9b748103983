"""Per-layer budget allocation: how a policy's budget is split across the model's layers.

The policy budget is the *mean* per-layer budget; an allocation gives each layer a weight (the
weights average to 1) and rounds with the largest-remainder method, so the layers' budgets add up to
exactly ``budget * num_layers`` for every row. ``sliding`` is the set of the model's sliding-window
layers (indices), for the allocations that weigh layers by kind; ``Induction`` weighs them by what the
model's heads do, measured when ``evictlayers.apply`` patches it.
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
        ideal = self.weights(num_layers, sliding).to(budget.device)[:, None] * budget.double()[None, :]
        floor = ideal.floor().long()
        short = budget * num_layers - floor.sum(0)  # [B] tokens still to hand out
        # largest remainders first; ties go to the later layer (stable order on the reversed index)
        order = (ideal - floor).flip(0).argsort(dim=0, descending=True, stable=True)
        order = num_layers - 1 - order
        bonus = (torch.arange(num_layers, device=budget.device)[:, None] < short[None, :]).long()
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


class Induction(Allocation):
    """More budget to the layers whose heads retrieve: a layer's weight is ``floor + s_l / max(s)``,
    rescaled to mean 1, where ``s_l`` is the layer's *induction score* (below).

    RazorAttention (Tang et al., 2024, "Retrieval heads") finds the heads that retrieve from far back in the context
    by feeding the model a sequence of random tokens repeated twice: an *induction* head attends, from the
    second copy's token ``t``, to the token that followed ``t``'s first copy (the head that copies a
    passkey's next digit does exactly that). RazorAttention keeps the whole cache for such heads and
    compresses the others. This allocation does the same per layer, since the slot store's budget is
    per layer: ``s_l`` is the largest induction score among the layer's heads (the attention the second
    copy's queries give to the token after their first copy, averaged over the copy; ``scores``) and
    layers with none keep ``floor / (floor + 1)`` of the budget the strongest layer gets. Deviations: no
    echo heads, and budgets rather than a full cache (the total stays ``budget * num_layers``).

    Not from the seed papers. Why: a needle dump of SmolLM2-135M at 20% (docs/benchmarks.md,
    "Tuning and held-out splits") found every answer the model still gave held whole in one of layers
    18-22; the induction probe, which sees no haystack prompt, ranks layers 18, 17, 23 and 20 first on
    that model and Gemma 3 270M's three full-attention layers first on that one.

    ``evictlayers.apply`` measures ``scores`` on the model it patches (``hf/induction.py``) when they are
    not given; a recipe may pin them (one number per layer, ``>= 0``).
    """

    param_names = ("floor", "scores")

    def __init__(self, floor: float = 0.5, scores: list[float] | tuple[float, ...] | None = None):
        super().__init__()
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0.0:
            raise ValueError(f"Induction(floor={floor!r}): floor must be a number > 0")
        self.floor = float(floor)
        if scores is not None:
            bad = not isinstance(scores, (list, tuple)) or not scores or any(
                isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0.0 for s in scores
            )
            if bad:
                raise ValueError(
                    f"Induction(scores={scores!r}): scores must be a non-empty list of numbers >= 0, one per layer"
                )
            scores = [float(s) for s in scores]
        self.scores = scores

    def weights(self, num_layers: int, sliding: frozenset[int] = frozenset()) -> torch.Tensor:
        if self.scores is None:
            raise ValueError(
                "Induction(): no induction scores yet; evictlayers.apply measures them on the model it patches "
                "(pass scores=[...], one per layer, to split a budget without a model)"
            )
        if len(self.scores) != num_layers:
            raise ValueError(
                f"Induction(scores=...): {len(self.scores)} scores for a model of {num_layers} layers; measure them "
                "on this model (evictlayers.apply does when scores are not given)"
            )
        scores = torch.tensor(self.scores, dtype=torch.float64)
        top = scores.max()
        weights = self.floor + (scores / top if top > 0 else torch.zeros_like(scores))
        return weights * (num_layers / weights.sum())
