"""One multi-token step of a slot store (a prompt, or a chunk of one): attend, score, keep the best.

The step's tokens are concatenated onto the held slots for this step only; attention over the
concatenation measures each slot's probability mass (``kernels/prefill/``, queries in chunks, so a long
prompt never materialises an ``n x n`` matrix), the policy scores from it, and each head keeps its best
``budget`` slots, compacted into a fresh ``budget + 1`` store whose spare slot is where the next decoded
token lands. Shapes vary with the step, so unlike ``compose/decode_step.py`` this runs eagerly and may read
tensors on the host. With ``CrossLayer`` the selection may wait on the cache's board until the last
ranking layer has run (``compose/cross_layer.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from evictlayers.compose import ranking
from evictlayers.compose.eviction import choose_evicted, excess, release_evicted
from evictlayers.compose.positions import rotate_at, rotate_queries, slot_ranks
from evictlayers.compose.sketching import merge_sketch
from evictlayers.compose.step_state import PrefillStore, change_per_slot, token_positions
from evictlayers.core.slots import along_slots, pad_slots
from evictlayers.kernels import apply_attention_sinks, prefill_attention
from evictlayers.modules import DenseSlots, QuantizedSlots
from evictlayers.scoring import Observation, SlotView


def prefill_step(
    store: PrefillStore,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    real: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    sentence_start: torch.Tensor | None,
) -> torch.Tensor:
    """Insert the step's tokens, attend over the held slots and them, score, keep each head's best
    ``budget``; replaces ``store.kv``/``pos``/``state`` (and ``ranks``, ``filled``, ``most``) and advances
    ``store.seen`` and ``store.seq_len``.

    Args:
        query: ``[B, H_q, Q, D]``; key/value: ``[B, H_kv, Q, D]`` for the ``Q`` new tokens.
        real: ``[B, Q]`` bool, ``False`` for padding tokens (never stored).
        sinks: ``[H_q]`` learned attention-sink logits (``kernels/attention_sinks.py``), or ``None``; the
            scorers see each key's probability without the sink's share.
        sentence_start: ``[B, Q]`` int64 where each token's sentence starts, for a policy that ranks
            sentences (``None`` otherwise).

    Returns:
        ``[B, H_q, Q, D_v]`` attention output (zero for padding queries).
    """
    policy = store.policy
    batch, kv_heads, q_len, _ = key.shape
    query_pos = token_positions(store.seen, real)
    new_pos = query_pos[:, None, :].expand(batch, kv_heads, q_len)
    first_new = store.capacity  # the step's tokens follow the held slots in the concatenation
    gapless = store.kv is None or store.filled == first_new  # no empty slot before the step's tokens
    group = query.shape[1] // kv_heads
    keys, values, pos, state = _concatenated(store, key, value, new_pos, group)

    # a later multi-token step (chunked prefill) after tokens were absorbed merges the sketch as a
    # decode step does, with each query's log-sum-exp over the slots it sees
    merge = store.sketch is not None and bool(store.sketch.absorbed.any())
    wants_lse = merge or sinks is not None
    lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device) if wants_lse else None
    attended_query, attended_keys = query, keys
    if policy.positions == "rolling":
        ranks = slot_ranks(pos)
        table = store.rotary.rows(keys.shape[2], keys.device, keys.dtype)
        attended_keys = rotate_at(keys, ranks, table)
        attended_query = rotate_queries(query, ranks[:, :, first_new:], table)
    attention = prefill_attention(
        attended_query, attended_keys, values, query_pos, pos,
        scaling=scaling, softcap=softcap, sliding_window=sliding_window, gqa_reduce=policy.gqa_reduce,
        score_gain=policy.score_gain(query_pos, store.budget), keep_rows=policy.rows_needed,
        lse_out=lse, need_mass=policy.reads_mass,
    )
    if store.keeps_attended:  # a KV-sharing layer attends over the same slots and tokens, before eviction
        store.attended = (keys, values, pos.clone(), query_pos)
    out = attention.out
    if merge:
        out = merge_sketch(policy.sketch, store.sketch, query, out, lse, query_pos, scaling=scaling, softcap=softcap)
    if sinks is not None:
        out = apply_attention_sinks(out, lse, sinks)
    n_rows = attention.rows.shape[2]
    observation = Observation(
        mass=attention.mass,
        rows=attention.rows,
        row_pos=query_pos[:, q_len - n_rows :],
        values=values,
        group_size=group,
        gqa_reduce=policy.gqa_reduce,
        keys=keys,
        inserted=torch.arange(first_new, first_new + q_len, device=key.device).expand(batch, kv_heads, q_len),
        sentence_start=sentence_start,
        **(_query_fields(store, query, query_pos, scaling) if policy.reads_queries else {}),
        deferred=store.deferred,
    )
    store.seen = store.seen + real.sum(1)
    store.seq_len += q_len
    view = SlotView(pos=pos, seen=store.seen, budget=store.budget, keys=keys, window=sliding_window)
    ranking.observe(policy, state, observation, view)
    if store.kv is None:
        slots = policy.storage.from_dense(keys, values, pos, layer=store.layer_idx)
    else:
        slots = store.kv.append(key, value, new_pos)

    def select(cross_layer: torch.Tensor | None = None) -> None:
        selected = view if cross_layer is None else dataclasses.replace(view, cross_layer=cross_layer)
        ranking.prepare(policy, state, selected)
        _keep_best(store, slots, pos, state, selected)
        if policy.positions == "rolling":
            store.ranks = slot_ranks(store.pos)
        store.filled = store.seq_len if gapless and _in_order(store, key, real) else None

    if store.deferred:  # held whole, as a full cache, until the probes have run (``evict_deferred``)
        store.kv, store.pos, store.state, store.filled = slots, pos, state, None
        store.deferred_window = sliding_window
        if policy.positions == "rolling":
            store.ranks = slot_ranks(store.pos)
        return out
    board = store.board
    if board is None:
        select()
        return out
    board.begin(store.layer_idx)
    if store.ranking_layer:
        board.publish(store.layer_idx, attention.rows[:, :, -1], pos, store.seen)
    if store.budget is None or policy.cross_layer is None:
        select()
    elif board.complete:
        select(board.scores)
    else:  # hold the whole step, as a full cache, until the last ranking layer has run
        store.kv, store.pos, store.state, store.filled = slots, pos, state, None
        board.wait(store.layer_idx, select)
    return out


def _query_fields(store: PrefillStore, query: torch.Tensor, query_pos: torch.Tensor, scaling: float) -> dict:
    """The ``Observation`` fields a scorer that reads queries gets (``Policy.reads_queries``): the step's queries
    and their positions, the model's scaling, and the layer's rotary table as float32 rotations with a row for
    every offset within the step and at least the policy's ``rotary_rows``."""
    rows = max(store.policy.rotary_rows, query.shape[2] + 1)
    table = store.rotary.rows(rows, query.device, torch.float32)
    return {"queries": query, "query_pos": query_pos, "rotary": table, "scaling": scaling}


def _concatenated(store: PrefillStore, key: torch.Tensor, value: torch.Tensor, new_pos: torch.Tensor, group: int):
    """``(keys, values, pos, state)``: the held slots followed by the step's ``Q`` tokens (``key``/``value``
    ``[B, H_kv, Q, D]`` at ``new_pos`` ``[B, H_kv, Q]``), their per-slot state zero; per-head state as held.
    ``group``: query heads per KV head (a state size written ``"group"``)."""
    batch, heads, q_len, _ = key.shape
    fresh = _new_state(store, batch, heads, q_len, key.device, group, key.shape[-1])
    head_state = _head_state(store, key, group)
    if store.kv is None:
        return key, value, new_pos.clone(), {**fresh, **head_state}
    keys, values = store.kv.dense()
    return (
        torch.cat([keys, key], dim=2),
        torch.cat([values, value], dim=2),
        torch.cat([store.pos, new_pos], dim=2),
        {**{name: torch.cat([store.state[name], fresh[name]], dim=2) for name in fresh}, **head_state},
    )


def _sizes(shape: tuple, head_dim: int, group: int) -> tuple[int, ...]:
    """A state shape with its named sizes filled: ``"head_dim"`` the key width, ``"group"`` the GQA group."""
    return tuple(head_dim if size == "head_dim" else group if size == "group" else size for size in shape)


def _new_state(
    store: PrefillStore, batch: int, heads: int, slots: int, device: torch.device, group: int = 1, head_dim: int = 0
) -> dict[str, torch.Tensor]:
    """The policy's per-slot state for ``slots`` new slots: ``[B, H_kv, slots, *shape]`` zeros."""
    return {
        name: torch.zeros(batch, heads, slots, *_sizes(shape, head_dim, group), dtype=torch.float32, device=device)
        for name, shape in store.policy.state_specs.items()
    }


def _head_state(store: PrefillStore, key: torch.Tensor, group: int = 1) -> dict[str, torch.Tensor]:
    """The per-head state: held over from earlier steps, or zeros at the first."""
    batch, heads, _, head_dim = key.shape
    return {
        name: store.state[name] if name in store.state else torch.zeros(
            batch, heads, *_sizes(shape, head_dim, group), dtype=torch.float32, device=key.device,
        )
        for name, shape in store.policy.head_state_specs.items()
    }


def _in_order(store: PrefillStore, key: torch.Tensor, real: torch.Tensor) -> bool:
    """Whether this step keeps the slots in position order with no gap (``filled``): a full cache (a
    sliding window or a sketch comes with a budget) of dense keys on CPU, no rolling positions, nothing
    that scores, and no padding in the step (one host read of ``real``, free on CPU)."""
    policy = store.policy
    return (
        store.budget is None and key.device.type == "cpu" and policy.positions != "rolling"
        and not policy.state_specs and not policy.head_state_specs and store.kv.free_dense and bool(real.all())
    )


def evict_deferred(store: PrefillStore) -> None:
    """The selection the held steps of a deferring store skipped (``SlotStore.defer``): each head keeps its best
    ``budget`` of every slot it holds, by ``_keep_best`` as a multi-token step would, after ``prepare`` (its
    scorers' state as the probes left it); the window is the one the held steps attended with."""
    policy = store.policy
    view = SlotView(pos=store.pos, seen=store.seen, budget=store.budget, keys=store.kv.dense()[0],
                    window=store.deferred_window)
    ranking.prepare(policy, store.state, view)
    _keep_best(store, store.kv, store.pos, store.state, view)
    if policy.positions == "rolling":
        store.ranks = slot_ranks(store.pos)
    store.filled = None


def _keep_best(
    store: PrefillStore, slots: DenseSlots | QuantizedSlots, pos: torch.Tensor, state: dict[str, torch.Tensor],
    view: SlotView,
) -> None:
    """Each head keeps its best ``budget`` slots (``compose/eviction.py``, the rule a decode step evicts by),
    compacted into a ``budget + 1`` store in slot order.

    ``slots`` is the storage holding the old slots followed by the step's tokens, in the order of ``pos``
    ``[B, H_kv, N]``."""
    policy, budget = store.policy, store.budget
    if budget is None:
        store.kv, store.pos, store.state = slots, pos, state
        return
    keep = int(budget.max())
    store.most = min(int(policy.drop_amount(budget).max()), keep + 1)
    if store.bound == "window":  # one token slides out of the window a step: drop it, not a batch of m
        store.most = 1
    drop = excess(view.valid.sum(-1), budget)  # [B, H]
    width = int(drop.max())
    if width:
        victims, chosen = choose_evicted(ranking.priority(policy, state, view), pos, drop, width)
        if store.sketch is not None:  # what is dropped is absorbed (after the step's own exact attention)
            store.invalidate_coins()
        # pos is this step's concatenation, so freeing its slots in place touches no held tensor
        release_evicted(
            policy, pos, state, victims, chosen, view.keys, store.sketch,
            slots.dense() if store.sketch is not None else None,
        )
    # the held slots first, in slot order; the capacity is budget + 1 whatever the step's width
    order = (pos < 0).to(torch.int8).argsort(dim=-1, stable=True)[..., : min(keep, pos.shape[2])]
    spare = keep + 1 - order.shape[-1]
    store.pos = pad_slots(pos.gather(2, order), spare, -1)
    store.kv = slots.gather(order)
    store.kv.grow(spare)
    store.state = change_per_slot(
        state, policy.state_specs, lambda t: pad_slots(t.gather(2, along_slots(order, t)), spare, 0.0)
    )
    ranking.settle(
        policy, store.state,
        SlotView(pos=store.pos, seen=store.seen, budget=budget, keys=store.kv.dense()[0], window=view.window),
    )
