"""One decode step of a slot store as a pure function of fixed-size tensors (DESIGN.md "One decode step").

Everything here has a shape fixed by the store's capacity: the new token goes to the first free slot
(``argmax`` over a mask), eviction picks victims with ``amin``/``argmin`` (one token at a time, H2O
Algorithm 1 lines 12-13) or a fixed-``k`` sort (Scissorhands' drop amount ``m``), and a head under its
budget simply writes its victims' positions back unchanged. No ``nonzero``, ``.item()``, ``int(tensor)``
or ``bool(tensor)``: the step runs eagerly as it is, and ``torch.compile(fullgraph=True)`` turns it into
one graph that does not recompile as the sequence grows (gpt-fast style: buffers written in place).
A stream-mode ``ClusterSketch`` adds fixed-size buffers: the output merges the exact slots with the
sketch through the exact part's log-sum-exp, and the victims are absorbed before their slots are freed.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from evictlayers.compose.policy import Policy
from evictlayers.compose.positions import rotate_at, rotate_queries, slot_ranks
from evictlayers.modules.cluster_sketch import CoinTable, SketchState, merge_with_exact
from evictlayers.modules.dense_kv import batch_head_index
from evictlayers.kernels import apply_attention_sinks, decode_attention
from evictlayers.scoring import Observation, SlotView

_OLDEST_LAST = torch.iinfo(torch.long).max
# up to this many victims a step, rolling ranks are lowered by comparing every slot with each victim
# ([B, H, N, most] comparisons); beyond it (Scissorhands' drop of half the budget) one sort re-ranks
INCREMENTAL_RANKS_MOST = 8


def along_slots(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Expand a ``[B, H, k]`` slot index to ``like``'s trailing dims, for gather/scatter on dim 2."""
    shaped = index.view(*index.shape, *([1] * (like.dim() - 3)))
    return shaped.expand(*index.shape, *like.shape[3:])


def decode_step(
    policy: Policy,
    most: int,
    kv,
    pos: torch.Tensor,
    state: dict[str, torch.Tensor],
    seen: torch.Tensor,
    budget: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    real: torch.Tensor,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    sketch: SketchState | None = None,
    coins: CoinTable | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ranks: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Insert one token per row, attend, score and evict, writing ``kv``/``pos``/``state`` in place.

    Args:
        most: the largest drop amount of any row (host int fixed at prefill; the victims' sort width).
        kv: the layer's storage slots (``DenseSlots``, ``QuantizedSlots``), ``C`` slots per head with at
            least one free slot per head.
        pos: ``[B, H_kv, C]`` int64 original positions, ``-1`` = free. ``state``: the policy's per-slot
            state ``[B, H_kv, C, ...]`` and per-head state ``[B, H_kv, ...]`` (``Policy.head_state_specs``).
        seen: ``[B]`` real tokens so far; budget: ``[B]`` per-head budget, ``None`` = never evict.
        query: ``[B, H_q, 1, D]``; key/value: ``[B, H_kv, 1, D]``; real: ``[B, 1]`` bool.
        sketch: the layer's ``ClusterSketch`` buffers (stream mode; ``salt`` a 0-d tensor, so layers
            share one graph), or ``None``. The output is then the exact slots merged with the sketch of
            the tokens evicted so far (``merge_with_exact``: one log-sum-exp-safe division), and this
            step's victims are absorbed before their slots are freed. The scorers see the exact slots'
            mass only: evicted tokens have no slot to credit it to.
        coins: the sketch's ``CoinTable`` covering this step's absorptions (``None``: hash them here).
        rotary: ``(cos, sin)`` ``[N >= C, R]`` for ``positions="rolling"`` (keys held un-rotated): keys and
            the query are rotated to their rank among the head's held slots before attention; the
            scorers see the stored keys. ``None``: keys are held rotated at their original position.
        ranks: with ``rotary``, ``[B, H_kv, C]`` int64 rank of each held slot among its head's held slots
            in position order (``slot_ranks(pos)``; free slots: any value below ``C``), kept up to date in
            place: the new token takes the count of the others (it is the newest), and an eviction
            lowers the rank of every newer slot by one, so no step sorts the slots.
        sinks: ``[H_q]`` learned attention-sink logits (``kernels/attention_sinks.py``), or ``None``; the
            scorers see each slot's probability without the sink's share.

    Returns:
        ``([B, H_q, 1, D_v]`` attention output, ``[B]`` new ``seen``).
    """
    batch, heads = key.shape[:2]
    query_pos = torch.where(real[:, 0], seen, -1)  # [B]; a padding token is never stored
    slot = (pos < 0).int().argmax(-1)  # [B, H]: each head's first free slot
    new_pos = query_pos[:, None].expand(batch, heads)
    kv.write(slot, key[:, :, 0], value[:, :, 0], new_pos)
    # index_put_ (not scatter_) so that inductor writes the graph inputs in place
    rows, cols = batch_head_index(slot)
    pos.index_put_((rows, cols, slot), new_pos)
    for name in policy.state_specs:  # per-slot state only: per-head state does not follow slots
        state[name].index_put_((rows, cols, slot), torch.zeros((), dtype=state[name].dtype, device=slot.device))

    keys, values = kv.dense()
    gain = policy.score_gain(query_pos[:, None], budget)
    attended_query, attended_keys = query, keys
    if rotary is not None:
        others = (pos >= 0).sum(-1) - (new_pos >= 0).long()  # [B, H]: held tokens besides the new one
        ranks.index_put_((rows, cols, slot), others.clamp(min=0))
        attended_keys = rotate_at(keys, ranks, rotary)
        attended_query = rotate_queries(query, ranks.gather(2, slot[:, :, None]), rotary)
    attention = decode_attention(
        attended_query[:, :, 0], attended_keys, values, query_pos, pos,
        scaling=scaling, softcap=softcap, sliding_window=sliding_window, gqa_reduce=policy.gqa_reduce,
        score_gain=None if gain is None else gain[:, 0],
    )
    out = attention.out
    group_size = query.shape[1] // heads
    if sketch is not None:
        terms = policy.sketch.sketch_terms(sketch, query[:, :, 0], scaling, group_size, softcap=softcap)
        merged = merge_with_exact(out, attention.lse, *terms)
        out = torch.where((query_pos >= 0)[:, None, None], merged, torch.zeros_like(merged))
    if sinks is not None:
        out = apply_attention_sinks(out, attention.lse, sinks)
    seen = seen + real[:, 0].long()
    view = SlotView(pos=pos, seen=seen, budget=budget, keys=keys, window=sliding_window)
    rows = attention.mass[:, :, None]  # [B, H, 1, N]: the one query row is the step's whole mass
    if not policy.rows_needed:
        rows = rows[:, :, :0]
    observation = Observation(
        mass=attention.mass, rows=rows, row_pos=query_pos[:, None], values=values,
        group_size=group_size, gqa_reduce=policy.gqa_reduce, keys=keys, inserted=slot[:, :, None],
    )
    policy.observe(state, observation, view)
    if budget is not None:
        victims, chosen = choose_victims(policy, most, pos, state, view)
        if sketch is not None:
            # the victims' keys/values are still in their slots: absorb them before the slots are freed
            policy.sketch.absorb(
                sketch, keys.gather(2, along_slots(victims, keys)), values.gather(2, along_slots(victims, values)),
                chosen, coins,
            )
        if policy.head_state_specs:
            policy.forget(state, keys.gather(2, along_slots(victims, keys)), chosen)
        if ranks is not None and most <= INCREMENTAL_RANKS_MOST:
            gone = torch.where(chosen, pos.gather(2, victims), _OLDEST_LAST)  # [B, H, most] evicted positions
            ranks.sub_((gone[:, :, None, :] < pos[:, :, :, None]).sum(-1))
        pos.scatter_(2, victims, torch.where(chosen, -1, pos.gather(2, victims)))
        if ranks is not None and most > INCREMENTAL_RANKS_MOST:
            ranks.copy_(slot_ranks(pos))
    return out[:, :, None], seen


def choose_victims(
    policy: Policy, most: int, pos: torch.Tensor, state: dict[str, torch.Tensor], view: SlotView
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(victims [B, H, most]`` slot indices, ``chosen [B, H, most]`` bool: really evicted``)``.

    Heads over budget give up their ``drop`` lowest-priority slots (H2O Algorithm 1 lines 12-13 with
    ``drop = 1``; Scissorhands Algorithm 2 with drop amount ``m``). Equal priorities go oldest first: when
    the drop amount exceeds the unprotected slots, protected ones (all ``+inf``) leave in age order. A
    head under budget has nothing chosen (its victims' positions are written back unchanged)."""
    valid = view.valid
    over = valid.sum(-1) > view.budget[:, None]  # [B, H]
    # empty slots rank +inf: a row whose budget is below the batch maximum has some, and the pick must
    # be among the tokens it holds, not a free slot (which would evict nothing)
    priority = policy.priority(state, view).masked_fill(~valid, math.inf)
    age_key = pos.masked_fill(~valid, _OLDEST_LAST)
    if most == 1:
        lowest = priority.amin(-1, keepdim=True)
        # a selector whose scores tie exactly in real arithmetic (k-center distances under RoPE) counts
        # scores within its relative tolerance as tied, so float noise cannot pick a different victim
        tolerance = policy.tie_tolerance
        tied = priority == lowest
        if tolerance:  # (an infinite lowest, a stale slot, is tied only with itself)
            tied |= priority <= lowest + lowest.abs() * tolerance
        victims = torch.where(tied, age_key, _OLDEST_LAST).argmin(-1, keepdim=True)  # [B, H, 1]
        chosen = over[..., None]
    else:
        by_age = age_key.argsort(-1)
        order = priority.gather(-1, by_age).argsort(dim=-1, stable=True)[..., :most]
        victims = by_age.gather(-1, order)  # [B, H, most]
        drop = policy.drop_amount(view.budget)  # [B]
        chosen = over[..., None] & (torch.arange(most, device=pos.device) < drop[:, None, None])
    return victims, chosen


def compiled_decode_step() -> Callable:
    """``decode_step`` under ``torch.compile(fullgraph=True)``, built once per process.

    One compiled function serves every store: layers whose shapes agree share its graph (measured: 4
    graphs for slot counts 64-256 at batch 1 and 4), and automatic dynamic shapes (``dynamic=None``) give layers of other sizes (per-layer allocations, a
    growing full cache) one shape-generic graph instead of a graph per size.
    """
    global _COMPILED
    if _COMPILED is None:
        # every policy structure (accumulator, prior, storage, sketch, drop path, positions) and every
        # batch/slot shape class is a graph of this one function; a process that runs many policies (an
        # evaluation, the benchmarks) passes dynamo's default of 8, where fullgraph=True fails hard; the
        # overhead benchmark alone (nine configurations, three slot counts, two batch sizes) needs more than 64
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _COMPILED = torch.compile(decode_step, fullgraph=True, dynamic=None, options={"emulate_precision_casts": True})
    return _COMPILED


_COMPILED: Callable | None = None
