"""Prefill attention with mass from PyTorch's own fused attention plus one mass pass.

Same signature and result as ``prefill/naive.py`` (the reference). For a causal prompt in slot order, the
common first chunk of a prompt, the attention output and each query row's log-sum-exp ``LSE_i`` come from a
fused attention op of PyTorch, and the mass from one more pass over the queries and keys (never the values):
``prefill/triton.py``'s ``mass_from_lse``, its two-pass mode's second pass, recomputes the logits block by
block and sums ``exp(x_ij - LSE_i)`` over the queries per slot, then reduces over the GQA group.

What serves which inputs:

- inputs this backend serves: the slots hold consecutive positions, the queries are the last of them
  (``common.in_order``: no padding, no empty slot; query ``i`` sees slots up to ``i + N - Q``, a causal mask
  aligned to the bottom right), no soft-cap (no fused op of PyTorch takes one), key and value heads of one
  size, a multiple of 8 up to 256 (the flash kernel's limits);
- on CUDA, float16/bfloat16, a whole prompt (``Q == N``) without sliding window: cuDNN's fused attention
  (``aten._scaled_dot_product_cudnn_attention``, what SDPA itself runs on a Hopper GPU, faster there than
  FlashAttention-2) where ``torch.backends.cuda.can_use_cudnn_attention`` allows it; its causal mask is
  aligned to the top left, the same as the bottom right only when ``Q == N``. It takes the GQA group
  natively;
- on CUDA, float16/bfloat16 otherwise (a chunk after held slots, a sliding window, no cuDNN):
  FlashAttention-2 (Dao 2023; ``aten._flash_attention_forward``), whose causal mask is aligned to the bottom
  right, which takes the GQA group natively (no copy of K/V) and a sliding window as its local window
  ``[i + N - Q - (window - 1), i + N - Q]``; it needs an Ampere GPU or newer;
- on CUDA, float32: the memory-efficient kernel (``aten._efficient_attention_forward``, mask type 2, causal
  from the bottom right, as ``torch.nn.attention.bias.causal_lower_right`` runs it). It takes as many K/V
  heads as query heads, and a group's heads are no single strided view of K/V, so K/V are repeated per
  query head; float32 on a GPU is the reference and test setting, where that copy is small. No sliding
  window: its window is not documented;
- on CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (its causal mask is aligned to the top left,
  so a chunk shorter than the slots or a window gets an additive mask). Only the tests run this backend on
  CPU, with the mass pass on the Triton interpreter; ``dispatch`` runs the CPU backend there;
- fewer than ``MIN_SLOTS`` slots, and everything else: ``attention_with_mass_triton``, which tests visibility
  per (query, slot) pair and skips the blocks no query sees (padding, held slots in any order after
  eviction, empty slots, soft-cap).
  FlexAttention could take these with a ``mask_mod`` over the positions, but its block mask would be built
  for every layer of every call from that layer's positions, and it must be compiled to be fast.

``score_gain``: without soft-cap the scoring logit ``gain_i * x_ij`` is the logit of the gained query
``gain_i * q_i``, so the scoring LSE comes from the same fused op run on the gained queries (its output
unused), and the mass pass reads those same gained queries: each row's probabilities are normalised by the
LSE of exactly the logits they are taken from.

Deciding whether the inputs are served reads the positions on the host once per call (``in_order``, a
prefill step syncs with the host anyway), from ``MIN_SLOTS`` slots on: below, that test costs more than the
attention it could speed up. ``python -m benchmarks --only prefill_kernel`` times this backend (rows
``fused_no_mass``, ``fused_mass``) against SDPA and the Triton kernel on a GPU.
"""

from __future__ import annotations

import torch

from evictlayers.kernels.common import AttentionMass, check_inputs, in_order
from evictlayers.kernels.prefill.triton import IN_ORDER_MIN_SLOTS, attention_with_mass_triton, mass_from_lse

HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the flash kernel's largest head dim
#: the fewest slots the fused ops serve; from there the Triton kernel makes the same order test (a host sync) itself
MIN_SLOTS = IN_ORDER_MIN_SLOTS


def attention_with_mass_fused(
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
    keep_rows: int = 0,
    max_chunk_elements: int = 1 << 24,
    lse_out: torch.Tensor | None = None,
    need_mass: bool = True,
) -> AttentionMass:
    """``prefill/naive.py``'s ``attention_with_mass`` (see it for the arguments) from a fused attention op and
    one mass pass where the inputs are served (the module docstring), else from ``attention_with_mass_triton``.

    ``max_chunk_elements`` is read by the Triton kernel only: the fused ops hold no logits. ``out`` comes back
    as the fused op lays it out, which may be ``[B, Q, H_q, D_v]`` in memory (as SDPA returns it)."""
    check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain,
                 lse_out=lse_out, keep_rows=keep_rows, max_chunk_elements=max_chunk_elements)
    forward = _forward_op(query, key, value, softcap, sliding_window) if key.shape[2] >= MIN_SLOTS else None
    if forward is None or not in_order(query_pos, key_pos):
        return attention_with_mass_triton(
            query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap, sliding_window=sliding_window,
            gqa_reduce=gqa_reduce, score_gain=score_gain, keep_rows=keep_rows,
            max_chunk_elements=max_chunk_elements, lse_out=lse_out, need_mass=need_mass,
        )
    out, lse = forward(query, key, value, scaling, sliding_window)
    if lse_out is not None:
        lse_out.copy_(lse)
    scoring_query, score_lse = query, lse
    if score_gain is not None and (need_mass or keep_rows > 0):
        scoring_query = (query.float() * score_gain[:, None, :, None].float()).to(query.dtype)
        _, score_lse = forward(scoring_query, key, value, scaling, sliding_window)
    mass, rows = mass_from_lse(scoring_query, key, query_pos, key_pos, score_lse, scaling=scaling,
                               sliding_window=sliding_window, gqa_reduce=gqa_reduce, keep_rows=keep_rows,
                               need_mass=need_mass, ordered=True)
    return AttentionMass(out, mass, rows)


def _forward_op(query, key, value, softcap, sliding_window):
    """The function giving ``(out, lse)`` for these inputs if they are in order, or ``None`` where no fused op
    serves them (the module docstring's rules, all but the positions)."""
    head_dim, dtype = query.shape[-1], query.dtype
    if (softcap is not None or (sliding_window is not None and sliding_window < 1) or value.shape[-1] != head_dim
            or head_dim % 8 or head_dim > MAX_HEAD_DIM or key.dtype != dtype or value.dtype != dtype):
        return None
    if query.device.type == "cpu":
        return _flash_cpu if dtype in (*HALF, torch.float32) else None
    if query.device.type != "cuda":
        return None
    if dtype in HALF:
        if torch.cuda.get_device_capability(query.device) < (8, 0):
            return None
        whole_prompt = query.shape[2] == key.shape[2] and sliding_window is None
        return _cudnn_cuda if whole_prompt and _cudnn_serves(query, key, value) else _flash_cuda
    return _efficient_cuda if dtype == torch.float32 and sliding_window is None else None


def _cudnn_serves(query, key, value) -> bool:
    """Whether SDPA would run cuDNN for a causal call on these tensors (GQA included)."""
    params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, True, True)
    return torch.backends.cuda.can_use_cudnn_attention(params)


def _cudnn_cuda(query, key, value, scaling, sliding_window):
    """cuDNN's fused attention; its LSE is ``[B, H, Q, 1]``. ``sliding_window`` is ``None`` here."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, True, False, scale=scaling
    )
    return out, lse[..., 0]


def _flash_cuda(query, key, value, scaling, sliding_window):
    """FlashAttention-2 over ``[B, S, H, D]`` views; ``is_causal`` aligns the mask to the bottom right."""
    window = {} if sliding_window is None else dict(window_size_left=sliding_window - 1, window_size_right=0)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, query.shape[2],
        key.shape[2], 0.0, True, False, scale=scaling, **window,
    )
    return out.transpose(1, 2), lse


def _efficient_cuda(query, key, value, scaling, sliding_window):
    """The memory-efficient kernel over ``[B, S, H, D]`` views, K/V repeated per query head; its LSE rows are
    padded (to a multiple of 32 queries)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out, lse, *_ = torch.ops.aten._efficient_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias=None, cu_seqlens_q=None,
        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, custom_mask_type=2,
        compute_log_sumexp=True, scale=scaling, seqlen_k=None,
    )
    return out.transpose(1, 2), lse[:, :, : query.shape[2]]


def _flash_cpu(query, key, value, scaling, sliding_window):
    """The CPU flash op; its ``is_causal`` is aligned to the top left, right only when ``Q == N``."""
    q_len, n_slots = query.shape[2], key.shape[2]
    mask = None
    if q_len != n_slots or sliding_window is not None:
        row = torch.arange(n_slots - q_len, n_slots)[:, None]  # each query's index among the slots
        slot = torch.arange(n_slots)
        seen = slot <= row
        if sliding_window is not None:
            seen &= row - slot < sliding_window
        mask = torch.zeros(q_len, n_slots, dtype=query.dtype).masked_fill_(~seen, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, mask is None, attn_mask=mask, scale=scaling
    )
    return out, lse
