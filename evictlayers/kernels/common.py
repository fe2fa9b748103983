"""What every attention backend shares: the result types, the GQA reduction, the input checks.

Both ops attend over unordered KV slots addressed by original position and also report the
probability mass each slot received. Every backend of an op (``prefill/``, ``decode/``) takes the same
arguments and returns the same type; the checks here run at the entry of each, so a bad call fails
with the same message whichever backend serves it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GQA_REDUCTIONS = ("sum", "mean", "max")


class AttentionMass(NamedTuple):
    """What a prefill backend returns.

    Attributes:
        out: ``[B, H_q, Q, D_v]`` attention output, in the query dtype (zero for padding queries).
        mass: ``[B, H_kv, N]`` float32 scoring probability each slot received, summed over the
            queries and reduced over each GQA group; all zeros when the caller passed
            ``need_mass=False`` (then nothing of it is computed).
        rows: ``[B, H_kv, R, N]`` float32 scoring probabilities of the last ``R = min(keep_rows, Q)``
            queries, each reduced over its GQA group (``R = 0`` when not asked for).
    """

    out: torch.Tensor
    mass: torch.Tensor
    rows: torch.Tensor


class DecodeAttention(NamedTuple):
    """What a decode backend returns.

    Attributes:
        out: ``[B, H_q, D_v]`` attention output in the query dtype (zero for a padding query).
        mass: ``[B, H_kv, N]`` float32 scoring probability of each slot, reduced over its GQA group.
        lse: ``[B, H_q]`` float32 log-sum-exp of the model's scaled (soft-capped) logits over the visible
            slots, ``-inf`` when none is visible (a padding query): the softmax normaliser in log space,
            which lets another source of keys (``ClusterSketch``'s sketch of evicted tokens) be merged
            with ``out`` exactly. The score gain never enters it.
    """

    out: torch.Tensor
    mass: torch.Tensor
    lse: torch.Tensor


def reduce_group(per_head: torch.Tensor, how: str) -> torch.Tensor:
    """Combine the query heads of each GQA group: ``[B, H_kv, G, ...]`` -> ``[B, H_kv, ...]``."""
    if how == "sum":
        return per_head.sum(dim=2)
    if how == "mean":
        return per_head.mean(dim=2)
    return per_head.amax(dim=2)


def check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    gqa_reduce: str,
    score_gain: torch.Tensor | None,
    lse_out: torch.Tensor | None = None,
    keep_rows: int = 0,
    max_chunk_elements: int = 1,
) -> int:
    """Raise ``ValueError`` naming the argument when the shapes or options do not fit; return ``G``.

    A decode call has a 3-D query ``[B, H_q, D]`` and ``query_pos`` ``[B]``; a prefill call a 4-D
    query ``[B, H_q, Q, D]`` and ``query_pos`` ``[B, Q]``. Only shapes and dtypes are read (no tensor
    value), so the check traces into the compiled decode step without a host synchronisation.
    """
    if gqa_reduce not in GQA_REDUCTIONS:
        raise ValueError(f"gqa_reduce={gqa_reduce!r} is not one of {GQA_REDUCTIONS}")
    if query.dim() not in (3, 4) or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"expected query [B, H_q, D] (decode) or [B, H_q, Q, D] (prefill), key [B, H_kv, N, D] and value "
            f"[B, H_kv, N, D_v]; got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    batch, q_heads, head_dim = query.shape[0], query.shape[1], query.shape[-1]
    _, kv_heads, n_slots, _ = key.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must share [B, H_kv, N], with B and the key "
            f"head size those of query {tuple(query.shape)}"
        )
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})")
    rows_shape = (batch,) if query.dim() == 3 else (batch, query.shape[2])  # one per query
    if tuple(query_pos.shape) != rows_shape:
        raise ValueError(f"query_pos has shape {tuple(query_pos.shape)}, expected {rows_shape} (one per query)")
    if tuple(key_pos.shape) != (batch, kv_heads, n_slots):
        raise ValueError(f"key_pos has shape {tuple(key_pos.shape)}, expected {(batch, kv_heads, n_slots)}")
    if score_gain is not None and tuple(score_gain.shape) != rows_shape:
        raise ValueError(f"score_gain has shape {tuple(score_gain.shape)}, expected {rows_shape} (one per query)")
    if lse_out is not None:
        lse_shape = tuple(query.shape[:-1])
        if tuple(lse_out.shape) != lse_shape or lse_out.dtype != torch.float32 or lse_out.device != query.device:
            raise ValueError(
                f"lse_out must be a float32 tensor of shape {lse_shape} on {query.device}; got {lse_out.dtype} "
                f"{tuple(lse_out.shape)} on {lse_out.device}"
            )
    if keep_rows < 0 or max_chunk_elements < 1:
        raise ValueError(f"keep_rows ({keep_rows}) must be >= 0 and max_chunk_elements ({max_chunk_elements}) >= 1")
    return q_heads // kv_heads
