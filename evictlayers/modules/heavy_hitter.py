"""Heavy-hitter selection: keep the slots with the highest score (H2O, Scissorhands, AhaKV)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F

from evictlayers.core.slots import LAST
from evictlayers.modules.selector import Selector
from evictlayers.scoring import (
    Observation,
    ScoreAccumulator,
    ScorePrior,
    ScoreTransform,
    SlotView,
)


class HeavyHitterSelector(Selector):
    """Fills the slots the protections leave with the highest-scoring tokens, per KV head.

    ``HeavyHitterSelector(accumulator, transform=None, prior=None)``: the ``accumulator`` turns the
    attention each slot receives into a score, an optional ``transform`` changes the softmax it scores
    with (never the model's output), an optional ``prior`` weights the score per slot; the policy evicts
    the lowest-scoring unprotected slots (H2O Algorithm 1 line 12: removing the minimum-score token
    maximises ``F_score`` of what stays).

    - ``HeavyHitterSelector(Cumulative())``: H2O (Algorithm 1); ``Averaged()``: its normalised variant;
    - ``HeavyHitterSelector(LowScoreCounter(window=w))`` with ``Policy(..., drop=0.5)``: Scissorhands;
    - ``HeavyHitterSelector(Windowed(32), StepGainSoftmax(), ValuePrior())``: AhaKV with Eq. 5 at every
      step (recipe ``ahakv_windowed``); ``HeavyHitterSelector(RecentThenCumulative(32), StepGainSoftmax())``
      is Algorithm 1 as written (recipe ``ahakv``);
    - ``HeavyHitterSelector(KeyDiff())`` / ``KeyNorm()``: key-geometry scores that need no attention.

    Options beyond the seeds, each off by default:

    - ``pool=w`` (odd, >= 3): before ranking, each slot's score becomes the ``pool_reduce`` (``"mean"``
      or ``"max"``) of the scores of the ``w`` held tokens around it in position order (SnapKV, Li et
      al. 2024, arXiv:2404.14469, Sec. 4.2 "clustering via pooling", kernel 5-7), so a multi-token
      needle is kept whole rather than in fragments. Neighbours are the *held* tokens (at prefill, the
      whole prompt, as in SnapKV; later the survivors), and the state itself stays unpooled.
      ``pool_side="before"`` (any ``w >= 2``) pools over the token and the ``w - 1`` held tokens before
      it instead, so a high score carries forward only, onto the tokens that follow it (a needle's key,
      which the question names, onto the value after it). Not in SnapKV: our variant.
    - ``chunk=c`` (>= 2): before ranking, each slot's score becomes the sum of the scores of the held
      tokens in its chunk, the ``c`` consecutive positions ``[k c, (k + 1) c)`` it falls in (ChunkKV, Liu
      et al. 2025, arXiv:2502.00299, Sec. 3.1: chunk score = summed observation-window attention of its
      tokens, top chunks kept), so whole spans of text stay or go together. Deviation: the paper selects
      once, at prefill; here the chunk sums keep ranking while generating, and a chunk that has lost
      tokens sums fewer of them, so the cache goes on dropping it before it breaks up another. Applied
      after ``pool``.
    - ``chunk="sentence"``: the chunks are the text's own sentences and lines, as ChunkKV's motivation
      (semantic chunks) and SentenceKV (Zhu et al. 2025, arXiv:2504.00970) have them, instead of fixed
      runs of positions: a chunk ends at a token whose text holds a sentence end or a line break
      (``evictlayers.apply(..., tokenizer=)`` marks them), and a sentence longer than ``sentence_cap``
      tokens is cut into pieces of ``sentence_cap`` from its start, so unpunctuated text ranks in bounded
      chunks. Scored as the fixed chunks are (the sum over the held tokens of the piece). Our variant:
      SentenceKV keeps sentence-level key summaries for retrieval, not a per-token cache.
    - ``chunk_reduce="mean"``: a chunk's score is the mean over its held tokens instead of the sum, so a
      chunk is ranked by how much each of its tokens is worth rather than by how many it has (with
      sentences of different lengths, a sum ranks long sentences first). Our variant.
    - ``scope="layer"``: every KV head of the layer keeps the same tokens, ranked by the score averaged
      over the heads (TOVA, Oren et al. 2024, arXiv:2401.06104, Sec. 3.2; ChunkKV's layer-wise index
      reuse). The heads' slot layouts then stay identical, so slot ``j`` is the same token in every head.
    - ``scope_reduce="max"`` (with ``scope="layer"``): the layer ranks each token by the largest score any
      of its KV heads gives it instead of the mean, so a token one head needs (a retrieval head reading a
      needle, say) is not outvoted by heads that attend elsewhere. Our variant.
    - ``share=f``: the fraction of the unprotected slots this selector fills when a Policy holds several
      selectors (see ``Policy``); ``None`` (the default) for a policy's only selector.
    """

    param_names = (
        "accumulator", "transform", "prior", "pool", "pool_reduce", "pool_side", "chunk", "sentence_cap",
        "chunk_reduce", "scope", "scope_reduce", "share",
    )
    CHUNK_REDUCTIONS = ("sum", "mean")
    SENTENCE = "sentence"
    POOL_REDUCTIONS = ("mean", "max")
    POOL_SIDES = ("both", "before")
    SCOPES = ("head", "layer")
    SCOPE_REDUCTIONS = ("mean", "max")

    def __init__(
        self,
        accumulator: ScoreAccumulator,
        transform: ScoreTransform | None = None,
        prior: ScorePrior | None = None,
        pool: int = 1,
        pool_reduce: str = "mean",
        pool_side: str = "both",
        chunk: int | str = 1,
        sentence_cap: int = 32,
        chunk_reduce: str = "sum",
        scope: str = "head",
        scope_reduce: str = "mean",
        share: float | None = None,
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
            clash = set(accumulator.state_specs) & set(prior.state_specs)
            if clash:
                raise ValueError(f"HeavyHitterSelector: accumulator and prior both name state {sorted(clash)}")
        self._check_options(pool, pool_reduce, pool_side, scope, share)
        if chunk != self.SENTENCE and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"HeavyHitterSelector(chunk={chunk!r}): the chunk length must be an int >= 1 "
                             "(1: no chunks; ChunkKV uses 10) or 'sentence' (the text's sentences and lines)")
        if isinstance(sentence_cap, bool) or not isinstance(sentence_cap, int) or sentence_cap < 1:
            raise ValueError(f"HeavyHitterSelector(sentence_cap={sentence_cap!r}): the longest sentence chunk must "
                             "be an int >= 1 (tokens)")
        if sentence_cap != self.DEFAULTS["sentence_cap"] and chunk != self.SENTENCE:
            raise ValueError(f"HeavyHitterSelector(sentence_cap={sentence_cap!r}) caps sentence chunks: it needs "
                             f"chunk='sentence' (got chunk={chunk!r})")
        if chunk_reduce not in self.CHUNK_REDUCTIONS:
            raise ValueError(
                f"HeavyHitterSelector(chunk_reduce={chunk_reduce!r}): expected one of {self.CHUNK_REDUCTIONS}"
            )
        if chunk_reduce != "sum" and chunk == 1:
            raise ValueError(f"HeavyHitterSelector(chunk_reduce={chunk_reduce!r}) reduces chunks: it needs chunk >= 2 "
                             "or chunk='sentence' (got chunk=1)")
        if scope_reduce not in self.SCOPE_REDUCTIONS:
            raise ValueError(
                f"HeavyHitterSelector(scope_reduce={scope_reduce!r}): expected one of {self.SCOPE_REDUCTIONS}"
            )
        if scope_reduce != "mean" and scope != "layer":
            raise ValueError(f"HeavyHitterSelector(scope_reduce={scope_reduce!r}) combines a layer's heads: it needs "
                             f"scope='layer' (got scope={scope!r})")
        self.accumulator = accumulator
        self.transform = transform
        self.prior = prior
        self.pool, self.pool_reduce, self.pool_side = pool, pool_reduce, pool_side
        self.chunk, self.sentence_cap, self.chunk_reduce = chunk, sentence_cap, chunk_reduce
        self.scope, self.scope_reduce, self.share = scope, scope_reduce, share

    @classmethod
    def _check_options(cls, pool: Any, pool_reduce: Any, pool_side: Any, scope: Any, share: Any) -> None:
        if pool_side not in cls.POOL_SIDES:
            raise ValueError(
                f"HeavyHitterSelector(pool_side={pool_side!r}): expected 'both' (the window centred on each "
                "token) or 'before' (the token and those before it)"
            )
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"HeavyHitterSelector(pool={pool!r}): the pooling width must be an int >= 1 (1: no pooling)")
        if pool_side == "both" and pool > 1 and pool % 2 == 0:
            raise ValueError(
                f"HeavyHitterSelector(pool={pool!r}): with pool_side='both' the pooling width must be 1 (no "
                "pooling) or an odd int >= 3 (a window centred on each token; SnapKV uses 5-7)"
            )
        if pool_reduce not in cls.POOL_REDUCTIONS:
            raise ValueError(f"HeavyHitterSelector(pool_reduce={pool_reduce!r}): expected one of {cls.POOL_REDUCTIONS}")
        if scope not in cls.SCOPES:
            raise ValueError(
                f"HeavyHitterSelector(scope={scope!r}): expected 'head' (each KV head keeps its own tokens) or "
                "'layer' (the heads of a layer keep the same tokens)"
            )
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1):
            raise ValueError(
                f"HeavyHitterSelector(share={share!r}): a share is the fraction of the unprotected slots this "
                "selector fills beside other selectors, a float in (0, 1); leave it None for a policy's only selector"
            )

    DEFAULTS = {"transform": None, "prior": None, "pool": 1, "pool_reduce": "mean", "pool_side": "both", "chunk": 1,
                "sentence_cap": 32, "chunk_reduce": "sum", "scope": "head", "scope_reduce": "mean",
                "share": None}

    def params(self) -> dict[str, Any]:
        # options appear only when they differ from the default, so an H2O selector dumps as it always did
        return {k: v for k, v in super().params().items() if k not in self.DEFAULTS or v != self.DEFAULTS[k]}

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        specs = dict(self.accumulator.state_specs)
        if self.prior is not None:
            specs.update(self.prior.state_specs)
        if self.reads_sentences:
            specs[self.SENTENCE_START] = ()
        return specs

    SENTENCE_START = "sentence_start"
    """State of ``chunk="sentence"``: the position where each slot's sentence starts (float32, exact up to
    2^24 positions), written when the token arrives."""

    @property
    def reads_sentences(self) -> bool:
        return self.chunk == self.SENTENCE

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

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the logits of the scoring softmax, or ``None`` for the model's own."""
        return None if self.transform is None else self.transform.score_gain(query_pos, budget)

    @property
    def tie_tolerance(self) -> float:
        return self.accumulator.tie_tolerance  # KeyNorm: RoPE keeps a repeated token's key norm

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        self.accumulator.update(state, observation, view)
        if self.prior is not None:
            self.prior.update(state, observation, view)
        if self.reads_sentences:  # the slot store gives every step's sentence starts (and says when it cannot)
            inserted = observation.inserted
            start = observation.sentence_start[:, None, :].expand(inserted.shape).to(torch.float32)
            state[self.SENTENCE_START].scatter_(2, inserted, start)

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
        if self.pool > 1:
            score = pool_by_position(score, view.pos, self.pool, self.pool_reduce, self.pool_side)
        if self.reads_sentences:
            start = state[self.SENTENCE_START].long()
            # sentences longer than the cap break into pieces of `sentence_cap` counted from their start
            piece = start + (view.pos - start).div(self.sentence_cap, rounding_mode="floor") * self.sentence_cap
            score = reduce_by_group(score, view.pos, piece, self.chunk_reduce)
        elif self.chunk > 1:
            score = reduce_by_group(score, view.pos, view.pos.div(self.chunk, rounding_mode="floor"), self.chunk_reduce)
        if self.scope == "layer":
            held = view.valid
            if self.scope_reduce == "max":
                # over the heads holding the slot; a slot no head holds scores 0, as the mean gives it
                top = score.masked_fill(~held, float("-inf")).amax(1, keepdim=True)
                score = torch.where(held.any(1, keepdim=True), top, 0.0).expand_as(score)
            else:
                mean = (score * held).sum(1, keepdim=True) / held.sum(1, keepdim=True).clamp(min=1)
                score = mean.expand_as(score)
        return score


def pool_by_position(score: torch.Tensor, pos: torch.Tensor, width: int, reduce: str, side: str = "both") -> torch.Tensor:
    """``score`` ``[B, H, N]`` pooled over each slot's ``width`` neighbours among the held slots in
    position order (``pos`` ``[B, H, N]``, ``-1`` = empty); empty slots neither give nor get a value.
    ``side="both"``: the window centred on the slot (``width`` odd); ``"before"``: the slot and the
    ``width - 1`` held slots before it.

    Fixed-shape (a sort of the slot axis, a 1-d pooling, the inverse permutation), so it runs inside the
    compiled decode step."""
    batch, heads, n_slots = score.shape
    held = pos >= 0
    order = pos.masked_fill(~held, LAST).argsort(-1)  # held slots first, by position
    ranked = score.gather(-1, order).reshape(batch * heads, 1, n_slots)
    ranked_held = held.gather(-1, order).reshape(batch * heads, 1, n_slots)
    # the window's reach before and after each slot; edges are padded with slots that hold nothing
    before, after = (width - 1, 0) if side == "before" else (width // 2, width // 2)
    if reduce == "max":
        pooled = F.max_pool1d(F.pad(ranked.masked_fill(~ranked_held, -math.inf), (before, after), value=-math.inf),
                              width, stride=1)
    else:
        total, count = (F.avg_pool1d(F.pad(x, (before, after)), width, stride=1)
                        for x in (ranked.masked_fill(~ranked_held, 0.0), ranked_held.float()))
        pooled = total / count.clamp(min=1e-12)
    pooled = pooled.reshape(batch, heads, n_slots)
    return torch.empty_like(pooled).scatter_(-1, order, pooled).masked_fill(~held, 0.0)


def reduce_by_group(score: torch.Tensor, pos: torch.Tensor, group: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """``score`` ``[B, H, N]`` replaced, for each held slot, by the sum (``reduce="sum"``) or the mean
    (``"mean"``) over the held slots of the same chunk (``group`` ``[B, H, N]`` int64, non-decreasing in
    position: ``pos // c`` for fixed chunks, the start of the sentence piece for sentences; ``pos``
    ``[B, H, N]``, ``-1`` = empty, which gets 0).

    Fixed-shape, for the compiled decode step: the slots sorted by position, where each chunk is a run,
    and each run's sum (and length) read off a cumulative sum at the run's two ends."""
    batch, heads, n_slots = score.shape
    held = pos >= 0
    order = pos.masked_fill(~held, LAST).argsort(-1)  # held slots first, by position
    ranked = score.gather(-1, order).masked_fill(~held.gather(-1, order), 0.0)
    # empty slots (sorted last) get chunk ids past every real one, one run of their own
    ids = torch.where(held, group, LAST).gather(-1, order)
    index = torch.arange(n_slots, device=score.device).expand_as(ids)
    starts = torch.ones_like(held)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    ends = torch.ones_like(held)
    ends[..., :-1] = starts[..., 1:]
    first = torch.where(starts, index, 0).cummax(-1).values  # index of each slot's run start
    last = torch.where(ends, index, n_slots - 1).flip(-1).cummin(-1).values.flip(-1)  # and run end
    total = ranked.cumsum(-1)
    before = torch.where(first > 0, total.gather(-1, (first - 1).clamp(min=0)), 0.0)
    summed = total.gather(-1, last) - before
    if reduce == "mean":
        summed = summed / (last - first + 1)  # held slots sort first, so a held run counts held slots only
    return torch.empty_like(summed).scatter_(-1, order, summed).masked_fill(~held, 0.0)
