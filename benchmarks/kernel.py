"""``kernel`` (CUDA only): the decode attention kernel against the device's copy bandwidth and SDPA.

For each slot count and batch (9 query heads, 3 KV heads, head dim 64, bfloat16 slots):

- ``copy``: ``dst.copy_(src)`` of the key and value buffers; ``gb_per_s`` counts bytes read + written,
  the bandwidth a memory-bound kernel can hope for (baseline of ``gb_per_s``);
- ``sdpa``: ``scaled_dot_product_attention`` of one query over the slots: attention only, no mass
  (baseline of ``time_us``);
- ``decode_attention``: ``evictlayers.kernels.dispatch.decode_attention``, attention plus the per-slot
  probability mass; ``gb_per_s`` counts the key and value bytes it must read once.

Skipped, with the reason printed, without CUDA or while ``evictlayers.kernels.dispatch`` does not
exist yet.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from benchmarks.common import Case, Context, kernel_cases, kernel_row, timed_blocks

NAME = "kernel"
DEFAULT_REPEATS = 5
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
DTYPE = torch.bfloat16
CONFIGS = ("copy", "sdpa", "decode_attention")


def sizes(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(slot counts, batch sizes, warmup, steps per block)."""
    return ((256,), (1, 8), 2, 5) if quick else ((4096, 32768, 131072), (1, 8), 10, 100)


def skip_reason(context: Context) -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA (this machine has none)"
    if importlib.util.find_spec("evictlayers.kernels.dispatch") is None:
        return "evictlayers.kernels.dispatch does not exist yet"
    if not hasattr(importlib.import_module("evictlayers.kernels.dispatch"), "decode_attention"):
        return "evictlayers.kernels.dispatch has no decode_attention"
    return None


def cases(context: Context) -> list[Case]:
    from evictlayers.kernels.dispatch import decode_attention

    slot_counts, batches, warmup, steps = sizes(context.settings.quick)
    repeats = context.settings.repeats_for(DEFAULT_REPEATS)
    device = torch.device("cuda")

    def measure(config: str, slots: int, batch: int) -> dict:
        query = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        keys, values = (torch.randn(batch, KV_HEADS, slots, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(2))
        kv_bytes = keys.nbytes + values.nbytes
        if config == "copy":
            keys_out, values_out = torch.empty_like(keys), torch.empty_like(values)

            def step():
                keys_out.copy_(keys)
                values_out.copy_(values)

            moved = 2 * kv_bytes
        elif config == "sdpa":

            def step():
                torch.nn.functional.scaled_dot_product_attention(query[:, :, None], keys, values, enable_gqa=True)

            moved = kv_bytes
        else:
            query_pos = torch.full((batch,), slots - 1, device=device, dtype=torch.long)
            key_pos = torch.arange(slots, device=device).expand(batch, KV_HEADS, slots).contiguous()

            def step():
                decode_attention(query, keys, values, query_pos, key_pos, scaling=HEAD_DIM**-0.5)

            moved = kv_bytes
        with torch.inference_mode():
            seconds, _ = timed_blocks(step, warmup, steps, repeats, sync=torch.cuda.synchronize)
        return kernel_row(config, {"slots": slots, "batch": batch}, seconds, moved, "sdpa", "copy")

    return kernel_cases(NAME, CONFIGS, slot_counts, batches, 1.0, measure)
