"""Policy: the validated, comparable configuration of what a layer keeps (modules, budget, drop amount,
allocation, storage, positions). What runs at each step is built from it: ``compose/ranking.py`` ranks
the slots, ``compose/store.py`` holds them."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from evictlayers.compose.allocation import Allocation, Uniform
from evictlayers.compose.positions import POSITIONS
from evictlayers.compose.recipe_mapping import RecipeError, policy_arguments, policy_mapping
from evictlayers.compose.selection import SelectorSet
from evictlayers.core import Component
from evictlayers.kernels import GQA_REDUCTIONS
from evictlayers.modules import ClusterSketch, DenseKV, KCenterSelector, Protection, QuantizedKV, RecentWindow, Selector
from evictlayers.scoring import CrossLayer

STORAGES = (DenseKV, QuantizedKV)


def _describe_budget(budget: int | float | None) -> str:
    if budget is None:
        return "budget=None (full cache)"
    return f"budget={budget} {'tokens per head' if isinstance(budget, int) else 'of the prompt'}"


class Policy(nn.Module):
    """Which KV pairs a layer keeps.

    ``Policy(*modules, budget=...)``: protections (``RecentWindow``, ``SinkTokens``) take their slots
    first; an optional selector (``HeavyHitterSelector``) fills the rest by score; without a selector the
    unprotected slots go to the most recent tokens. ``budget`` is an ``int`` number of tokens per KV
    head, a ``float`` in ``(0, 1]`` (that fraction of each row's whole prompt, rounded half up, fixed at
    the cache's first forward, even for a prompt fed in chunks: ``EvictionRun.prefill``), or ``None`` for a full cache that never evicts.
    ``gqa_reduce`` combines the attention mass of the query heads sharing a KV head (sum/mean/max).
    ``storage`` is how the slots hold their keys and values: ``DenseKV()`` (the default, the model
    dtype) or ``QuantizedKV(bits, group, residual)``.
    Several ``HeavyHitterSelector`` may share the unprotected slots, each with a ``share`` (fractions
    summing to 1; ``compose/selection.py``): e.g. half by averaged attention, half by key diversity.
    ``KCenterSelector`` (ClusterGen Sec. 4) is a selector too: beside a ``RecentWindow(l)`` it keeps ``k``
    centres among the older keys, ``budget = l + k`` (Table 2). ``ClusterSketch`` (ClusterGen Algorithm 1)
    is what happens to an evicted token: instead of being forgotten it is absorbed into a fixed-size
    sketch, and attention is the exact slots merged with the sketch; it needs a ``RecentWindow`` (or a
    selector) to say which tokens stay exact.
    ``drop`` is how many tokens go at once when a head exceeds its budget: ``1`` (H2O Algorithm 1,
    at most one eviction per step) or Scissorhands' drop amount ``m`` (Algorithm 2), an ``int`` or a
    ``float`` fraction of the budget (the paper uses ``m = 0.5 B``). ``allocation`` splits the budget
    across layers (``Uniform``, ``Ramp``, ``Pyramid``, ``ByLayerKind``, ``Induction``; the budget is the per-layer
    mean).
    ``min_budget`` (an ``int``, default 32) is the fewest tokens per head a ``float`` budget resolves to:
    a fraction of a short prompt gives ``max(round(fraction * prompt), min_budget)`` (before the
    allocation splits it across layers), and the policy warns, once, the first time the floor lifts a
    budget. 20% of a 4-token prompt is one token per head, too few to generate coherent text from;
    32 holds a few sentences beside the usual protections (4 sinks, a recent window) and binds only
    below 160 prompt tokens at 20% (320 at 10%), so the prompts a fraction is meant for are untouched.
    An ``int`` budget is used as given; ``min_budget=1`` turns the floor off (a fraction still gives
    at least one token, silently).
    ``positions`` is which rotary positions attention sees: ``"absolute"`` (default: each key keeps the
    RoPE of its original position) or ``"rolling"`` (keys held un-rotated and re-rotated to their rank
    among the retained tokens, as StreamingLLM does, so a bounded cache never shows the model a position
    past its trained context; ``compose/positions.py``). Rolling needs a RoPE model.
    ``sliding_modules`` (optional) are the modules of the model's sliding-window layers, which then run
    a policy of their own (``for_layer``) with every other setting shared: budget, allocation, drop,
    storage. A sliding-window layer sees only its last ``window`` tokens, so what to keep there is a
    question of its own (docs/benchmarks.md, "Tuning and held-out splits", measures it on Gemma 3);
    on a model without such layers they are never used.
    """

    def __init__(
        self,
        *modules: nn.Module,
        budget: int | float | None = None,
        min_budget: int = 32,
        drop: int | float = 1,
        allocation: Allocation | None = None,
        gqa_reduce: str = "sum",
        storage: Component | None = None,
        positions: str = "absolute",
        sliding_modules: list[nn.Module] | tuple[nn.Module, ...] | None = None,
    ):
        super().__init__()
        protections: list[Protection] = []
        selectors: list[Selector] = []
        sketches: list[ClusterSketch] = []
        for index, module in enumerate(modules):
            if isinstance(module, Protection):
                protections.append(module)
            elif isinstance(module, ClusterSketch):
                sketches.append(module)
            elif isinstance(module, Selector):
                selectors.append(module)
            else:
                raise TypeError(
                    f"Policy module #{index} is {module!r}; expected a protection (RecentWindow, SinkTokens), "
                    "a selector (HeavyHitterSelector, KCenterSelector) or a ClusterSketch"
                )
        kinds = [type(m).__name__ for m in protections]
        for kind in set(kinds):
            if kinds.count(kind) > 1:
                raise ValueError(f"Policy has {kinds.count(kind)} {kind} modules; give it at most one")
        if len(sketches) > 1:
            raise ValueError(f"Policy has {len(sketches)} ClusterSketch modules; give it at most one")
        selector_set = SelectorSet(selectors) if selectors else None
        self._check_sketch(sketches[0] if sketches else None, protections, selectors)
        kcenters = [m for m in selectors if isinstance(m, KCenterSelector)]
        self._check_kcenter(kcenters[0] if kcenters else None, protections, budget)
        open_ended = [m for m in protections if m.params().get("size", 0) is None]
        if open_ended and selectors:
            raise ValueError(
                "RecentWindow() with no size takes every slot the other protections leave, so "
                f"{type(selectors[0]).__name__} would get none; give RecentWindow a size (int tokens or a "
                "fraction of the budget)"
            )
        self._check_budget(budget)
        if isinstance(min_budget, bool) or not isinstance(min_budget, int) or min_budget < 1:
            raise ValueError(
                f"Policy(min_budget={min_budget!r}): the floor of a fraction budget must be an int >= 1 tokens per "
                "head (1: no floor)"
            )
        self._check_drop(drop, budget)
        if allocation is not None and not isinstance(allocation, Allocation):
            raise TypeError(
                f"Policy(allocation={allocation!r}): expected Uniform(), Ramp(...), Pyramid(...), ByLayerKind(...) or "
                "Induction(...)"
            )
        if gqa_reduce not in GQA_REDUCTIONS:
            raise ValueError(f"Policy(gqa_reduce={gqa_reduce!r}): expected one of {GQA_REDUCTIONS}")
        if storage is not None and not isinstance(storage, STORAGES):
            raise TypeError(
                f"Policy(storage={storage!r}): expected a K/V storage, one of "
                f"{', '.join(cls.__name__ + '()' for cls in STORAGES)}"
            )
        if positions not in POSITIONS:
            raise ValueError(f"Policy(positions={positions!r}): expected one of {POSITIONS}")
        if positions == "rolling" and sketches:
            raise ValueError(
                "Policy(positions='rolling') cannot hold a ClusterSketch: the sketch merges evicted "
                "keys into position-less clusters, so there is no rank to re-rotate them to; use "
                "positions='absolute' with the sketch"
            )
        if positions == "rolling" and selector_set is not None and selector_set.reads_queries:
            readers = sorted({type(getattr(m, "accumulator", m)).__name__ for m in selectors if m.reads_queries})
            raise ValueError(
                f"Policy(positions='rolling') cannot hold {', '.join(readers)}: it predicts future queries by "
                "rotating the step's queries to the positions they will have, and under rolling positions no query "
                "or key sits at its own position; use positions='absolute' with it"
            )
        if selector_set is not None:
            self._check_probes(selector_set, gqa_reduce, positions, bool(sketches))
        # the open-ended RecentWindow reserves last: it takes what the others leave
        self.protections = nn.ModuleList(sorted(protections, key=lambda m: m in open_ended))
        self.selectors = selector_set
        self.sketch = sketches[0] if sketches else None  # absorbs what eviction frees
        self.budget = budget
        self.min_budget = min_budget
        # one warning per policy, the first time the floor lifts a budget (the sliding layers' policy shares it)
        self._floor_warned = [False]
        self.drop = drop
        self.allocation = allocation if allocation is not None else Uniform()
        self.gqa_reduce = gqa_reduce
        self.storage = storage if storage is not None else DenseKV()
        self.positions = positions
        if isinstance(budget, int):
            self._check_fits(torch.tensor([budget]), where=f"budget={budget} tokens per head")
        self.sliding = None if sliding_modules is None else self._sliding_policy(sliding_modules)
        ranked_by = {tuple(p.cross_layer.layers) for p in self.layer_policies if p.cross_layer is not None}
        if len(ranked_by) > 1:
            raise ValueError(
                f"Policy holds CrossLayer scorers with different ranking layers {sorted(ranked_by)}; the model's "
                "layers share one ranking, so give every CrossLayer the same layers"
            )

    def _sliding_policy(self, modules: list[nn.Module] | tuple[nn.Module, ...]) -> Policy:
        """The sliding-window layers' policy: ``modules`` under this policy's other settings."""
        if not isinstance(modules, (list, tuple)):
            raise TypeError(f"Policy(sliding_modules={modules!r}): expected a list of modules")
        try:
            sliding = Policy(*modules, budget=self.budget, min_budget=self.min_budget, drop=self.drop,
                             allocation=self.allocation, gqa_reduce=self.gqa_reduce, storage=self.storage,
                             positions=self.positions)
        except (TypeError, ValueError) as error:
            raise type(error)(f"Policy(sliding_modules=...): {error}") from None
        sliding._floor_warned = self._floor_warned
        return sliding

    def for_layer(self, sliding: bool) -> Policy:
        """The policy a layer runs: ``sliding_modules``' for a sliding-window layer when given, else this one."""
        return self.sliding if sliding and self.sliding is not None else self

    @property
    def cross_layer(self) -> CrossLayer | None:
        """The ``CrossLayer`` scorer a selector of this policy ranks by (the first, where several do: they name
        the same layers), ``None`` without; the model's layers then share one ranking board
        (``compose/cross_layer.py``). The sliding-window layers' policy answers for itself."""
        members = self.selectors.members if self.selectors is not None else []
        scorers = [m.accumulator for m in members if isinstance(getattr(m, "accumulator", None), CrossLayer)]
        return scorers[0] if scorers else None

    @property
    def layer_policies(self) -> tuple[Policy, ...]:
        """Every policy a layer may run (this one, and the sliding-window layers' when it has its own): what
        the model as a whole needs is what any of them needs."""
        return (self,) if self.sliding is None else (self, self.sliding)

    @staticmethod
    def _check_sketch(sketch: ClusterSketch | None, protections: list, selectors: list) -> None:
        """The sketch absorbs what leaves the exact slots, so something must say which tokens stay exact."""
        if sketch is not None and not any(isinstance(m, RecentWindow) for m in protections) and not selectors:
            raise ValueError(
                "ClusterSketch absorbs the tokens that leave the exact slots, so the policy must say which "
                "tokens stay exact: add a RecentWindow (ClusterGen keeps the most recent tokens exact) or a selector"
            )

    @staticmethod
    def _check_probes(selectors: SelectorSet, gqa_reduce: str, positions: str, sketch: bool) -> None:
        """A scorer defined with one GQA reduction gets it; one that scores by probes (``ContextReconstruction``)
        gets a policy whose every selector can observe a probe, absolute positions and no sketch (a probe's tokens
        attend over the held slots as they are, and are never stored)."""
        for member in selectors.members:
            name = type(getattr(member, "accumulator", member)).__name__
            need = member.needs_gqa_reduce
            if need is not None and gqa_reduce != need:
                raise ValueError(
                    f"{name} is defined with the {need} over the query heads of each KV head's GQA group: use "
                    f"Policy(gqa_reduce={need!r}) (got {gqa_reduce!r})"
                )
        if not selectors.requires_probes:
            return
        probed = ", ".join(sorted({type(getattr(m, "accumulator", m)).__name__ for m in selectors.members
                                   if m.requires_probes}))
        blind = [m for m in selectors.members if not m.observes_probes]
        if blind:
            names = ", ".join(f"{type(m).__name__}({m.extra_repr()})" for m in blind)
            raise ValueError(
                f"Policy holds {probed}, which scores tokens by probes (run.compress_context), but {names} cannot "
                "observe a probe (a selector observes one when its accumulator declares observes_probes and it has "
                "no prior, no transform and no refinement with state of its own)"
            )
        if positions == "rolling":
            raise ValueError(
                f"Policy(positions='rolling') cannot hold {probed}: its probes attend at positions after the "
                "context's, which rolling positions re-rank at every step; use positions='absolute'"
            )
        if sketch:
            raise ValueError(
                f"Policy cannot hold both {probed} and a ClusterSketch: a probe attends over the exact slots only "
                "(the sketch merges what eviction absorbed); use a policy without the sketch"
            )

    @staticmethod
    def _check_kcenter(kcenter: KCenterSelector | None, protections: list, budget: Any) -> None:
        """ClusterGen's composition (Sec. 4): a recent window beside the centres, ``budget = l + k``."""
        if kcenter is None:
            return
        if not any(isinstance(m, RecentWindow) for m in protections):
            raise ValueError(
                "KCenterSelector keeps k centres beside the most recent l tokens (ClusterGen Sec. 4, "
                "budget = l + k): add a RecentWindow(l) to the policy"
            )
        if kcenter.centres is None:
            return
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise ValueError(
                f"KCenterSelector(centres={kcenter.centres}) fixes k, so the budget must be the int l + k "
                f"(ClusterGen Table 2); got {_describe_budget(budget)}. Give an int budget, or leave "
                "centres=None to take the share of the budget the protections leave"
            )
        reserved = sum(int(p.reserved(torch.tensor([budget]), torch.tensor([0]))[0]) for p in protections)
        if budget - reserved != kcenter.centres:
            raise ValueError(
                f"KCenterSelector(centres={kcenter.centres}): budget={budget} minus the protected slots "
                f"({reserved}) leaves {budget - reserved} centres; ClusterGen's budget is l + k, so set "
                f"budget={reserved + kcenter.centres} or centres=None"
            )

    @staticmethod
    def _check_budget(budget: Any) -> None:
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"Policy(budget={budget!r}): expected an int (tokens), a float in (0, 1] or None")
        if budget <= 0:
            raise ValueError(f"Policy(budget={budget}): the budget must be positive")
        if isinstance(budget, float) and budget > 1.0:
            raise ValueError(
                f"Policy(budget={budget}): a float budget is a fraction of the prompt, in (0, 1]; "
                "use an int for a number of tokens"
            )

    @staticmethod
    def _check_drop(drop: Any, budget: Any) -> None:
        if isinstance(drop, bool) or not isinstance(drop, (int, float)):
            raise TypeError(f"Policy(drop={drop!r}): expected an int >= 1 (tokens) or a float in (0, 1) of the budget")
        if isinstance(drop, int) and drop < 1:
            raise ValueError(f"Policy(drop={drop}): an int drop amount must be >= 1 token")
        if isinstance(drop, float) and not 0.0 < drop < 1.0:
            raise ValueError(f"Policy(drop={drop}): a float drop amount is a fraction of the budget, in (0, 1)")
        if isinstance(drop, int) and isinstance(budget, int) and 1 < drop >= budget:
            raise ValueError(
                f"Policy(drop={drop}, budget={budget}): the drop amount must be below the budget "
                f"(allowed: 1..{budget - 1} tokens)"
            )

    @property
    def modules_in_order(self) -> list[nn.Module]:
        """The modules as a recipe lists them: protections, the selectors, then the sketch."""
        return [
            *self.protections,
            *(self.selectors.members if self.selectors is not None else []),
            *([self.sketch] if self.sketch is not None else []),
        ]

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is Policy
            and self.modules_in_order == other.modules_in_order
            and self.budget == other.budget
            and type(self.budget) is type(other.budget)
            and self.min_budget == other.min_budget
            and self.drop == other.drop
            and type(self.drop) is type(other.drop)
            and self.allocation == other.allocation
            and self.gqa_reduce == other.gqa_reduce
            and self.storage == other.storage
            and self.positions == other.positions
            and self.sliding == other.sliding
        )

    __hash__ = nn.Module.__hash__

    def replace(self, **changes: Any) -> Policy:
        """A new policy equal to this one but for ``changes``, given as recipe keys (``budget=0.5``,
        ``drop=0.5``, ``positions="rolling"``, ``modules=[...]``): it goes through the recipe mapping, so
        every setting the recipe format knows survives and the result is validated like a loaded recipe.

        Raises:
            RecipeError: a key is unknown or a value is invalid (every problem, naming the changes).
            ValueError: the changed policy is inconsistent (e.g. its protected slots do not fit the budget).
        """
        described = ", ".join(f"{key}={value!r}" for key, value in changes.items())
        return policy_from_dict({**policy_to_dict(self), **changes}, source=f"Policy.replace({described})")

    def extra_repr(self) -> str:
        rolling = ", positions='rolling'" if self.positions == "rolling" else ""
        floor = f", min_budget={self.min_budget}" if isinstance(self.budget, float) else ""
        return f"{_describe_budget(self.budget)}{floor}, drop={self.drop!r}, gqa_reduce={self.gqa_reduce!r}{rolling}"

    # ---- budgets -------------------------------------------------------------------------------

    def reservations(self, budget: torch.Tensor) -> list[torch.Tensor]:
        """Slots each protection reserves per row (``[B]`` int64 each), in ``self.protections`` order."""
        reserved: list[torch.Tensor] = []
        taken = torch.zeros_like(budget)
        for protection in self.protections:
            slots = protection.reserved(budget, taken)
            reserved.append(slots)
            taken = taken + slots
        return reserved

    def _check_fits(self, budget: torch.Tensor, where: str) -> None:
        reserved = self.reservations(budget)
        total = torch.stack(reserved).sum(0) if reserved else torch.zeros_like(budget)
        bad = (total > budget).nonzero().flatten()
        if len(bad):
            row = int(bad[0])
            parts = " + ".join(
                f"{type(p).__name__}({int(r[row])})" for p, r in zip(self.protections, reserved, strict=True)
            )
            raise ValueError(
                f"Policy {where}: a budget of {int(budget[row])} tokens cannot hold the protected slots "
                f"{parts} = {int(total[row])}; raise the budget or shrink the protections"
            )
        if self.selectors is None or len(self.selectors.members) == 1:
            return
        counts = torch.stack(self.selectors.counts(budget - total))  # [selectors, B]
        bad = (counts < 1).any(0).nonzero().flatten()
        if len(bad):
            row = int(bad[0])
            parts = ", ".join(
                f"share {m.share:g} -> {int(c[row])}" for m, c in zip(self.selectors.members, counts, strict=True)
            )
            raise ValueError(
                f"Policy {where}: the {int(budget[row] - total[row])} unprotected slots of a {int(budget[row])}-token "
                f"budget cannot give every selector a slot ({parts}); raise the budget or change the shares"
            )

    def resolve_budget(
        self, prompt_len: torch.Tensor, layer_idx: int = 0, num_layers: int = 1,
        sliding_layers: frozenset[int] = frozenset(),
    ) -> torch.Tensor | None:
        """``[B]`` int64 tokens per KV head of layer ``layer_idx`` for each row, from the rows' real
        prompt lengths ``[B]``; the allocation splits the budget across ``num_layers`` layers, of which
        ``sliding_layers`` (indices) have a sliding window."""
        if self.budget is None:
            return None
        if isinstance(self.budget, int):
            budget = torch.full_like(prompt_len, self.budget)
            where = f"budget={self.budget} tokens per head"
        else:
            fraction = torch.floor(prompt_len.double() * self.budget + 0.5).long().clamp(min=1)  # never none
            budget = fraction.clamp(min=self.min_budget)
            where = f"budget={self.budget} of a {int(prompt_len.max())}-token prompt"
            lifted = fraction < self.min_budget
            if bool(lifted.any()):
                where += f" (at least min_budget={self.min_budget})"
                self._warn_floor(prompt_len[lifted], fraction[lifted])
        if num_layers > 1:
            budget = self.allocation.layer_budgets(budget, num_layers, sliding_layers)[layer_idx]
            where += f", layer {layer_idx} of {num_layers} under {self.allocation!r}"
        if bool((budget < 1).any()):
            raise ValueError(f"Policy {where}: the layer gets {int(budget.min())} tokens; every layer needs >= 1")
        self._check_fits(budget, where=where)
        drop = self.drop_amount(budget)
        too_big = (drop >= budget) & (drop > 1)  # dropping 1 of a 1-token budget is H2O's k = 1
        if bool(too_big.any()):
            row = int(too_big.nonzero()[0])
            raise ValueError(
                f"Policy {where}: drop amount {int(drop[row])} is not below the budget {int(budget[row])}"
            )
        return budget

    def _warn_floor(self, prompt_len: torch.Tensor, fraction: torch.Tensor) -> None:
        """The floor lifted the budgets ``fraction`` ``[n]`` of prompts of ``prompt_len`` ``[n]`` tokens:
        say so, the first time for this policy."""
        if self._floor_warned[0]:
            return
        self._floor_warned[0] = True
        row = int(prompt_len.argmin())
        warnings.warn(
            f"Policy(budget={self.budget}, min_budget={self.min_budget}): {self.budget} of a {int(prompt_len[row])}-"
            f"token prompt is {int(fraction[row])} token(s) per head, below the floor, so each head keeps up to "
            f"{self.min_budget} tokens instead (min_budget=1 turns the floor off; warned once per policy)",
            UserWarning, stacklevel=3,
        )

    def drop_amount(self, budget: torch.Tensor) -> torch.Tensor:
        """``[B]`` int64 tokens evicted at once when a head exceeds ``budget``."""
        if isinstance(self.drop, int):
            return torch.full_like(budget, self.drop)
        return torch.floor(budget.double() * self.drop).long().clamp(min=1)

    # ---- what the steps need ---------------------------------------------------------------------

    @property
    def selector(self) -> Selector | None:
        """The policy's only selector, ``None`` without one (several: see ``selectors``)."""
        if self.selectors is None or len(self.selectors.members) > 1:
            return None
        return self.selectors.members[0]

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state: ``[B, H_kv, C, *shape]`` float32 each, moving with its slot."""
        return self.selectors.state_specs if self.selectors is not None else {}

    @property
    def head_state_specs(self) -> dict[str, tuple[int | str, ...]]:
        """Per-head state: ``[B, H_kv, *shape]`` float32 each (``"head_dim"`` = the key width)."""
        return self.selectors.head_state_specs if self.selectors is not None else {}

    @property
    def rows_needed(self) -> int:
        """How many of a step's last query rows the scorers read individually."""
        return self.selectors.rows_needed if self.selectors is not None else 0

    @property
    def reads_mass(self) -> bool:
        """Whether a scorer reads the summed attention mass (a prefill computes it only then)."""
        return self.selectors.reads_mass if self.selectors is not None else False

    @property
    def decode_needs_mass(self) -> bool:
        """Whether a one-token step's scorers read its attention mass: summed, or as the step's one row."""
        return self.reads_mass or self.rows_needed > 0

    @property
    def reads_keys(self) -> bool:
        """Whether a one-token step's scorers read the slots' keys (a quantised cache dequantises them only then)."""
        return self.selectors.reads_keys if self.selectors is not None else False

    @property
    def reads_values(self) -> bool:
        """Whether a one-token step's scorers read the slots' values (a quantised cache dequantises them only then)."""
        return self.selectors.reads_values if self.selectors is not None else False

    @property
    def reads_queries(self) -> bool:
        """Whether a scorer reads the step's queries and the layer's rotary table (``ExpectedAttention``): the
        slot store then needs the model's rotary table (``evictlayers.apply`` measures it at apply time)."""
        return self.selectors.reads_queries if self.selectors is not None else False

    @property
    def rotary_rows(self) -> int:
        """Rows of the layer's rotary table (positions ``0..n-1``) the scorers read at least, every step."""
        return self.selectors.rotary_rows if self.selectors is not None else 0

    @property
    def observes_probes(self) -> bool:
        """Whether every selector knows a probe step from one that inserts tokens (``Observation.probe``): only
        then may the slot store run one (``SlotStore.probing``). A policy without a selector has nothing to feed."""
        return self.selectors.observes_probes if self.selectors is not None else False

    @property
    def requires_probes(self) -> bool:
        """Whether a scorer's scores mean nothing until probes have run (``ContextReconstruction``): a budgeted
        cache of this policy must then defer eviction at its first step (``run.compress_context`` does)."""
        return self.selectors.requires_probes if self.selectors is not None else False

    @property
    def reads_sentences(self) -> bool:
        """Whether a selector ranks the text's sentences (``SentenceScores``): the slot store then needs
        each token's sentence end mark, which ``evictlayers.apply(..., tokenizer=)`` gives it."""
        return self.selectors.reads_sentences if self.selectors is not None else False

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the logits of the scoring softmax, or ``None`` to score with the model's."""
        return self.selectors.score_gain(query_pos, budget) if self.selectors is not None else None


def policy_from_dict(data: Any, source: str = "<recipe>") -> Policy:
    """Build a Policy from a parsed recipe (``compose/recipe_mapping.py``).

    Raises:
        RecipeError: every problem with the recipe, or the policy's own objection, under ``source``.
    """
    modules, settings = policy_arguments(data, source)
    try:
        return Policy(*modules, **settings)
    except (TypeError, ValueError) as error:
        raise RecipeError(source, [f"policy: {error}"]) from None


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """The recipe mapping of ``policy`` (inverse of ``policy_from_dict``)."""
    return policy_mapping(policy)
