"""``cpu_kernel``: decode attention's two products over the slots on CPU, the C++ ops against ``torch.matmul``.

One decode step's attention for one layer of SmolLM2's shape (9 query heads, 3 KV heads, head dim 64), per
slot count and batch: the logits of the query rows over the slots, then the probabilities times the values.
A call reads the slots of another of ``LAYERS`` layers' buffers in turn, so (as in a decode step, where 30
layers' caches pass through the CPU caches) the slots come from memory, not from the CPU's caches.

- ``read``: a sum over the float32 keys and values, the bytes every dense configuration reads, at the
  rate this thread reads memory (baseline of ``gb_per_s``);
- ``matmul``: ``naive.py``'s ``matmul_logits`` and ``matmul_values`` (``torch.matmul``, what the decode
  runs without the C++ ops) over float32 slots (baseline of ``time_us``);
- ``slot-ops``: ``evictlayers::slot_logits`` and ``slot_values`` (``kernels/decode/slots_cpu.cpp``) over the
  same slots;
- ``int4-ops``: ``evictlayers::int4_logits`` and ``int4_values`` (``kernels/quantized_decode/int4_cpu.cpp``)
  over the same slots quantised as ``h2o_int4`` holds them (4 bits, groups of 32 channels, bfloat16 scales
  and zero points); its ``gb_per_s`` counts the codes, scales and zero points.

Skipped, with the reason printed, where the C++ ops cannot be compiled.
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.common import Case, Context, kernel_cases, kernel_row, timed_blocks

NAME = "cpu_kernel"
DEFAULT_REPEATS = 7
Q_HEADS, KV_HEADS, HEAD_DIM, GROUP = 9, 3, 64, 32
CONFIGS = ("read", "matmul", "slot-ops", "int4-ops")


def sizes(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(slot counts, batch sizes, layers' buffers, calls per block): the slots H2O keeps at 20% of a 4k and
    an 8k-token prompt."""
    return ((40,), (1, 2), 2, 4) if quick else ((819, 1638), (1, 8), 30, 60)


def skip_reason(context: Context) -> str | None:
    from evictlayers.kernels.decode import slots_cpu
    from evictlayers.kernels.quantized_decode import int4_cpu

    if not (slots_cpu.available() and int4_cpu.available()):
        return "the C++ CPU ops could not be compiled here (see the warning above)"
    return None


def cases(context: Context) -> list[Case]:
    from evictlayers.kernels.decode import naive, slots_cpu
    from evictlayers.kernels.quantization import quantize_groups
    from evictlayers.kernels.quantized_decode import int4_cpu

    slot_counts, batches, layers, steps = sizes(context.settings.quick)
    repeats = context.settings.repeats_for(DEFAULT_REPEATS)
    groups = Q_HEADS // KV_HEADS

    def measure(config: str, slots: int, batch: int) -> dict:
        generator = torch.Generator().manual_seed(slots + batch)
        shape = (batch, KV_HEADS, slots, HEAD_DIM)
        keys = [torch.randn(shape, generator=generator) for _ in range(layers)]
        values = [torch.randn(shape, generator=generator) for _ in range(layers)]
        query = torch.randn(batch, KV_HEADS, groups, HEAD_DIM, generator=generator)
        probs = torch.softmax(torch.randn(batch, KV_HEADS, groups, slots, generator=generator), -1)
        dense_bytes = keys[0].nbytes + values[0].nbytes
        turn = itertools.count()  # next(turn) % layers: the layer whose buffers the next call reads

        if config == "read":
            def step():
                layer = next(turn) % layers
                keys[layer].sum()
                values[layer].sum()

            moved = dense_bytes
        elif config in ("matmul", "slot-ops"):
            logits_of, values_of = ((naive.matmul_logits, naive.matmul_values) if config == "matmul"
                                    else (slots_cpu.slot_logits, slots_cpu.slot_values))

            def step():
                layer = next(turn) % layers
                logits_of(query, keys[layer])
                values_of(probs, values[layer])

            moved = dense_bytes
        else:
            packed = [[quantize_groups(x, 4, GROUP, -1, torch.bfloat16) for x in pair] for pair in zip(keys, values)]
            del keys[:], values[:]

            def step():
                (key_codes, key_scale, key_zero), (value_codes, value_scale, value_zero) = packed[next(turn) % layers]
                int4_cpu.int4_logits(query, key_codes, key_scale, key_zero)
                int4_cpu.int4_values(probs, value_codes, value_scale, value_zero)

            moved = sum(t.nbytes for t in packed[0][0] + packed[0][1])
        with torch.inference_mode():
            seconds, _ = timed_blocks(step, layers, steps, repeats)
        return kernel_row(config, {"slots": slots, "batch": batch}, seconds, moved, "matmul", "read",
                          {"bytes_read": moved})

    return kernel_cases(NAME, CONFIGS, slot_counts, batches, 2.0, measure)
