"""``memory``: key/value bytes a cache retains, measured against the formula.

After a batch-1 prefill of a PG-19 prompt, tiled to the batch, and a few decode steps, each row
reports the bytes of the key/value tensors the cache holds: ``run.stats()['kv_bytes']`` for
evictlayers, the DynamicCache's tensors for the unmodified model (``hf``, the baseline of the
ratio). The formula is ``layers * 2 * B * H_kv * slots * D * bytes`` (a sliding-window layer, as 5 of 6 in
Gemma 3, holds at most ``window - 1`` tokens) with ``slots`` the tokens seen for ``hf`` and ``el-full`` (a full
cache holds every token) and ``budget + 1`` for ``el-h2o`` at 20% (``budget = max(round_half_up(0.2 * prompt),
min_budget)``, the recipe's floor lifting a short prompt's fraction, at most ``window - 1`` on a sliding layer;
the spare slot is where the next token lands).
``vs_formula`` is measured / formula: ``el-full`` grows its slots in steps of ``2 * sqrt(slots)``
(``compose/store.py``'s ``growth_slots``), so it may hold that many more slots than the tokens it has seen.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from benchmarks.common import Case, Context, estimate_prefill_s, metric, row
from benchmarks.loop import DecodeLoop, PrefillMemo, kv_resident_bytes, tiled

NAME = "memory"
USES_MODEL = True
BASELINE = "hf"
DEFAULT_REPEATS = 1  # deterministic: byte counts do not vary between runs
CONFIGS = {"hf": "hf", "el-full": "full", "el-h2o": "h2o"}  # config -> prefill family
H2O_BUDGET = 0.2  # evictlayers/recipes/h2o.yaml


def sizes(quick: bool) -> tuple[int, tuple[int, ...], int]:
    """(prompt tokens, batch sizes, decode steps after the prompt)."""
    return (64, (1, 8), 2) if quick else (2048, (1, 8), 4)


def skip_reason(context: Context) -> str | None:
    return None


def formula_slots(config: str, prompt: int, seen: int) -> tuple[int, int]:
    """(tokens, spare slots) per KV head the formula expects: every token seen, or the H2O budget and the spare
    slot the next token lands in."""
    if config == "el-h2o":
        import evictlayers as el

        return max(math.floor(H2O_BUDGET * prompt + 0.5), el.load_recipe("h2o").min_budget), 1
    return seen, 0


def cases(context: Context) -> list[Case]:
    prompt, batches, steps = sizes(context.settings.quick)
    memo = PrefillMemo(context)

    def measure(config: str, batch: int) -> dict:
        import evictlayers as el

        model, source = context.subject.model, memo.get(CONFIGS[config], prompt)
        with torch.inference_mode(), (el.apply(model, source.policy) if source.policy else nullcontext()) as run:
            cache = tiled(source.cache, batch, keep=[source.policy])
            loop = DecodeLoop(model, model, cache, source.token.expand(batch, 1), prompt, steps)
            for _ in range(steps):
                loop()
            measured = run.stats()["kv_bytes"] if run is not None else kv_resident_bytes(cache)
        seen = prompt + steps
        tokens, spare = formula_slots(config, prompt, seen)
        formula = context.subject.kv_bytes(tokens, batch, spare)  # a sliding layer holds at most window - 1
        slots = tokens + spare
        return row(
            config, {"prompt": prompt, "batch": batch},
            {"kv_mib": metric([measured / 2**20], "MiB", BASELINE, higher_is_better=False)},
            {"seen": seen, "formula_slots": slots, "kv_bytes": measured, "formula_bytes": formula,
             "vs_formula": measured / formula},
        )

    out = []
    for config, family in CONFIGS.items():
        # one prefill per config, tiled to every batch size; the decode steps cost next to nothing
        prefill_s = estimate_prefill_s(context.subject.geometry, prompt, family != "hf", context.cores)
        for index, batch in enumerate(batches):
            out.append(Case(NAME, config, {"prompt": prompt, "batch": batch}, 0.0 if index else prefill_s,
                            lambda c=config, b=batch: measure(c, b)))
    return out
