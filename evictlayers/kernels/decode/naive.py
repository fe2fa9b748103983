"""Decode attention over KV slots with per-slot mass, the plain PyTorch reference (and the CPU path).

One query per row, so there is no query chunking and no host synchronisation: every op has a fixed
shape, which is what lets the slot store's decode step compile into one graph
(``torch.compile(fullgraph=True)``). The logits are computed once and serve both the output and the mass
(H2O Algorithm 1 lines 8-9 accumulate exactly this mass); the cache is never cast or copied: the matmuls
run in the cache dtype and only the ``[B, H, N]`` logits are float32. ``cpu.py`` runs the same steps
(``decode_attention_with``) with its C++ matmuls whenever the mass is wanted, and this file's where those
cannot be built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from evictlayers.kernels.common import DecodeAttention, check_inputs, no_mass, reduce_group


def decode_attention_with_mass(
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
) -> DecodeAttention:
    """One query per row attending over unordered slots (the decode signature of every backend).

    Args:
        query: ``[B, H_q, D]`` post-RoPE query of the token being decoded.
        key: ``[B, H_kv, N, D]`` slot keys; ``H_q`` must be a multiple of ``H_kv`` (GQA).
        value: ``[B, H_kv, N, D_v]`` slot values.
        query_pos: ``[B]`` int64 original position of the query; ``-1`` marks padding (zero output
            and mass).
        key_pos: ``[B, H_kv, N]`` int64 original position of each slot's token; ``-1`` = empty slot.
        scaling: logit scale (``1/sqrt(D)`` for most models).
        softcap: Gemma2-style ``tanh(x / c) * c`` on the scaled logits.
        sliding_window: a slot is visible only if ``query_pos - key_pos < sliding_window``.
        gqa_reduce: ``"sum"``, ``"mean"`` or ``"max"`` over the query heads of a GQA group.
        score_gain: ``[B]`` factor on the logits of the scoring softmax only (AhaKV's SG-softmax);
            ``None`` scores with the model's own probabilities.
        need_mass: ``False`` when the caller reads the output and LSE only (no scorer reads the mass):
            the mass is not computed and comes back as zeros.
    """
    return decode_attention_with(
        matmul_logits, matmul_values, query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap,
        sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain, need_mass=need_mass,
    )


def matmul_logits(grouped: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, G, D]`` query rows against ``[B, H_kv, N, D]`` keys -> ``[B, H_kv, G, N]`` float32 logits,
    the matmul in the cache dtype (the cache is never cast or copied)."""
    return torch.matmul(grouped.to(key.dtype), key.transpose(-1, -2)).float()


def matmul_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, G, N]`` probabilities over ``[B, H_kv, N, D_v]`` values -> ``[B, H_kv, G, D_v]``, in the
    cache dtype."""
    return torch.matmul(probs.to(value.dtype), value)


def softmax_mass(
    logits: torch.Tensor,
    scaling: float,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    softcap: float | None,
    sliding_window: int | None,
    score_gain: torch.Tensor | None,
    need_mass: bool,
    gqa_reduce: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's logits ``[B, H_kv, G, N]`` (float32, before ``scaling``) -> ``(probs [B, H_kv, G, N], lse
    [B, H_kv, G], mass [B, H_kv, N])``: ``slot_softmax`` of the scaled logits and its scores reduced over each GQA
    group (``no_mass`` without ``need_mass``)."""
    probs, lse, scores = slot_softmax(
        logits * scaling, query_pos, key_pos, softcap=softcap, sliding_window=sliding_window, score_gain=score_gain,
        need_mass=need_mass,
    )
    mass = reduce_group(scores, gqa_reduce) if need_mass else no_mass(*key_pos.shape, key_pos.device)
    return probs, lse, mass


def decode_attention_with(
    logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    values_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None,
    sliding_window: int | None,
    gqa_reduce: str,
    score_gain: torch.Tensor | None,
    need_mass: bool,
    softmax_of: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = softmax_mass,
) -> DecodeAttention:
    """``decode_attention_with_mass`` (same arguments after the first two) with its two matmuls supplied:
    ``logits_of(grouped query [B, H_kv, G, D] float32, key)`` -> float32 ``[B, H_kv, G, N]`` and
    ``values_of(probs [B, H_kv, G, N] float32, value)`` -> ``[B, H_kv, G, D_v]`` (``matmul_logits`` and
    ``matmul_values`` here; the CPU backend's C++ ops), and the softmax between them (``softmax_of``, with
    ``softmax_mass``'s signature; the CPU backend's C++ op)."""
    groups = check_inputs(query, key, value, query_pos, key_pos, gqa_reduce=gqa_reduce, score_gain=score_gain)
    batch, q_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.view(batch, kv_heads, groups, head_dim).float()
    probs, lse, mass = softmax_of(
        logits_of(grouped, key), scaling, query_pos, key_pos, softcap=softcap, sliding_window=sliding_window,
        score_gain=score_gain, need_mass=need_mass, gqa_reduce=gqa_reduce,
    )
    out = values_of(probs, value)  # [B, H_kv, G, D_v]
    return DecodeAttention(out.reshape(batch, q_heads, -1).to(query.dtype), mass, lse.reshape(batch, q_heads))


def slot_softmax(
    logits: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    softcap: float | None,
    sliding_window: int | None,
    score_gain: torch.Tensor | None,
    need_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The softmax of a decode step's scaled logits ``[B, H_kv, G, N]`` (float32) over the visible slots.

    Returns ``(probs, lse, scores)``: the model's probabilities (0 where hidden, and for a padding row),
    the log-sum-exp ``[B, H_kv, G]`` (``-inf`` for a row that sees nothing) and the scoring
    probabilities (``probs`` again without a ``score_gain``; ``None`` when ``need_mass`` is false).
    Shared by every PyTorch decode backend, so they mask and normalise alike.
    """
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    q_pos = query_pos[:, None, None]
    visible = (key_pos >= 0) & (key_pos <= q_pos) & (q_pos >= 0)
    if sliding_window is not None:
        visible &= q_pos - key_pos < sliding_window
    visible = visible[:, :, None, :]
    masked = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)  # [B, H_kv, G]; -inf for a row that sees nothing
    probs = torch.softmax(masked, dim=-1)
    probs = torch.where(visible, probs, 0.0)  # a row that sees nothing (padding) is NaN: zero it
    if not need_mass:
        return probs, lse, None
    if score_gain is None:
        return probs, lse, probs
    gained = logits * score_gain.float()[:, None, None, None]
    return probs, lse, torch.where(visible, torch.softmax(gained.masked_fill(~visible, float("-inf")), dim=-1), 0.0)
