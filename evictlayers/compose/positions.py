"""Rolling positions: rotary positions re-assigned inside the cache (H2O Sec. 5.3 Q1, after StreamingLLM).

H2O Sec. 5.3 (Q1) reaches millions of tokens with a fixed cache by "position rolling in the KV cache",
as StreamingLLM does: positions are counted within the cache, not in the original text. With
``Policy(positions="rolling")`` a slot store holds its keys *un-rotated* and rotates them at every step
to their rank among the tokens the head still holds; a query takes the rank its own key gets. The
relative distances the model sees then never exceed the cache size, so generation can run far past
the trained context window with a bounded cache. With nothing evicted every rank equals the original
position and the rotation is the model's own, so the logits equal the unmodified model's.

The rotation is the rotate-half form every supported RoPE family uses (``x * cos + rotate_half(x) *
sin`` on the first ``R`` dims; the rest pass through: partial rotary). ``cos``/``sin`` come from the
model's own rotary module (``evictlayers.hf.rotary``: rope scaling and partial rotary included) as a
``RotaryTable``; this module knows nothing about Hugging Face.
"""

from __future__ import annotations

from typing import Callable

import torch

from evictlayers.core.slots import LAST

POSITIONS = ("absolute", "rolling")


# (rows, device, dtype) -> (cos, sin), each [rows, R]: a model's rotary embedding at positions 0..rows-1
RotaryFunction = Callable[[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


class RotaryTable:
    """``cos``/``sin`` of a rotary embedding at positions ``0..n-1``, as pure rotations, grown on demand.

    ``compute(rows, device, dtype)`` returns the model's ``(cos, sin)`` ``[rows, R]``. Some rope types
    scale both by an attention factor ``s`` (YaRN, LongRoPE: ``cos = s * cos(theta)``); the table divides
    it out (``s`` is ``cos`` at position 0) because a key un-rotated by the model at position 0 already
    carries it (``k * s``), and a second factor would square it. Tables are cached per device and dtype
    and at least double when they grow, so a growing cache re-computes them rarely and a fixed-size one
    once (a compiled decode step sees one table shape).
    """

    def __init__(self, compute: RotaryFunction):
        self.compute = compute
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(cos, sin)`` table built so far (one per device and dtype)."""
        return list(self._tables.values())

    def rows(self, count: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[N, R]`` with ``N >= count`` rows: position ``p`` is row ``p``."""
        key = (torch.device(device), dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < count:
            size = max(count, 2 * table[0].shape[0] if table is not None else 0, 64)
            cos, sin = self.compute(size, device, dtype)
            if cos.dim() != 2 or cos.shape[0] != size or cos.shape != sin.shape:
                raise ValueError(
                    f"a rotary table for {size} positions must be two [{size}, R] tensors; got cos "
                    f"{tuple(cos.shape)}, sin {tuple(sin.shape)}"
                )
            scale = cos[:1]  # cos(0) * s = s in every dim
            table = ((cos / scale).to(device=device, dtype=dtype), (sin / scale).to(device=device, dtype=dtype))
            self._tables[key] = table
        return table


def slot_ranks(pos: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]`` int64: each held slot's rank among its head's held slots in position order.

    ``pos`` ``[B, H, N]`` (``-1`` = free). Free slots rank after every held one (their rank is never
    attended: the causal mask drops them). Fixed-shape (one sort, then its inverse permutation by a
    scatter), so it compiles."""
    order = pos.masked_fill(pos < 0, LAST).argsort(dim=-1)
    places = torch.arange(pos.shape[-1], device=pos.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` rotated by ``cos``/``sin`` ``[..., R]`` (broadcast), ``R <= D``: the first ``R``
    dims as ``x * cos + rotate_half(x) * sin`` (``rotate_half([x1, x2]) = [-x2, x1]``), the rest unchanged
    (partial rotary)."""
    width = cos.shape[-1]
    half = width // 2
    first, second = x[..., :half], x[..., half:width]
    # written out per half (the same products and sums, so the same values): no negated copy of x and
    # no full-width temporaries: compiled at 8 x 3 x 8,192 keys it measured 1.8x faster than
    # x * cos + rotate_half(x) * sin
    turned = torch.cat(
        (first * cos[..., :half] - second * sin[..., :half], second * cos[..., half:] + first * sin[..., half:]), dim=-1
    )
    return turned if width == x.shape[-1] else torch.cat((turned, x[..., width:]), dim=-1)


def rotate_at(x: torch.Tensor, ranks: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x`` ``[B, H, N, D]`` rotated to positions ``ranks`` ``[B, H, N]`` of ``table`` (``(cos, sin)``)."""
    cos, sin = table
    return rotate(x, cos[ranks], sin[ranks])


def rotate_queries(query: torch.Tensor, ranks: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``query`` ``[B, H_q, Q, D]`` rotated to ``ranks`` ``[B, H_kv, Q]``: each query head takes its KV
    head's ranks (the query of a GQA group shares the group's key set)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = ranks.shape[1]
    grouped = query.view(batch, kv_heads, q_heads // kv_heads, q_len, dim)
    cos, sin = table
    turned = rotate(grouped, cos[ranks][:, :, None], sin[ranks][:, :, None])
    return turned.view(batch, q_heads, q_len, dim)
