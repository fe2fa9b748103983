"""The slot store as its steps see it: the attributes the multi-token step (``compose/prefill_step.py``) and
the one-token step (``compose/decode_step.py``) read and write, and what the store derives alike for
either step from its inputs (the tokens' positions and sentence starts).

The store owns this state and dispatches each step; the steps are functions written against these
protocols, so neither imports the store (which imports both) and the package keeps its imports acyclic.
``SlotStore`` satisfies both protocols as it is.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from evictlayers.compose.cross_layer import CrossLayerBoard
from evictlayers.compose.policy import Policy
from evictlayers.compose.positions import RotaryTable
from evictlayers.modules import DenseSlots, QuantizedSlots, SketchState


class DecodeStore(Protocol):
    """What a one-token step reads and writes in place. Tensors are ``[B, H_kv, C, ...]`` per slot."""

    policy: Policy
    kv: DenseSlots | QuantizedSlots  # the slots' keys and values, as the policy's storage holds them
    pos: torch.Tensor  # [B, H_kv, C] int64 original position, -1 = empty
    state: dict[str, torch.Tensor]  # the policy's per-slot ([B, H_kv, C, ...]) and per-head ([B, H_kv, ...]) state
    ranks: torch.Tensor | None  # [B, H_kv, C] int64 rank among the head's held tokens (rolling positions)
    seen: torch.Tensor  # [B] int64 real tokens per row
    budget: torch.Tensor | None  # [B] tokens per head, None = unbounded
    sketch: SketchState | None  # the ClusterSketch's buffers of the evicted tokens
    most: int  # the largest drop amount of any row: the width of a decode step's victims
    filled: int | None  # slots [0, filled) hold every row's tokens in position order (an in-order full cache)
    keeps_attended: bool  # a KV-sharing layer reads what this step attended over: keep it in ``attended``
    attended: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # (keys, values, pos, query_pos)


class PrefillStore(DecodeStore, Protocol):
    """What a multi-token step reads and writes besides: it replaces the slot tensors whole (``kv``, ``pos``,
    ``state``, ``ranks``), sets ``filled`` and fixes ``most`` (one token a step where ``bound`` is the
    window), and advances ``seq_len``."""

    layer_idx: int
    seq_len: int  # columns fed so far, padding included
    rotary: RotaryTable | None  # the model's rotary table, for positions="rolling"
    bound: str | None  # which rule bounds the layer: "budget", "window" or None
    board: CrossLayerBoard | None  # the cache's CrossLayer board, shared by every layer
    ranking_layer: bool  # this layer publishes its last query row on the board
    deferred: bool  # every step's tokens are held until ``evict_deferred`` (``SlotStore.defer``)
    deferred_window: int | None  # the sliding window the held steps attended with

    @property
    def capacity(self) -> int: ...

    def invalidate_coins(self) -> None: ...


def token_positions(seen: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[B, Q]`` int64 original position of each of a step's tokens, ``-1`` for padding: ``seen`` ``[B]``
    real tokens before the step, ``real`` ``[B, Q]`` bool."""
    return torch.where(real, seen[:, None] + real.long().cumsum(1) - 1, -1)


def change_per_slot(
    state: dict[str, torch.Tensor], slotted: dict, change: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` with ``change`` applied to the per-slot tensors (those named in ``slotted``, the policy's
    ``state_specs``); per-head ones kept as they are."""
    return {name: change(t) if name in slotted else t for name, t in state.items()}


def sentence_starts(
    query_pos: torch.Tensor, sentence_ends: torch.Tensor | None, last_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, Q]`` int64 where each of a step's tokens' sentence starts, ``[B]`` the last sentence end through
    the step``)``, for a policy that ranks sentences: a sentence starts after the last end before it (0 for
    the first sentence). Padding neither ends nor starts a sentence.

    Args:
        query_pos: ``[B, Q]`` int64 the tokens' positions (``token_positions``, ``-1``: padding).
        sentence_ends: ``[B, Q]`` bool, ``True`` for a token whose text ends a sentence or a line.
        last_end: ``[B]`` int64 the position of each row's last sentence end before the step (``-1``: none).
    """
    if sentence_ends is None:
        raise ValueError(
            "the policy ranks sentences (HeavyHitterSelector(..., refine=[SentenceScores()])), so each step "
            "needs its tokens' sentence ends: apply it with evictlayers.apply(model, policy, tokenizer=...) and feed "
            "input_ids (or pass SlotStore.step(..., sentence_ends=[B, Q] bool))"
        )
    if sentence_ends.shape != query_pos.shape or sentence_ends.dtype != torch.bool:
        raise ValueError(
            f"sentence_ends must be a [B, Q] = {list(query_pos.shape)} bool tensor, got "
            f"{list(sentence_ends.shape)} {sentence_ends.dtype}"
        )
    # a padding token's position is -1, the same as "no end", so padding never ends a sentence
    ends = torch.where(sentence_ends.to(query_pos.device), query_pos, -1)
    through = torch.maximum(ends.cummax(1).values, last_end[:, None])  # last end at or before
    before = torch.cat([last_end[:, None], through[:, :-1]], dim=1)  # strictly before
    return before + 1, through[:, -1]
