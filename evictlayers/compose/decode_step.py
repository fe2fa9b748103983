"""One decode step of a slot store as a function of its fixed-size tensors (docs/architecture.md, "The
decode step and ``compile=True``").

Everything here has a shape fixed by the store's capacity: the new token goes to the first free slot
(``kernels/slot_search.py``), eviction picks victims with ``compose/eviction.py`` (one ``argmin``, or a
fixed-width sort for Scissorhands' drop amount ``m``), and a head under its budget simply writes its
victims' positions back unchanged. No ``nonzero``, ``.item()``, ``int(tensor)`` or ``bool(tensor)``:
the step runs eagerly as it is, and ``torch.compile(fullgraph=True)`` turns it into one graph that does
not recompile as the sequence grows (gpt-fast style: buffers written in place).
"""

from __future__ import annotations

from typing import Callable

import torch

from evictlayers.compose import ranking
from evictlayers.compose.eviction import choose_evicted, decode_drop, release_evicted
from evictlayers.compose.positions import rotate_at, rotate_queries, slot_ranks
from evictlayers.compose.sketching import merge_sketch
from evictlayers.compose.step_state import DecodeStore
from evictlayers.core.slots import LAST, batch_head_index
from evictlayers.kernels import apply_attention_sinks, decode_attention
from evictlayers.kernels.slot_search import first_free_slot
from evictlayers.modules.cluster_sketch import CoinTable
from evictlayers.scoring import Observation, SlotView

# up to this many victims a step, rolling ranks are lowered by comparing every slot with each victim
# ([B, H, N, most] comparisons); beyond it (Scissorhands' drop of half the budget) one sort re-ranks
INCREMENTAL_RANKS_MOST = 8


def decode_step(
    store: DecodeStore,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    real: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    coins: CoinTable | None = None,
    sentence_start: torch.Tensor | None = None,
    query_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Insert one token per row, attend, score and evict, writing the store's tensors in place.

    Reads and writes ``store.kv`` (at least one free slot per head), ``store.pos``, ``store.state``,
    ``store.ranks`` (rolling positions) and ``store.sketch`` in place, and ``store.seen``; reads
    ``store.policy``, ``store.budget`` and ``store.most`` (the victims' sort width, fixed at prefill).

    Args:
        query: ``[B, H_q, 1, D]``; key/value: ``[B, H_kv, 1, D]``; real: ``[B, 1]`` bool (a padding token
            is never stored).
        sinks: ``[H_q]`` learned attention-sink logits (``kernels/attention_sinks.py``), or ``None``; the
            scorers see each slot's probability without the sink's share.
        rotary: ``(cos, sin)`` ``[N >= C, R]`` for ``positions="rolling"`` (keys held un-rotated): keys and
            the query are rotated to their rank among the head's held slots before attention; the
            scorers see the stored keys. The ranks are kept up to date in place: the new token takes the
            count of the others (it is the newest), and an eviction lowers the rank of every newer slot by
            one, so no step sorts the slots.
        coins: the sketch's ``CoinTable`` covering this step's absorptions (``None`` without a sketch).
            The output is then the exact slots merged with the sketch of the tokens evicted so far, and
            this step's victims are absorbed before their slots are freed. The scorers see the exact
            slots' mass only: evicted tokens have no slot to credit it to.
        sentence_start: ``[B, 1]`` int64 where the new token's sentence starts, for a policy that ranks
            sentences (``None`` otherwise).
        query_rotary: ``(cos, sin)`` ``[N, R]`` float32, the layer's rotary table (``N >= 2`` and the policy's
            ``rotary_rows``), for a policy whose scorers read the query (``Policy.reads_queries``); they then get
            the query, its position, the table and ``scaling`` in their ``Observation``.

    Returns:
        ``[B, H_q, 1, D_v]`` attention output.
    """
    policy, kv, pos, state, ranks, budget = store.policy, store.kv, store.pos, store.state, store.ranks, store.budget
    batch, heads = key.shape[:2]
    query_pos = torch.where(real[:, 0], store.seen, -1)  # [B]
    slot = first_free_slot(pos)  # [B, H]
    new_pos = query_pos[:, None].expand(batch, heads)
    kv.write(slot, key[:, :, 0], value[:, :, 0], new_pos)
    # index_put_ (not scatter_) so that inductor writes the graph inputs in place
    rows, cols = batch_head_index(slot)
    pos.index_put_((rows, cols, slot), new_pos)
    for name in policy.state_specs:  # per-slot state only: per-head state does not follow slots
        state[name].index_put_((rows, cols, slot), torch.zeros((), dtype=state[name].dtype, device=slot.device))

    # the slots' keys and values as tensors: a dense storage's own (free); a quantised storage's dequantised
    # copy only for what reads it (rotating keys to their ranks, scorers that declare it, the sketch's
    # absorb, per-head state that forgets the victims' keys); attention itself reads the storage as held
    wants_dense = (
        kv.free_dense or rotary is not None or store.sketch is not None or policy.reads_keys
        or policy.reads_values or bool(policy.head_state_specs)
    )
    keys, values = kv.dense() if wants_dense else (None, None)
    gain = policy.score_gain(query_pos[:, None], budget)
    options = dict(
        scaling=scaling, softcap=softcap, sliding_window=sliding_window, gqa_reduce=policy.gqa_reduce,
        score_gain=None if gain is None else gain[:, 0], need_mass=policy.decode_needs_mass,
    )
    if rotary is not None:
        others = (pos >= 0).sum(-1) - (new_pos >= 0).long()  # [B, H]: held tokens besides the new one
        ranks.index_put_((rows, cols, slot), others.clamp(min=0))
        attended_query = rotate_queries(query, ranks.gather(2, slot[:, :, None]), rotary)
        attention = decode_attention(
            attended_query[:, :, 0], rotate_at(keys, ranks, rotary), values, query_pos, pos, **options
        )
    else:
        attention = kv.attend(query[:, :, 0], pos, query_pos, **options)
    if store.keeps_attended:  # before eviction frees slots (their keys and values stay where they are)
        store.attended = (*((keys, values) if keys is not None else kv.dense()), pos.clone(), query_pos[:, None])
    out = attention.out[:, :, None]
    if store.sketch is not None:
        out = merge_sketch(
            policy.sketch, store.sketch, query, out, attention.lse[:, :, None], query_pos[:, None],
            scaling=scaling, softcap=softcap,
        )
    if sinks is not None:
        out = apply_attention_sinks(out, attention.lse[:, :, None], sinks)
    seen = store.seen.add_(real[:, 0].long())  # in place: a captured graph writes only buffers it was given
    view = SlotView(pos=pos, seen=seen, budget=budget, keys=keys, window=sliding_window)
    mass_rows = attention.mass[:, :, None]  # [B, H, 1, N]: the one query row is the step's whole mass
    if not policy.rows_needed:
        mass_rows = mass_rows[:, :, :0]
    observation = Observation(
        mass=attention.mass, rows=mass_rows, row_pos=query_pos[:, None], values=values,
        group_size=query.shape[1] // heads, gqa_reduce=policy.gqa_reduce, keys=keys, inserted=slot[:, :, None],
        sentence_start=sentence_start,
        **({} if query_rotary is None else {
            "queries": query, "query_pos": query_pos[:, None], "rotary": query_rotary, "scaling": scaling,
        }),
    )
    ranking.observe(policy, state, observation, view)
    if budget is None:
        return out
    most = store.most
    drop = decode_drop(view.valid.sum(-1), budget, policy.drop_amount(budget))
    if drop.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(drop.any()):
        # eager on CPU, where reading ``drop`` costs nothing: no head is over its budget, so the ranking
        # below would choose no victim. Skipping it saves Scissorhands, which evicts m = B/2 at once and
        # then nothing for B/2 steps, four sorts of the slots per layer and step (compiled, the graph
        # keeps its one branch-free path; on a GPU the read would wait for the device)
        return out
    victims, chosen = choose_evicted(
        ranking.priority(policy, state, view), pos, drop, most, ranking.tie_tolerance(policy)
    )
    if ranks is not None and most <= INCREMENTAL_RANKS_MOST:  # while the victims still hold their positions
        gone = torch.where(chosen, pos.gather(2, victims), LAST)  # [B, H, most] evicted positions
        ranks.sub_((gone[:, :, None, :] < pos[:, :, :, None]).sum(-1))
    release_evicted(policy, pos, state, victims, chosen, keys, store.sketch, (keys, values), coins)
    if ranks is not None and most > INCREMENTAL_RANKS_MOST:
        ranks.copy_(slot_ranks(pos))
    return out


def decode_in_order(
    store: DecodeStore, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float,
    softcap: float | None, sliding_window: int | None, sinks: torch.Tensor | None,
    sentence_start: torch.Tensor | None,
) -> torch.Tensor:
    """``decode_step`` for a cache kept in position order (``store.filled``), where nothing is scored or
    evicted: the token goes to slot ``filled`` and attention reads the slots up to it, every one visible,
    so the CPU kernel builds no mask (as transformers' SDPA call) and no slot is searched. Eager whether or
    not the store compiles: the few ops cost less than a compiled graph's call. Every row's token is real.

    Args:
        query: ``[B, H_q, 1, D]``; key/value: ``[B, H_kv, 1, D]``.
        sinks: ``[H_q]`` learned attention-sink logits, or ``None``.
        sentence_start: not read: nothing here ranks sentences.

    Returns:
        ``[B, H_q, 1, D_v]`` attention output.
    """
    slot = torch.full(key.shape[:2], store.filled, dtype=torch.long, device=key.device)
    store.kv.write(slot, key[:, :, 0], value[:, :, 0], store.seen[:, None].expand_as(slot))
    # a scatter at a tensor index: indexing at the int would compile one graph per step
    store.pos.scatter_(2, slot[..., None], store.seen[:, None, None].expand(*slot.shape, 1))
    query_pos = store.seen
    store.seen = store.seen + 1
    store.filled += 1
    keys, values = store.kv.dense()
    held = slice(0, store.filled)
    attention = decode_attention(
        query[:, :, 0], keys[:, :, held], values[:, :, held], query_pos, store.pos[:, :, held],
        scaling=scaling, softcap=softcap, sliding_window=sliding_window, gqa_reduce=store.policy.gqa_reduce,
        need_mass=False, all_visible=True,
    )
    if store.keeps_attended:
        store.attended = (keys[:, :, held], values[:, :, held], store.pos[:, :, held].clone(), query_pos[:, None])
    out = attention.out[:, :, None]
    if sinks is not None:
        out = apply_attention_sinks(out, attention.lse[:, :, None], sinks)
    return out


def compiled_decode_step() -> Callable:
    """``decode_step`` under ``torch.compile(fullgraph=True)``, built once per process.

    One compiled function serves every store: layers whose shapes agree share its graph (measured: 4
    graphs for slot counts 64-256 at batch 1 and 4), and automatic dynamic shapes (``dynamic=None``)
    give layers of other sizes (per-layer allocations, a growing full cache) one shape-generic graph
    instead of a graph per size.
    """
    global _COMPILED
    if _COMPILED is None:
        raise_recompile_limit()
        _COMPILED = torch.compile(decode_step, fullgraph=True, dynamic=None, options={"emulate_precision_casts": True})
    return _COMPILED


def raise_recompile_limit() -> None:
    """Let a process compile many decode graphs. Every policy structure (accumulator, prior, storage, sketch,
    drop path, positions) and every batch/slot shape class is a graph of the compiled step (or of a compiled
    decode forward); a process that runs many policies (an evaluation, the benchmarks) passes dynamo's
    default of 8, where fullgraph=True fails hard; the overhead benchmark alone (nine configurations, three
    slot counts, two batch sizes) needs more than 64."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)


_COMPILED: Callable | None = None
