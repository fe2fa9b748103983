"""What a scorer or module sees of one layer's slot store at one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlotView:
    """The slots of one layer after the current tokens were inserted.

    Attributes:
        pos: ``[B, H_kv, N]`` int64 original position held by each slot, ``-1`` = empty.
        seen: ``[B]`` int64 real (non-padding) tokens seen per row, the current ones included.
        budget: ``[B]`` int64 slots this layer may keep per head, or ``None`` for an unbounded cache.
        keys: ``[B, H_kv, N, D]`` the slots' keys (post-RoPE, dequantised), for scores computed from key
            geometry (``KeyDiff``, ``KeyNorm``); ``None`` where the caller has none to give (a quantised
            cache's one-token step whose scorers do not declare ``reads_keys``).
        window: the layer's sliding window (a query sees itself and the ``window - 1`` tokens before it),
            ``None`` for a full-attention layer.
        protected: ``[B, H_kv, N]`` bool, the slots a protection (``RecentWindow``, ``SinkTokens``) holds,
            filled by the policy for the selectors that read ``candidates``; ``None`` elsewhere.
        cross_layer: ``[B, P]`` float32 score of each original position ``< P`` from the ranking layers'
            last query (``CrossLayer``), given to a multi-token step's selection; ``None`` elsewhere.
    """

    pos: torch.Tensor
    seen: torch.Tensor
    budget: torch.Tensor | None
    keys: torch.Tensor | None = None
    window: int | None = None
    protected: torch.Tensor | None = None
    cross_layer: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """``[B, H_kv, N]`` bool: the slot holds a token."""
        return self.pos >= 0

    @property
    def candidates(self) -> torch.Tensor:
        """``[B, H_kv, N]`` bool: held slots no protection holds, the selectors' to rank."""
        if self.protected is None:
            raise ValueError("SlotView.candidates needs SlotView.protected (the policy fills it)")
        return self.valid & ~self.protected

    @property
    def stale(self) -> torch.Tensor | None:
        """``[B, H_kv, N]`` bool: the slot holds a token that slid out of the window of every later query
        (the next query, at position ``seen``, sees positions above ``seen - window``); ``None`` without a
        window."""
        if self.window is None:
            return None
        return self.valid & (self.seen[:, None, None] - self.pos >= self.window)

    @property
    def age(self) -> torch.Tensor:
        """``[B, H_kv, N]`` int64: queries that could attend to each slot's token so far (itself included)."""
        return (self.seen[:, None, None] - self.pos).clamp(min=1)


@dataclass
class Observation:
    """What one step's attention tells the scorers about the slots of ``SlotView``.

    Attributes:
        mass: ``[B, H_kv, N]`` scoring probability each slot received, summed over the step's
            queries and reduced over each GQA group.
        rows: ``[B, H_kv, R, N]`` the same for each of the step's last ``R`` queries (``R`` is what the
            policy asked for, at most the step's query count).
        row_pos: ``[B, R]`` int64 original position of those queries, ``-1`` for padding.
        values: ``[B, H_kv, N, D_v]`` the slots' values; ``None`` in a quantised cache's one-token step whose
            scorers do not declare ``reads_values``.
        group_size: query heads per KV head (GQA group).
        gqa_reduce: how the group's probabilities were combined (``"sum"``, ``"mean"``, ``"max"``).
        keys: ``[B, H_kv, N, D]`` the slots' keys (post-RoPE), for key-fed scorers such as
            ``KCenterSelector``; ``None`` where the caller has none to give (as ``SlotView.keys``).
        inserted: ``[B, H_kv, n]`` int64 the slots this step wrote its ``n`` tokens to (a padding token's
            slot holds position ``-1``), so per-slot facts about a key are computed once, on arrival;
            ``None`` where the caller has none to give.
        sentence_start: ``[B, n]`` int64 the position where each of those tokens' sentence starts (the
            text's sentences and lines, ``evictlayers.apply(..., tokenizer=)``), for selectors that rank
            sentences (``reads_sentences``); ``None`` for other policies.
        queries: ``[B, H_q, Q, D]`` the step's queries as the attention function received them (post-RoPE, at
            their original positions; a decode step's one query), for scorers that declare ``reads_queries``
            (``ExpectedAttention``); ``None`` for other policies (nothing is copied either way).
        query_pos: ``[B, Q]`` int64 original position of each of those queries, ``-1`` for padding.
        rotary: ``(cos, sin)`` ``[N, R]`` float32 the layer's rotary table as pure rotations (row ``p`` rotates
            by position ``p``; ``compose/positions.py``), ``N`` at least the policy's ``rotary_rows`` and the
            step's length plus one, for scorers that declare ``reads_queries``; ``None`` otherwise.
        scaling: the model's factor on ``q . k`` (usually ``D ** -0.5``), given with ``queries``.
        probe: the step is a probe (``SlotStore.probing``): its tokens attend over the held slots and, causally,
            each other, but are never stored, so ``rows`` holds probe rows over the held slots only (every row of
            the probe, fed in blocks of rows: one probe may make several observations), ``mass`` their sum over
            the held slots, and ``inserted`` is empty. Only scorers that declare ``observes_probes`` see one.
        deferred: the step's tokens arrive while the store defers eviction until probes have run
            (``SlotStore.defer``): the probes, not this step, are what scores them.
    """

    mass: torch.Tensor
    rows: torch.Tensor
    row_pos: torch.Tensor
    values: torch.Tensor | None
    group_size: int
    gqa_reduce: str
    keys: torch.Tensor | None = None
    inserted: torch.Tensor | None = None
    sentence_start: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    scaling: float | None = None
    probe: bool = False
    deferred: bool = False
