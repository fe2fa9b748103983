"""``overhead``: one decode step of one layer's slot store against plain SDPA over the same slots.

The slot store (``evictlayers.compose.SlotStore``) runs a recipe at a budget of ``slots - 1`` tokens,
so its ``slots``-slot buffer is full and every step inserts the new token, attends over all slots with
the per-slot mass, updates the scores and evicts one token: the steady state of a long generation.
``el-<recipe>`` is the recipe's eager step, ``el-<recipe>-compiled`` its compiled one: H2O (attention
mass), and the key-geometry scorers (KeyDiff reads every held key once per step for its
cosines, its anchor updated incrementally; KeyNorm reads one stored norm per slot) and the
``tova_keydiff`` split (two scores, one ``kthvalue`` for the first selector's claims), and StreamingLLM
with absolute and with rolling positions (every held key rotated to its rank at every step). The baseline
is ``torch.nn.functional.scaled_dot_product_attention`` of one query over
the same number of keys (no scoring, no eviction). Shapes are SmolLM2's: 9 query heads, 3 KV heads,
head dim 64, float32. The value is the median over ``repeats`` blocks of the mean step time.
"""

from __future__ import annotations

import torch

from benchmarks.common import COMPILE_S, Case, Context, estimate_step_s, metric, recipe, row, skipped, timed_blocks
from benchmarks.loop import tiled

NAME = "overhead"
BASELINE = "sdpa"
DEFAULT_REPEATS = 5
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CONFIGS = (
    "sdpa", "el-h2o", "el-h2o-compiled", "el-keydiff", "el-keydiff-compiled", "el-knorm-compiled",
    "el-tova_keydiff-compiled", "el-streaming_llm-compiled", "el-streaming_llm-rolling-compiled",
)
ROPE_BASE = 10000.0  # SmolLM2's rotary base, for the rolling configuration's table
STEP_OVERHEAD_S = 2e-3  # the eager store's small ops per step, for the estimate only


def sizes(quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(slot counts, batch sizes, warmup steps, steps per block)."""
    if quick:
        return (32, 64), (1, 8), 2, 3
    return (512, 2048, 8192), (1, 8), 3, 20


def skip_reason(context: Context) -> str | None:
    return None


def random_step(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Query ``[B, 9, 1, 64]`` and key/value ``[B, 3, 1, 64]`` of one decoded token."""
    query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, generator=generator)
    key, value = (torch.randn(batch, KV_HEADS, 1, HEAD_DIM, generator=generator) for _ in range(2))
    return query, key, value


def recipe_of(config: str) -> str:
    """``el-keydiff-compiled`` -> ``keydiff``; ``el-streaming_llm-rolling-compiled`` -> ``streaming_llm-rolling``."""
    return config.removeprefix("el-").removesuffix("-compiled")


def rope_table(rows: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE (rotate-half form, base ``ROPE_BASE``) at positions ``0..rows-1``: ``(cos, sin)`` ``[rows, 64]``."""
    inverse = ROPE_BASE ** -(torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * inverse
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def filled_layer(slots: int, name: str = "h2o"):
    """A batch-1 cache layer under recipe ``name`` whose ``slots`` slots hold ``slots - 1`` tokens of a
    random prompt (the transformers cache layer around a ``SlotStore``, for its ``reorder_cache`` tiling).
    ``<recipe>-rolling`` is the recipe with ``positions="rolling"`` and a plain RoPE table."""
    from evictlayers.compose.positions import RotaryTable
    from evictlayers.hf.cache import EvictionLayer

    if name.endswith("-rolling"):
        policy = recipe(name.removesuffix("-rolling"), budget=slots - 1, positions="rolling")
        layer = EvictionLayer(policy, rotary=RotaryTable(rope_table))
    else:
        layer = EvictionLayer(recipe(name, budget=slots - 1))
    generator = torch.Generator().manual_seed(slots)
    query = torch.randn(1, Q_HEADS, slots, HEAD_DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, slots, HEAD_DIM, generator=generator) for _ in range(2))
    with torch.inference_mode():
        layer.store.step(query, key, value, scaling=HEAD_DIM**-0.5)
    return layer


def compile_unavailable() -> str | None:
    """Why the slot store cannot compile its decode step here, or ``None`` if it can."""
    from evictlayers.compose import Policy, SlotStore

    try:
        SlotStore(Policy(), compile=True)
    except TypeError as error:
        return f"SlotStore(compile=True) is not available: {error}"
    return None


def cases(context: Context) -> list[Case]:
    settings = context.settings
    slot_counts, batches, warmup, steps = sizes(settings.quick)
    repeats = settings.repeats_for(DEFAULT_REPEATS)
    layers: dict[tuple[int, str], object] = {}  # the batch-1 prefilled layer of a slot count and recipe

    def measure(config: str, slots: int, batch: int) -> dict:
        params = {"slots": slots, "batch": batch}
        if config.endswith("-compiled"):
            reason = "--no-compile" if not settings.compile else compile_unavailable()
            if reason:
                return skipped(config, params, reason)
        query, key, value = random_step(batch, torch.Generator().manual_seed(batch))
        if config == "sdpa":
            keys, values = (torch.randn(batch, KV_HEADS, slots, HEAD_DIM) for _ in range(2))

            def step():
                torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
        else:
            name = recipe_of(config)
            if (slots, name) not in layers:
                if any(held != slots for held, _ in layers):
                    layers.clear()  # one slot count at a time
                layers[(slots, name)] = filled_layer(slots, name)
            source = layers[(slots, name)]
            layer = tiled(source, batch, keep=[source.store.policy])
            layer.store.compile = config.endswith("-compiled")

            def step():
                layer.store.step(query, key, value, scaling=HEAD_DIM**-0.5)

        with torch.inference_mode():
            seconds, timed_compiles = timed_blocks(step, warmup, steps, repeats)
        info = {"timed_compiles": timed_compiles} if config.endswith("-compiled") else {}
        return row(config, params, {"step_us": metric([s * 1e6 for s in seconds], "us", BASELINE, False)}, info)

    out = []
    for slots in slot_counts:
        for batch in batches:
            for config in CONFIGS:
                kv_bytes = 2 * batch * KV_HEADS * slots * HEAD_DIM * 4
                estimate = (warmup + steps * repeats) * (estimate_step_s(kv_bytes) + STEP_OVERHEAD_S)
                if config.endswith("-compiled") and settings.compile:
                    estimate += COMPILE_S["el"]
                out.append(Case(
                    NAME, config, {"slots": slots, "batch": batch}, estimate,
                    lambda c=config, s=slots, b=batch: measure(c, s, b),
                ))
    return out
