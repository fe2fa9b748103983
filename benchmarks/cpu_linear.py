"""``cpu_linear``: a decode step's weight products on CPU, ``evictlayers::few_rows_linear`` against ``F.linear``.

One call multiplies every weight of a model of SmolLM2-135M's shapes (30 layers of query, key, value, output,
gate, up and down projections, then the 49,152 x 576 output head; random weights, as a step reads them,
one after another, each from memory: together they are larger than the CPU's caches) by ``rows`` input rows,
the one token per sequence of a decode step at batch ``rows``, in float32 and, as the ``-bf16`` configurations,
in bfloat16 (a model loaded in bfloat16; skipped, with the reason, below the ``avx512_bf16`` instruction-set level,
where the op has no bfloat16 loops).

- ``read``: a sum over every weight, the bytes each product reads, at the rate this thread reads memory
  (baseline of ``gb_per_s``);
- ``blas``: ``torch.nn.functional.linear`` (what a step runs without the op; baseline of ``time_us``);
- ``few-rows``: ``evictlayers::few_rows_linear`` (``evictlayers/kernels/linear_cpu.cpp``), what
  ``evictlayers.apply(compile=True, cpu_linear=True)`` runs on CPU.

Skipped, with the reason printed, below the ``avx512`` instruction-set level (``evictlayers/kernels/cpu_extension.py``:
the CPU's, or a lower one named by ``EVICTLAYERS_CPU_ISA``), where the op has no loops, or where it cannot be built.
"""

from __future__ import annotations

import torch

from benchmarks.common import Case, Context, kernel_row, skipped, timed_blocks

NAME = "cpu_linear"
DEFAULT_REPEATS = 7
CONFIGS = ("read", "blas", "few-rows", "read-bf16", "blas-bf16", "few-rows-bf16")
HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def sizes(quick: bool) -> tuple[list[tuple[int, int]], tuple[int, ...], int]:
    """(the (out, in) shapes of one pass's weights in order, input row counts, passes per block)."""
    if quick:
        return [(48, 32), (16, 32), (96, 32), (32, 96), (256, 32)], (1, 3), 2
    layer = [(HIDDEN, HIDDEN), (KV_WIDTH, HIDDEN), (KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN),
             (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return layer * LAYERS + [(VOCAB, HIDDEN)], (1, 4, 8), 3


def skip_reason(context: Context) -> str | None:
    from evictlayers.kernels import linear_cpu

    why_not = linear_cpu.unavailable_reason()
    return None if why_not is None else f"the op {why_not}"


def bfloat16_skip_reason(config: str) -> str:
    """Why ``config`` (a ``-bf16`` configuration) is not run where the op has no bfloat16 loops."""
    from evictlayers.kernels.cpu_extension import describe_level

    why = (f"the op has bfloat16 loops only at the avx512_bf16 instruction-set level; this run's: "
           f"{describe_level()}")
    return why if config.startswith("few-rows") else f"a baseline of few-rows-bf16, which does not run: {why}"


def cases(context: Context) -> list[Case]:
    from evictlayers.kernels.linear_cpu import few_rows_linear, served_dtypes

    shapes, row_counts, passes = sizes(context.settings.quick)
    repeats = context.settings.repeats_for(DEFAULT_REPEATS)
    weights: dict[torch.dtype, list[torch.Tensor]] = {}  # per dtype, built by its first case, shared by the rest

    def measure(config: str, rows: int) -> dict:
        kind, bf16 = config.removesuffix("-bf16"), config.endswith("-bf16")
        dtype, suffix = (torch.bfloat16, "-bf16") if bf16 else (torch.float32, "")
        if dtype not in served_dtypes():
            return skipped(config, {"rows": rows}, bfloat16_skip_reason(config))
        if dtype not in weights:
            generator = torch.Generator().manual_seed(0)
            weights[dtype] = [(torch.randn(shape, generator=generator) / shape[1] ** 0.5).to(dtype)
                              for shape in shapes]
        inputs = {width: torch.randn(rows, width).to(dtype) for width in {w.shape[1] for w in weights[dtype]}}
        call = {"read": lambda x, w: w.sum(), "blas": torch.nn.functional.linear,
                "few-rows": lambda x, w: few_rows_linear(x, w, None)}[kind]

        def one_pass():
            for w in weights[dtype]:
                call(inputs[w.shape[1]], w)

        with torch.inference_mode():
            seconds, _ = timed_blocks(one_pass, 1, passes, repeats)
        moved = sum(w.nbytes for w in weights[dtype])
        return kernel_row(config, {"rows": rows}, seconds, moved, "blas" + suffix, "read" + suffix,
                          {"bytes_read": moved})

    return [Case(NAME, config, {"rows": rows}, 2.0, lambda c=config, r=rows: measure(c, r))
            for rows in row_counts for config in CONFIGS]
