"""``kernel`` (CUDA only): the decode attention kernels against the device's copy bandwidth and SDPA.

For each slot count and batch (9 query heads, 3 KV heads, head dim 64, bfloat16 slots):

- ``copy``: ``dst.copy_(src)`` of the key and value buffers; ``gb_per_s`` counts bytes read + written,
  the bandwidth a memory-bound kernel can hope for (baseline of ``gb_per_s``);
- ``sdpa``: ``scaled_dot_product_attention`` of one query over the slots: attention only, no mass
  (baseline of ``time_us``);
- ``decode_attention``: ``evictlayers.kernels.dispatch.decode_attention``, attention plus the per-slot
  probability mass; ``gb_per_s`` counts the key and value bytes it must read once;
- ``decode_no_mass``: the same without the mass (``need_mass=False``, what a policy that reads no mass runs);
- ``int4_decode``: ``dispatch.quantized_decode_attention`` with the mass, over the same slots quantised as
  ``h2o_int4`` holds them (4 bits, groups of 32 channels, bfloat16 scales and zero points, float32 channel
  scales) and no residual; ``gb_per_s`` counts the codes, scales and zero points, the bytes it must read.

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
GROUP = 32
CONFIGS = ("copy", "sdpa", "decode_attention", "decode_no_mass", "int4_decode")


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
    from evictlayers.kernels.dispatch import decode_attention, quantized_decode_attention
    from evictlayers.kernels.quantization import PackedKV, quantize_groups

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
            options = dict(scaling=HEAD_DIM**-0.5, need_mass=config != "decode_no_mass")
            if config == "int4_decode":
                channel = keys.float().abs().amax(2, keepdim=True).clamp(min=1e-3)
                packed = PackedKV(*quantize_groups(keys.float() / channel, 4, GROUP, -1, DTYPE), channel,
                                  *quantize_groups(values.float(), 4, GROUP, -1, DTYPE), 4, GROUP)
                residual = keys[:, :, :0]
                residual_pos = key_pos[:, :, :0]

                def step():
                    quantized_decode_attention(query, packed, residual, residual, query_pos, key_pos, residual_pos,
                                               **options)

                moved = sum(t.nbytes for t in packed if isinstance(t, torch.Tensor))
            else:

                def step():
                    decode_attention(query, keys, values, query_pos, key_pos, **options)

                moved = kv_bytes
        with torch.inference_mode():
            seconds, _ = timed_blocks(step, warmup, steps, repeats, sync=torch.cuda.synchronize)
        return kernel_row(config, {"slots": slots, "batch": batch}, seconds, moved, "sdpa", "copy")

    return kernel_cases(NAME, CONFIGS, slot_counts, batches, 1.0, measure)
