"""A probe step of a slot store: tokens that attend and feed the scorers, and are never stored.

A probe's tokens attend over the held slots and, causally, over each other, at the positions after the
tokens seen, as a multi-token step's would; the scorers then see each probe row's probabilities over the
held slots (``Observation.probe``), and nothing else of the store changes: slots, positions, per-head state,
the tokens seen and ``seq_len`` are what they were, and the probe's own keys and values are dropped. It is
how KVzip's context reconstruction scores a cached context (``ContextReconstruction``,
``EvictionRun.compress_context``): the model is asked to repeat the context, and the attention each cached
token gets while it does is the token's score.

The probe's rows are fed in blocks, so a long probe never holds more than about ``PROBE_ROW_ELEMENTS``
probabilities at once (one block's rows over every slot); one probe may therefore make several observations,
each over the same held slots. Eager only: a probe has the shapes of a prefill.
"""

from __future__ import annotations

import torch

from evictlayers.compose import ranking
from evictlayers.compose.step_state import PrefillStore, token_positions
from evictlayers.kernels import apply_attention_sinks, prefill_attention
from evictlayers.scoring import Observation, SlotView

PROBE_ROW_ELEMENTS = 1 << 24  # probabilities of one block of probe rows: [B, H_kv, rows, slots] float32, 64 MiB


def probe_step(
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
) -> torch.Tensor:
    """Attend the probe's tokens over the held slots and themselves, let the scorers observe every probe row over
    the held slots, and store nothing: only the scorers' per-slot state of the held slots changes.

    Args:
        query: ``[B, H_q, Q, D]``; key/value: ``[B, H_kv, Q, D]`` for the ``Q`` probe tokens, at positions
            ``seen``, ``seen + 1``, ... per row (``token_positions``), as a step's tokens would be.
        real: ``[B, Q]`` bool, ``False`` for padding (whose output is zero and whose rows are zero).
        sinks: ``[H_q]`` learned attention-sink logits, or ``None``; the scorers see each slot's probability
            without the sink's share, as at any step.

    Returns:
        ``[B, H_q, Q, D_v]`` attention output.
    """
    policy = store.policy
    batch, kv_heads, q_len, _ = key.shape
    query_pos = token_positions(store.seen, real)
    held_keys, held_values = store.kv.dense()
    held = store.capacity
    keys = torch.cat([held_keys, key], dim=2)
    values = torch.cat([held_values, value], dim=2)
    pos = torch.cat([store.pos, query_pos[:, None, :].expand(batch, kv_heads, q_len)], dim=2)
    if store.keeps_attended:  # a KV-sharing layer attends over the same slots and tokens
        store.attended = (keys, values, pos.clone(), query_pos)
    view = SlotView(pos=store.pos, seen=store.seen, budget=store.budget, keys=held_keys, window=sliding_window)
    inserted = torch.zeros(batch, kv_heads, 0, dtype=torch.long, device=key.device)
    out = torch.empty(*query.shape[:3], values.shape[-1], dtype=query.dtype, device=query.device)
    block = max(1, PROBE_ROW_ELEMENTS // max(1, batch * kv_heads * keys.shape[2]))
    for start in range(0, q_len, block):
        rows = slice(start, min(start + block, q_len))
        lse = None
        if sinks is not None:
            lse = torch.empty(query[:, :, rows].shape[:3], dtype=torch.float32, device=query.device)
        attention = prefill_attention(
            query[:, :, rows], keys, values, query_pos[:, rows], pos,
            scaling=scaling, softcap=softcap, sliding_window=sliding_window, gqa_reduce=policy.gqa_reduce,
            score_gain=policy.score_gain(query_pos[:, rows], store.budget), keep_rows=rows.stop - rows.start,
            lse_out=lse, need_mass=policy.reads_mass,
        )
        out[:, :, rows] = attention.out if sinks is None else apply_attention_sinks(attention.out, lse, sinks)
        observation = Observation(
            mass=attention.mass[:, :, :held],
            rows=attention.rows[:, :, :, :held],
            row_pos=query_pos[:, rows],
            values=held_values,
            group_size=query.shape[1] // kv_heads,
            gqa_reduce=policy.gqa_reduce,
            keys=held_keys,
            inserted=inserted,
            probe=True,
        )
        ranking.observe(policy, store.state, observation, view)
    return out
