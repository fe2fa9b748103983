"""Decode attention on CPU: the C++ slot ops, or PyTorch's fused flash attention where they are not built.

Same signature and result as ``naive.py``. The backend is ``naive.py``'s steps (logits once for output and
mass) with its two matmuls and the softmax between them done by ``slots_cpu.py``'s C++ ops, which read each
slot once for every query row of its GQA group, whether or not the mass is wanted, so they also serve the
steps that need no mass in place of the fused op transformers' SDPA path runs
(``_scaled_dot_product_flash_attention_for_cpu``; ``python -m benchmarks --only cpu_kernel`` times both
against a plain read of the slots). Where the ops cannot be built (no C++ compiler) or a gradient is
wanted, a step that needs no mass (a full cache, StreamingLLM, key-geometry scorers:
``Policy.decode_needs_mass``) goes through the fused op: blocks of slots with an online softmax, the ``G``
query heads of a GQA group as its ``G`` query rows over their KV head (nothing expanded or copied), and
visibility (filled, not in the future, inside the window) an additive ``0 / -inf`` bias shared by the
group's rows, left out where the caller promises every slot is visible (``all_visible``: a full cache whose
slots hold the row's tokens in order, sliced to them). A step that needs the mass, a softcap or value heads
of another size than the keys then takes ``naive.py`` itself (``torch.matmul`` and PyTorch's softmax).
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
    """``naive.py``'s ``decode_attention_with_mass`` through the C++ slot ops, or the fused op where they
    are not built and the mass is not wanted; see it for the arguments.

    ``all_visible``: the caller's promise that every slot holds a token every query row may see (none
    empty, none past the query, none outside a window, no padding query), so the fused op builds no mask;
    the result is the same as without it whenever the promise holds."""
    options = {"scaling": scaling, "softcap": softcap, "sliding_window": sliding_window, "gqa_reduce": gqa_reduce,
               "score_gain": score_gain, "need_mass": need_mass}
    if slots_cpu.serves(query, key, value):
        return decode_attention_with(slots_cpu.slot_logits, slots_cpu.slot_values, query, key, value, query_pos,
                                     key_pos, softmax_of=slots_cpu.softmax_mass, **options)
    if need_mass or softcap is not None or value.shape[-1] != key.shape[-1]:
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
