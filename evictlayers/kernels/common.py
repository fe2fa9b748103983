"""What every attention backend shares: the result types, the GQA reduction, the input checks, the test for
slots in position order.

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
        mass: ``[B, H_kv, N]`` float32 scoring probability of each slot, reduced over its GQA group; all
            zeros when the caller passed ``need_mass=False`` (then nothing of it is computed).
        lse: ``[B, H_q]`` float32 log-sum-exp of the model's scaled (soft-capped) logits over the visible
            slots, ``-inf`` when none is visible (a padding query): the softmax normaliser in log space,
            which lets another source of keys (``ClusterSketch``'s sketch of evicted tokens) be merged
            with ``out`` exactly. The score gain never enters it.
    """

    out: torch.Tensor
    mass: torch.Tensor
    lse: torch.Tensor


def no_mass(batch: int, kv_heads: int, n_slots: int, device: torch.device) -> torch.Tensor:
    """The ``[B, H_kv, N]`` float32 zeros a backend returns as the mass under ``need_mass=False``: one
    zero broadcast (stride 0), so skipping the mass costs no buffer of the slots' size either."""
    return torch.zeros((), dtype=torch.float32, device=device).expand(batch, kv_heads, n_slots)


def reduce_group(per_head: torch.Tensor, how: str) -> torch.Tensor:
    """Combine the query heads of each GQA group: ``[B, H_kv, G, ...]`` -> ``[B, H_kv, ...]``."""
    if how == "sum":
        return per_head.sum(dim=2)
    if how == "mean":
        return per_head.mean(dim=2)
    return per_head.amax(dim=2)


def check_devices(query: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming every one of ``tensors`` (``None`` skipped) that is not on ``query``'s device."""
    elsewhere = [name for name, t in tensors.items() if t is not None and t.device != query.device]
    if elsewhere:
        raise ValueError(f"{', '.join(elsewhere)} must be on the query's device ({query.device})")


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
    check_devices(query, key=key, value=value, query_pos=query_pos, key_pos=key_pos, score_gain=score_gain)
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


def check_packed_inputs(
    query: torch.Tensor,
    packed,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    residual_pos: torch.Tensor,
    *,
    gqa_reduce: str,
    score_gain: torch.Tensor | None,
) -> int:
    """``check_inputs`` for the quantised decode op (``quantized_decode/``): the dense residual as the
    keys and values, then the codes (a ``PackedKV``) against it; returns ``G``. Shapes and dtypes only."""
    if query.dim() != 3:
        raise ValueError(f"quantised decode attention takes one query per row, [B, H_q, D]; got {tuple(query.shape)}")
    if residual_keys.dim() == 4 and tuple(residual_pos.shape) != tuple(residual_keys.shape[:3]):
        raise ValueError(
            f"residual_pos has shape {tuple(residual_pos.shape)}, expected {tuple(residual_keys.shape[:3])} "
            "(one per residual slot)"
        )
    groups = check_inputs(
        query, residual_keys, residual_values, query_pos, residual_pos, gqa_reduce=gqa_reduce, score_gain=score_gain
    )
    if packed.bits not in (4, 8) or packed.group < 1:
        raise ValueError(
            f"packed codes: bits must be 4 or 8 and group >= 1, got bits={packed.bits} group={packed.group}"
        )
    batch, kv_heads, _, head_dim = residual_keys.shape
    value_dim = residual_values.shape[-1]
    per_byte = 2 if packed.bits == 4 else 1
    if key_pos.dim() != 3 or tuple(key_pos.shape[:2]) != (batch, kv_heads):
        raise ValueError(f"key_pos has shape {tuple(key_pos.shape)}, expected [B, H_kv, C] = [{batch}, {kv_heads}, C]")
    n_slots = key_pos.shape[-1]
    expected = {
        "key_codes": ((batch, kv_heads, n_slots, head_dim // per_byte), torch.uint8),
        "key_scale": ((batch, kv_heads, n_slots, head_dim // packed.group), None),
        "key_zero": ((batch, kv_heads, n_slots, head_dim // packed.group), None),
        "key_channel_scale": ((batch, kv_heads, 1, head_dim), torch.float32),
        "value_codes": ((batch, kv_heads, n_slots, value_dim // per_byte), torch.uint8),
        "value_scale": ((batch, kv_heads, n_slots, value_dim // packed.group), None),
        "value_zero": ((batch, kv_heads, n_slots, value_dim // packed.group), None),
    }
    if any(dim % packed.group or dim % per_byte for dim in (head_dim, value_dim)):
        raise ValueError(
            f"packed codes: group {packed.group} must divide the head dims {head_dim} and {value_dim}"
            + (" (even for int4)" if per_byte == 2 else "")
        )
    for name, (shape, dtype) in expected.items():
        tensor = getattr(packed, name)
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            raise ValueError(
                f"packed codes: {name} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                f"{dtype or 'a float'} {shape} for {packed.bits}-bit codes in groups of {packed.group}"
            )
    check_devices(query, **{name: getattr(packed, name) for name in expected}, key_pos=key_pos)
    return groups


def in_order(query_pos: torch.Tensor, key_pos: torch.Tensor) -> bool:
    """Whether every row's slots hold consecutive positions from a non-negative first one, the same at every
    head, and its ``Q`` queries are the last ``Q`` of them: then query ``i`` sees exactly slots ``0 ..
    i + N - Q`` (before any window), which the prefill kernels (``prefill/mass_cpu.py``, ``prefill/triton.py``)
    read from the indices alone. ``query_pos`` ``[B, Q]``, ``key_pos`` ``[B, H_kv, N]``."""
    q_len, n_slots = query_pos.shape[1], key_pos.shape[2]
    if q_len > n_slots:
        return False
    start = key_pos[:, :1, :1]
    expected = start + torch.arange(n_slots, device=key_pos.device)
    # one host sync for the three tests: on a GPU each costs more than a short prompt's attention
    queries_last = (query_pos == expected[:, 0, n_slots - q_len :]).all()
    return bool((start >= 0).all() & (key_pos == expected).all() & queries_last)
