"""Decode attention over quantised slots, the plain PyTorch reference: dequantise, then the naive decode.

The slots of a ``QuantizedKV`` storage are ``C`` slots of group-wise codes (``PackedKV``, KIVI's layout:
Liu et al. 2024) plus ``R`` residual slots holding the newest tokens dense. This reference dequantises
every code slot into a dense copy, appends the residual and runs ``decode/naive.py``: exactly what
attention over ``QuantizedSlots.dense()`` computes, which is what the other backends must reproduce
without the copy.
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import DecodeAttention, check_packed_inputs
from evictlayers.kernels.decode.naive import decode_attention_with_mass
from evictlayers.kernels.quantization import PackedKV


def quantized_decode_attention_with_mass(
    query: torch.Tensor,
    packed: PackedKV,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    residual_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    need_mass: bool = True,
) -> DecodeAttention:
    """One query per row attending over code slots and dense residual slots (every backend's signature).

    Args:
        query: ``[B, H_q, D]``.
        packed: the ``C`` code slots per ``(b, h)`` (``kernels/quantization.py``).
        residual_keys, residual_values: ``[B, H_kv, R, D]`` / ``[B, H_kv, R, D_v]`` dense slots, in the
            dtype the dequantised keys and values are cast to (the model's) before the matmuls.
        query_pos: ``[B]``; key_pos: ``[B, H_kv, C]`` position of the token each code slot holds and
            residual_pos ``[B, H_kv, R]`` that of each residual slot, ``-1`` where a slot holds nothing to
            attend to (empty, or a code slot whose token is held in the residual).
        scaling, softcap, sliding_window, gqa_reduce, score_gain, need_mass: as ``decode/naive.py``.

    Returns:
        ``DecodeAttention`` whose mass is ``[B, H_kv, C + R]``: the code slots, then the residual slots.
    """
    check_packed_inputs(
        query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos,
        gqa_reduce=gqa_reduce, score_gain=score_gain,
    )
    dtype = residual_keys.dtype
    keys = torch.cat([packed.keys(dtype), residual_keys], 2)
    values = torch.cat([packed.values(dtype), residual_values], 2)
    return decode_attention_with_mass(
        query, keys, values, query_pos, torch.cat([key_pos, residual_pos], 2), scaling=scaling, softcap=softcap,
        sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain, need_mass=need_mass,
    )
