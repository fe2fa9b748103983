"""Decode attention on CPU: PyTorch's fused flash attention where no scorer reads the mass.

Same signature and result as ``naive.py``. A policy whose decode step reads no mass (a full cache,
StreamingLLM, key-geometry scorers: ``Policy.decode_needs_mass``) needs the output and the log-sum-exp
only, which is what ``_scaled_dot_product_flash_attention_for_cpu`` returns (the kernel transformers'
SDPA path runs): blocks of slots with an online softmax, no ``[B, H, N]`` probabilities written and read
back. The ``G`` query heads of a GQA group are the op's ``G`` query rows over their KV head, so nothing
is expanded or copied; visibility (filled, not in the future, inside the window) is an additive
``0 / -inf`` bias shared by the group's rows, left out where the caller promises every slot is visible
(``all_visible``: a full cache whose slots hold the row's tokens in order, sliced to them), which takes the
op's unmasked path as transformers' call does (measured with SmolLM2's shapes, 4,096 slots, 30 layers'
worth of separate buffers, one thread: ~10% less time per call than the masked one, before the bias it
no longer builds). Where the mass is wanted, or where the op cannot express the call (softcap, value
heads of another size than the keys), this backend is ``naive.py``'s steps (logits once for output and
mass) with its two matmuls and the softmax between them done by ``slots_cpu.py``'s C++ ops, which read each
slot once for every query row of its GQA group (``torch.matmul`` and PyTorch's softmax where those cannot be
built, or a gradient is wanted).
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import DecodeAttention, check_inputs, no_mass
from evictlayers.kernels.decode import slots_cpu
from evictlayers.kernels.decode.naive import decode_attention_with, decode_attention_with_mass

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def decode_attention_with_mass_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    need_mass: bool = True,
    all_visible: bool = False,
) -> DecodeAttention:
    """``naive.py``'s ``decode_attention_with_mass`` through the fused op when the mass is not wanted; see
    it for the arguments.

    ``all_visible``: the caller's promise that every slot holds a token every query row may see (none
    empty, none past the query, none outside a window, no padding query), so no mask is built; the
    result is the same as without it whenever the promise holds."""
    if need_mass or softcap is not None or value.shape[-1] != key.shape[-1]:
        options = {"scaling": scaling, "softcap": softcap, "sliding_window": sliding_window, "gqa_reduce": gqa_reduce,
                   "score_gain": score_gain, "need_mass": need_mass}
        if slots_cpu.serves(query, key, value):
            return decode_attention_with(slots_cpu.slot_logits, slots_cpu.slot_values, query, key, value, query_pos,
                                         key_pos, softmax_of=slots_cpu.softmax_mass, **options)
        return decode_attention_with_mass(query, key, value, query_pos, key_pos, **options)
    groups = check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain)
    batch, q_heads, head_dim = query.shape
    kv_heads, n_slots = key_pos.shape[1:]
    grouped = query.view(batch, kv_heads, groups, head_dim).to(key.dtype)
    if all_visible:
        out, lse = _FLASH(grouped, key, value, scale=scaling)
        return DecodeAttention(
            out.reshape(batch, q_heads, -1).to(query.dtype), no_mass(batch, kv_heads, n_slots, query.device),
            lse.float().reshape(batch, q_heads),
        )
    q_pos = query_pos[:, None, None]
    visible = (key_pos >= 0) & (key_pos <= q_pos) & (q_pos >= 0)
    if sliding_window is not None:
        visible &= q_pos - key_pos < sliding_window
    bias = torch.where(visible, 0.0, float("-inf")).to(key.dtype)[:, :, None, :].expand(-1, -1, groups, -1)
    out, lse = _FLASH(grouped, key, value, attn_mask=bias, scale=scaling)
    # a row that sees nothing (a padding query): the op's output and LSE for it are not the contract's
    seeing = visible.any(-1)[:, :, None]  # [B, H_kv, 1]
    out = torch.where(seeing[..., None], out, 0.0)
    lse = torch.where(seeing, lse.float(), float("-inf"))
    return DecodeAttention(
        out.reshape(batch, q_heads, -1).to(query.dtype), no_mass(batch, kv_heads, n_slots, query.device),
        lse.reshape(batch, q_heads),
    )
