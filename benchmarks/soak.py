"""``python -m benchmarks.soak``: 20,000 decode steps under eviction, watched.

A tiny random Llama (``benchmarks.common.tiny_llama``, batch 2) decodes ``--steps`` sampled tokens
under each recipe at a fixed budget, with absolute and with rolling positions. Every ``--every``
steps it records the resident memory (RSS), the most tokens any head holds, whether any logit is
NaN/inf and the median step time of the block. Results: ``benchmarks/results/soak.json`` and ``.md``.
The slow test ``tests/test_soak.py`` asserts the same properties; this entry keeps the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, recipe, rss_mib, tiny_llama
from benchmarks.suite import environment

DEFAULT_RECIPES = ("h2o", "tova_keydiff")


def soak(model, policy, steps: int, every: int, budget: int) -> dict:
    import evictlayers as el

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (2, 4 * budget), generator=generator)
    mask = torch.ones_like(ids)
    blocks, times = [], []
    with torch.inference_mode(), el.apply(model, policy) as run:
        cache = run.new_cache()
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        for step in range(1, steps + 1):
            start = time.perf_counter()
            # sampled, so the cache content keeps changing
            token = torch.multinomial(out.logits[:, -1].float().softmax(-1), 1, generator=generator)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache)
            times.append(time.perf_counter() - start)
            if step % every == 0:
                layers = run.stats()["layers"]
                blocks.append({
                    "step": step,
                    "rss_mib": rss_mib(),
                    "max_retained": max(layer["retained_tokens"] for layer in layers),
                    "finite": bool(torch.isfinite(out.logits).all()),
                    "step_ms_median": 1000 * statistics.median(times),
                })
                times = []
    warm = [b["rss_mib"] for b in blocks[2:]] or [b["rss_mib"] for b in blocks]
    return {
        "blocks": blocks,
        "all_finite": all(b["finite"] for b in blocks),
        "max_retained": max(b["max_retained"] for b in blocks),
        "rss_mib_drift_after_warmup": max(warm) - min(warm),
        "step_ms_first_block": blocks[0]["step_ms_median"],
        "step_ms_last_block": blocks[-1]["step_ms_median"],
    }


def markdown(payload: dict) -> str:
    s = payload["settings"]
    lines = [
        "# Soak: decode steps under eviction",
        "",
        f"{s['steps']:,} sampled decode steps, tiny random Llama, batch 2, budget {s['budget']} tokens per head; "
        f"{payload['environment']['date']}, {payload['environment']['threads']} thread(s). "
        f"Rerun: `{payload['command']}`.",
        "",
        "| config | all logits finite | most tokens held (budget) | RSS drift after warm-up (MiB) "
        "| step ms, first -> last block |",
        "|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        lines.append(
            f"| {r['config']} | {'yes' if r['all_finite'] else 'NO'} | {r['max_retained']} ({s['budget']}) "
            f"| {r['rss_mib_drift_after_warmup']:.1f} | {r['step_ms_first_block']:.2f} -> {r['step_ms_last_block']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=1_000, help="steps per recorded block")
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.steps < args.every:
        parser.error("--steps must be at least --every")
    torch.set_num_threads(args.threads)
    model = tiny_llama()
    results = []
    for name in args.recipes:
        for positions in ("absolute", "rolling"):
            policy = recipe(name, args.budget, positions=positions)
            config = f"el-{name}-{positions}"
            print(f"[{config}] {args.steps:,} steps ...", flush=True)
            results.append({"config": config, **soak(model, policy, args.steps, args.every, args.budget)})
    payload = {
        "command": ("python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "settings": {"steps": args.steps, "every": args.every, "budget": args.budget},
        "environment": environment(torch.get_num_threads()),
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(payload, indent=1))
    (args.out / "soak.md").write_text(markdown(payload))
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    main()
