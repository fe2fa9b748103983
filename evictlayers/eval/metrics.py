"""What one evaluated batch reports besides the task score: memory, positions kept, throughput.

Everything here reads an ``EvictionCache`` after the run (``run.cache``): per layer, the slot store's
``pos`` (``[B, H_kv, C]``, original position of the token in each slot, ``-1`` = empty) and ``seen``
(``[B]``, real tokens fed per row).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "cache_rows",
    "histogram_evenness",
    "merge_histograms",
    "position_histogram",
]


def _stores(cache) -> list:
    return [layer.store for layer in cache.layers if layer.store.pos is not None]


def position_histogram(cache, n_bins: int = 20) -> torch.Tensor:
    """``[B, n_bins]`` int64: retained slots of every layer and KV head, binned by relative position.

    A slot holding original position ``p`` of a row that has seen ``n`` real tokens falls in bin
    ``floor(p / n * n_bins)``: bin 0 holds the first ``1/n_bins`` of the sequence, the last bin its
    end. Row ``b``'s counts sum to the number of slots that hold a token in row ``b`` (over all
    layers and heads). This is the picture of AhaKV Fig. 2(c): which original positions survive.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    stores = _stores(cache)
    if not stores:
        raise ValueError("the cache is empty: run a forward pass through it first")
    batch = stores[0].pos.shape[0]
    counts = torch.zeros(batch, n_bins, dtype=torch.long)
    for store in stores:
        pos = store.pos.cpu()
        seen = store.seen.cpu().clamp(min=1)[:, None, None]
        bins = torch.div(pos * n_bins, seen, rounding_mode="floor").clamp(0, n_bins - 1)
        valid = pos >= 0
        for row in range(batch):
            counts[row] += torch.bincount(bins[row][valid[row]], minlength=n_bins)
    return counts


def cache_rows(cache) -> list[dict]:
    """Per row: ``retained_slots`` (slots holding a token, all layers and heads), ``full_slots``
    (what a full cache would hold: ``seen`` tokens in every layer and head), ``seen_tokens`` and
    ``budget_tokens`` (the row's resolved per-head budget averaged over layers, ``None`` = unbounded)."""
    stores = _stores(cache)
    if not stores:
        raise ValueError("the cache is empty: run a forward pass through it first")
    batch = stores[0].pos.shape[0]
    rows = []
    for row in range(batch):
        retained = sum(int((store.pos[row] >= 0).sum()) for store in stores)
        full = sum(int(store.seen[row]) * store.pos.shape[1] for store in stores)
        budgets = [store.budget for store in stores]
        rows.append(
            {
                "retained_slots": retained,
                "full_slots": full,
                "seen_tokens": int(stores[0].seen[row]),
                "budget_tokens": None
                if any(b is None for b in budgets)
                else sum(int(b[row]) for b in budgets) / len(budgets),
            }
        )
    return rows


def merge_histograms(histograms: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise sum of equally long count lists."""
    total: list[int] | None = None
    for counts in histograms:
        if total is None:
            total = [int(c) for c in counts]
        elif len(counts) != len(total):
            raise ValueError(f"histograms differ in bins: {len(counts)} vs {len(total)}")
        else:
            total = [t + int(c) for t, c in zip(total, counts, strict=True)]
    return total or []


def histogram_evenness(counts: Sequence[int]) -> float:
    """Normalised entropy of a histogram in [0, 1]: 1 = the same count in every bin, 0 = one bin."""
    total = sum(counts)
    if total == 0 or len(counts) < 2:
        return float("nan")
    entropy = -sum(c / total * math.log(c / total) for c in counts if c > 0)
    return max(0.0, entropy / math.log(len(counts)))
