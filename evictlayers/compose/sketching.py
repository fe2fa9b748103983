"""The stream sketch's side of a step (ClusterGen Algorithm 1, ``modules/cluster_sketch.py``): the
tokens a step evicts are absorbed, and attention over the exact slots is merged with the sketch of
everything absorbed so far. One home for both, used by the multi-token and the one-token step."""

from __future__ import annotations

import torch

from evictlayers.core.slots import LAST, along_slots
from evictlayers.modules import ClusterSketch, SketchState
from evictlayers.modules.cluster_sketch import CoinTable, merge_with_exact

ABSORB_BLOCK = 1024  # tokens per head absorbed per coin table when a multi-token step evicts many


def absorb_evicted(
    sketch: ClusterSketch, state: SketchState, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
    victims: torch.Tensor, chosen: torch.Tensor, coins: CoinTable | None = None,
) -> None:
    """Feed the evicted slots to the sketch in position order (Algorithm 1's stream order), before their
    slots are freed. ``keys``/``values`` ``[B, H, N, D]``, ``pos`` ``[B, H, N]``, ``victims``/``chosen``
    ``[B, H, W]`` (``compose/eviction.py``). ``coins``: a table covering ``W`` absorptions per head (the
    decode step's); ``None`` hashes one per block of ``ABSORB_BLOCK`` tokens (eager, a multi-token step)."""
    if victims.shape[-1] > 1:
        order = torch.where(chosen, pos.gather(2, victims), LAST).argsort(-1)
        victims, chosen = victims.gather(2, order), chosen.gather(2, order)
    for start in range(0, victims.shape[-1], ABSORB_BLOCK):
        block, mask = victims[..., start : start + ABSORB_BLOCK], chosen[..., start : start + ABSORB_BLOCK]
        table = coins if coins is not None else sketch.coin_table(state, block.shape[-1])
        sketch.absorb(
            state, keys.gather(2, along_slots(block, keys)), values.gather(2, along_slots(block, values)), mask, table,
        )


def merge_sketch(
    sketch: ClusterSketch, state: SketchState, query: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    query_pos: torch.Tensor, *, scaling: float, softcap: float | None,
) -> torch.Tensor:
    """``out`` ``[B, H_q, Q, D_v]`` (attention over the exact slots, ``lse`` ``[B, H_q, Q]`` its log-sum-exp)
    merged with the sketch of the absorbed tokens (every absorbed token precedes every query, so all of
    them see all of it); ``query`` ``[B, H_q, Q, D]``, ``query_pos`` ``[B, Q]`` (``-1``: padding, output 0)."""
    batch, q_heads, q_len, head_dim = query.shape
    group = q_heads // state.representatives.shape[1] * q_len  # queries per KV head
    flat = query.reshape(batch, q_heads * q_len, head_dim)  # (h_kv, g, q) order, as the group needs
    terms = sketch.sketch_terms(state, flat, scaling, group, softcap=softcap)
    merged = merge_with_exact(out.reshape(batch, q_heads * q_len, -1), lse.reshape(batch, -1), *terms)
    merged = merged.view(batch, q_heads, q_len, -1)
    return torch.where((query_pos >= 0)[:, None, :, None], merged, torch.zeros_like(merged))
