"""``prefill_kernel`` (CUDA only): the prefill attention kernel, with and without the mass, against SDPA.

A whole causal prefill of one layer of SmolLM2's shape (9 query heads, 3 KV heads, head dim 64, bfloat16),
per prompt length and batch:

- ``sdpa``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, what transformers' default
  path runs (a flash kernel on a GPU); baseline of ``time_us``;
- ``prefill_no_mass``: the Triton kernel, ``attention_with_mass_triton`` with ``need_mass=False`` (what a
  policy that reads no mass at prefill ran on CUDA before the fused backend, and still runs where that
  backend hands inputs on);
- ``prefill_mass``: the same with every key's probability mass, what H2O, AhaKV and TOVA score with (the
  kernel chooses one pass or two for the shape, ``prefill/triton.py``'s ``passes_for``);
- ``fused_no_mass`` and ``fused_mass``: the same two through ``attention_with_mass_fused``, what
  ``dispatch.prefill_attention`` runs on CUDA: PyTorch's FlashAttention-2 for the output and LSE, then (with
  the mass) the Triton mass pass;
- ``mass_two_passes``: ``attention_with_mass_triton(passes=2)``, the output first, then each key's mass from
  the logits recomputed;
- ``mass_one_pass``: ``attention_with_mass_triton(passes=1)``, output and mass from the same logits, with
  ``ONE_PASS_SCRATCH`` floats of scratch (4 GiB: a program per query block up to 8k tokens, more
  programs than an H200 has SMs at every length here).

``tflop_per_s`` counts the two causal products (``2 * 2 * B * H_q * n^2 / 2 * D``) over the time.
"""

from __future__ import annotations

import torch

from benchmarks.common import Case, Context, metric, row, timed_blocks

NAME = "prefill_kernel"
DEFAULT_REPEATS = 5
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
DTYPE = torch.bfloat16
CONFIGS = ("sdpa", "prefill_no_mass", "prefill_mass", "fused_no_mass", "fused_mass", "mass_two_passes",
           "mass_one_pass")
ONE_PASS_SCRATCH = 1 << 30


def sizes(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(prompt lengths, batch sizes, warmup, calls per block)."""
    return ((256,), (1,), 2, 3) if quick else ((1024, 2048, 8192, 16384, 65536), (1,), 3, 10)


def skip_reason(context: Context) -> str | None:
    return None if torch.cuda.is_available() else "needs CUDA (this machine has none)"


def cases(context: Context) -> list[Case]:
    from evictlayers.kernels.prefill.fused import attention_with_mass_fused
    from evictlayers.kernels.prefill.triton import attention_with_mass_triton

    lengths, batches, warmup, steps = sizes(context.settings.quick)
    repeats = context.settings.repeats_for(DEFAULT_REPEATS)
    device = torch.device("cuda")

    def measure(config: str, tokens: int, batch: int) -> dict:
        query = torch.randn(batch, Q_HEADS, tokens, HEAD_DIM, device=device, dtype=DTYPE)
        keys, values = (torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(2))
        if config == "sdpa":

            def step():
                torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
        else:
            query_pos = torch.arange(tokens, device=device).expand(batch, tokens)
            key_pos = torch.arange(tokens, device=device).expand(batch, KV_HEADS, tokens)

            def step():
                if config.startswith("mass_"):
                    attention_with_mass_triton(query, keys, values, query_pos, key_pos, scaling=HEAD_DIM**-0.5,
                                               passes=1 if config == "mass_one_pass" else 2,
                                               max_chunk_elements=ONE_PASS_SCRATCH)
                else:
                    kernel = attention_with_mass_fused if config.startswith("fused_") else attention_with_mass_triton
                    kernel(query, keys, values, query_pos, key_pos, scaling=HEAD_DIM**-0.5,
                           need_mass=not config.endswith("no_mass"))

        with torch.inference_mode():
            seconds, _ = timed_blocks(step, warmup, steps, repeats, sync=torch.cuda.synchronize)
        flops = 2 * 2 * batch * Q_HEADS * tokens * tokens / 2 * HEAD_DIM
        return row(config, {"tokens": tokens, "batch": batch}, {
            "time_us": metric([s * 1e6 for s in seconds], "us", "sdpa", higher_is_better=False),
            "tflop_per_s": metric([flops / s / 1e12 for s in seconds], "TFLOP/s", "sdpa", higher_is_better=True),
        })

    return [
        Case(NAME, config, {"tokens": tokens, "batch": batch}, 1.0,
             lambda c=config, t=tokens, b=batch: measure(c, t, b))
        for tokens in lengths for batch in batches for config in CONFIGS
    ]
