"""Heavy-hitter selection: keep the slots with the highest score (H2O, Scissorhands, AhaKV)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from evictlayers.modules.heavy_hitter_options import OPTION_DEFAULTS, refinement_arguments
from evictlayers.modules.selector import Selector
from evictlayers.scoring import (
    Observation,
    ScoreAccumulator,
    ScorePrior,
    ScoreRefinement,
    ScoreTransform,
    SlotView,
)


class HeavyHitterSelector(Selector):
    """Fills the slots the protections leave with the highest-scoring tokens, per KV head.

    ``HeavyHitterSelector(accumulator, transform=None, prior=None, refine=(), share=None)``: the
    ``accumulator`` turns the attention each slot receives into a score, an optional ``transform`` changes
    the softmax it scores with (never the model's output), an optional ``prior`` weights the score per
    slot, and the ``refine`` list reworks the score before ranking, each refinement in list order
    (``scoring/refinement.py``); the policy evicts the lowest-scoring unprotected slots (H2O Algorithm 1
    line 12: removing the minimum-score token maximises ``F_score`` of what stays).

    - ``HeavyHitterSelector(Cumulative())``: H2O (Algorithm 1); ``Averaged()``: its normalised variant;
    - ``HeavyHitterSelector(LowScoreCounter(window=w))`` with ``Policy(..., drop=0.5)``: Scissorhands;
    - ``HeavyHitterSelector(Windowed(32), StepGainSoftmax(), ValuePrior())``: AhaKV with Eq. 5 at every
      step (recipe ``ahakv_windowed``); ``HeavyHitterSelector(RecentThenCumulative(32), StepGainSoftmax())``
      is Algorithm 1 as written (recipe ``ahakv``);
    - ``HeavyHitterSelector(KeyDiff())`` / ``KeyNorm()``: key-geometry scores that need no attention;
    - ``refine=[PooledScores(5)]``: SnapKV's pooling; ``[ChunkScores(10)]``: ChunkKV;
      ``[SentenceScores(32)]``: chunks that are the text's sentences; ``[LayerScope()]``: TOVA's ranking,
      every KV head of the layer keeping the same tokens (last in the list).

    ``share=f``: the fraction of the unprotected slots this selector fills when a Policy holds several
    selectors (see ``Policy``); ``None`` (the default) for a policy's only selector.

    The options that came before ``refine`` (``pool``, ``pool_reduce``, ``pool_side``, ``chunk``,
    ``sentence_cap``, ``chunk_reduce``, ``scope``, ``scope_reduce``) are still taken as keyword arguments,
    with a ``DeprecationWarning`` naming the ``refine`` list they stand for (``heavy_hitter_options.py``),
    and build a selector equal to that one; recipes written with them load without a warning.
    """

    param_names = ("accumulator", "transform", "prior", "refine", "share")
    DEFAULTS = {"transform": None, "prior": None, "refine": [], "share": None}

    def __init__(
        self,
        accumulator: ScoreAccumulator,
        transform: ScoreTransform | None = None,
        prior: ScorePrior | None = None,
        refine: list[ScoreRefinement] | tuple[ScoreRefinement, ...] = (),
        share: float | None = None,
        **old_options: Any,
    ):
        super().__init__()
        if not isinstance(accumulator, ScoreAccumulator):
            raise TypeError(
                f"HeavyHitterSelector(accumulator={accumulator!r}): expected a ScoreAccumulator such as "
                "Cumulative(), Averaged(), Windowed(), LowScoreCounter()"
            )
        if transform is not None and not isinstance(transform, ScoreTransform):
            raise TypeError(
                f"HeavyHitterSelector(transform={transform!r}): expected a ScoreTransform such as StepGainSoftmax()"
            )
        if prior is not None:
            if not isinstance(prior, ScorePrior):
                raise TypeError(f"HeavyHitterSelector(prior={prior!r}): expected a ScorePrior such as ValuePrior()")
            if not getattr(accumulator, "nonnegative", True):
                raise ValueError(
                    f"HeavyHitterSelector(prior={prior!r}): {type(accumulator).__name__} scores are not "
                    "non-negative attention mass, so a multiplicative prior would invert them; use it with "
                    "Cumulative, Averaged or Windowed"
                )
        if old_options:
            refine = self._refine_from_old_options(old_options, refine)
        self._check_refine(refine)
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1):
            raise ValueError(
                f"HeavyHitterSelector(share={share!r}): a share is the fraction of the unprotected slots this "
                "selector fills beside other selectors, a float in (0, 1); leave it None for a policy's only selector"
            )
        names = [*accumulator.state_specs, *(prior.state_specs if prior is not None else ())]
        names += [name for refinement in refine for name in refinement.state_specs]
        clash = sorted({name for name in names if names.count(name) > 1})
        if clash:
            raise ValueError(f"HeavyHitterSelector: its accumulator, prior and refinements name state {clash} twice")
        self.accumulator = accumulator
        self.transform = transform
        self.prior = prior
        self.refinements = nn.ModuleList(refine)
        self.share = share

    @staticmethod
    def _refine_from_old_options(old_options: dict[str, Any], refine: Any) -> list[ScoreRefinement]:
        unknown = sorted(set(old_options) - set(OPTION_DEFAULTS))
        if unknown:
            raise TypeError(f"HeavyHitterSelector() got an unexpected keyword argument {unknown[0]!r}")
        old = ", ".join(f"{key}={value!r}" for key, value in old_options.items())
        if refine:
            raise ValueError(f"HeavyHitterSelector({old}) and refine={list(refine)!r}: give the refine list only")
        refine = [cls(**arguments) for _, cls, arguments in refinement_arguments(old_options)]
        warnings.warn(
            f"HeavyHitterSelector({old}) is deprecated: write HeavyHitterSelector(..., refine={refine!r})",
            DeprecationWarning, stacklevel=3,
        )
        return refine

    @staticmethod
    def _check_refine(refine: Any) -> None:
        if not isinstance(refine, (list, tuple)):
            raise TypeError(
                f"HeavyHitterSelector(refine={refine!r}): expected a list of score refinements such as "
                "[PooledScores(5), ChunkScores(10), LayerScope()]"
            )
        for index, refinement in enumerate(refine):
            if not isinstance(refinement, ScoreRefinement):
                raise TypeError(
                    f"HeavyHitterSelector(refine=...): item #{index} is {refinement!r}; expected a ScoreRefinement: "
                    "PooledScores, ChunkScores, SentenceScores or LayerScope"
                )
        kinds = [type(r).__name__ for r in refine]
        twice = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        if twice:
            raise ValueError(f"HeavyHitterSelector(refine={list(refine)!r}) holds {', '.join(twice)} more than once; "
                             "give each refinement once")
        aligning = [index for index, r in enumerate(refine) if r.aligns_heads]
        if aligning and aligning[0] != len(refine) - 1:
            raise ValueError(
                f"HeavyHitterSelector(refine={list(refine)!r}): {kinds[aligning[0]]} makes every head of the layer "
                "rank alike, and a refinement after it would score each head on its own again: put it last"
            )

    @property
    def refine(self) -> list[ScoreRefinement]:
        """The score refinements, in the order they apply."""
        return list(self.refinements)

    def params(self) -> dict[str, Any]:
        # arguments appear only when they differ from the default, so an H2O selector dumps as it always did
        return {k: v for k, v in super().params().items() if k not in self.DEFAULTS or v != self.DEFAULTS[k]}

    def extra_repr(self) -> str:
        # the refinements are submodules and print themselves
        shown = {k: v for k, v in self.params().items() if k != "refine" and not isinstance(v, nn.Module)}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items())

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        specs = dict(self.accumulator.state_specs)
        if self.prior is not None:
            specs.update(self.prior.state_specs)
        for refinement in self.refinements:
            specs.update(refinement.state_specs)
        return specs

    @property
    def reads_sentences(self) -> bool:
        return any(refinement.reads_sentences for refinement in self.refinements)

    @property
    def aligns_heads(self) -> bool:
        """Whether every KV head of a layer ranks alike, so all keep the same tokens (``LayerScope``)."""
        return any(refinement.aligns_heads for refinement in self.refinements)

    @property
    def rows_needed(self) -> int:
        return self.accumulator.rows_needed

    @property
    def reads_mass(self) -> bool:
        return self.accumulator.reads_mass

    @property
    def reads_keys(self) -> bool:
        return self.accumulator.reads_keys or (self.prior is not None and self.prior.reads_keys)

    @property
    def reads_values(self) -> bool:
        return self.accumulator.reads_values or (self.prior is not None and self.prior.reads_values)

    @property
    def reads_queries(self) -> bool:
        return self.accumulator.reads_queries

    @property
    def rotary_rows(self) -> int:
        return self.accumulator.rotary_rows

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the logits of the scoring softmax, or ``None`` for the model's own."""
        return None if self.transform is None else self.transform.score_gain(query_pos, budget)

    @property
    def observes_probes(self) -> bool:
        # a prior or a transform reads or reshapes what a step inserts, and a refinement with state of its own
        # writes it on arrival: neither is defined for a probe's rows
        return (
            self.accumulator.observes_probes and self.prior is None and self.transform is None
            and not any(refinement.state_specs for refinement in self.refinements)
        )

    @property
    def requires_probes(self) -> bool:
        return self.accumulator.requires_probes

    @property
    def needs_gqa_reduce(self) -> str | None:
        return self.accumulator.needs_gqa_reduce

    @property
    def tie_tolerance(self) -> float:
        return self.accumulator.tie_tolerance  # KeyNorm: RoPE keeps a repeated token's key norm

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        self.accumulator.update(state, observation, view)
        if self.prior is not None:
            self.prior.update(state, observation, view)
        for refinement in self.refinements:
            refinement.update(state, observation, view)

    @property
    def head_state_specs(self) -> dict[str, tuple[int | str, ...]]:
        return dict(self.accumulator.head_state_specs)

    def forget(self, state: dict[str, torch.Tensor], keys: torch.Tensor, gone: torch.Tensor) -> None:
        self.accumulator.forget(state, keys, gone)

    def prepare(self, state: dict[str, torch.Tensor], view: SlotView, count: torch.Tensor) -> None:
        self.accumulator.prepare(state, view)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``[B, H_kv, N]`` float32 ranking score (higher = keep) of each held slot."""
        score = self.accumulator.score(state, view).float()
        if self.prior is not None:
            score = score * self.prior.weight(state, view)
        for refinement in self.refinements:
            score = refinement.refine(score, state, view)
        return score
