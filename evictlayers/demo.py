"""The README side-by-side: passkey retrieval on the embedded model under several recipes.

``python -m evictlayers.demo`` loads SmolLM2-135M-Instruct (``evictlayers.models.load_default``), or
with ``--model gemma-3-270m`` Google's Gemma 3 270M base model (any name ``evictlayers.models.load``
takes), builds passkey prompts (``evictlayers.eval.tasks.passkey``, plain text, so a base model without
a chat template works too), and generates greedily for every prompt in one left-padded batch, once
with the unmodified model and once per recipe. It prints accuracy, the KV bytes the cache physically
holds after generation, prefill time, and decode throughput (the steps after the first new token)
measured in this run, with a progress bar per policy.

The demo shows eviction: it never asks ``evictlayers.apply`` for the weight-product op (``cpu_linear=True``), so
with ``--compile`` too "decode vs unmodified" holds none of that op's speedup (``benchmarks/decode.py`` times it
apart, in its ``+cpu_linear`` rows).

Speed on a shared machine: the unmodified model is timed again right before every recipe, and each
recipe's "decode vs unmodified" divides by the unmodified run beside it, not by one measured at the
start (a job that held the CPU for part of the run would otherwise skew every ratio). The unmodified
row shows the median of those runs and their spread (min-max).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

import evictlayers as el
from evictlayers.compose.recipes import SHIPPED_RECIPES
from evictlayers.eval.tasks.passkey import passkey_prompts, score_passkey
from evictlayers.models import PACKAGED_MODELS, load

RECIPES = SHIPPED_RECIPES
DEFAULT_RECIPES = (
    "full", "local", "streaming_llm", "h2o", "h2o_averaged", "scissorhands", "ahakv", "h2o_int4", "scissorhands_int4",
    "clustergen", "keydiff", "tova_keydiff",
)


class _StepClock(BaseStreamer):
    """A ``generate()`` streamer that timestamps every step and advances a progress bar.

    ``generate()`` hands the prompt to ``put`` first and then each new token, so the first timestamp
    after the prompt marks the end of prefill (and of the first decode step's sampling): decode
    throughput is measured from there to the last token.
    """

    def __init__(self, progress):
        self.progress, self.stamps, self.prompt_seen = progress, [], False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(time.perf_counter())
        self.progress.update(1)

    def end(self) -> None:
        pass


def _generate(model, inputs, max_new_tokens: int, label: str, progress: bool):
    """Greedy generation of exactly ``max_new_tokens``; returns (new ids, timings, cache)."""
    with tqdm(total=max_new_tokens, desc=f"  {label:<16}", unit="step", leave=False, disable=not progress) as bar:
        clock = _StepClock(bar)
        start = time.perf_counter()
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            return_dict_in_generate=True, streamer=clock,
        )
        elapsed = time.perf_counter() - start
    timings = {"seconds": elapsed, "prefill_seconds": clock.stamps[0] - start,
               "decode_seconds": clock.stamps[-1] - clock.stamps[0]}
    return out.sequences[:, inputs["input_ids"].shape[1] :], timings, out.past_key_values


def _cache_bytes(cache) -> int:
    """KV bytes a transformers cache physically holds (the unmodified model's DynamicCache)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run(recipes: list[str], n_prompts: int, target_tokens: int, max_new_tokens: int, seed: int,
        compile: bool | str = False, progress: bool = True, model_name: str = "default") -> list[dict]:
    """One table row per policy: the unmodified model first, then ``recipes`` on ``model_name``
    (a name or path :func:`evictlayers.models.load` takes)."""
    torch.manual_seed(seed)
    model, tokenizer = load(model_name)
    prompts = passkey_prompts(tokenizer, n_prompts=n_prompts, target_tokens=target_tokens, seed=seed)
    inputs = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)

    def row(name: str, generated, timings: dict, kv_bytes: int) -> dict:
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        correct = sum(score_passkey(text, p.answer) for text, p in zip(texts, prompts, strict=True))
        # the first new token comes out of the prefill pass; the other steps are decode steps
        decode_tokens = n_prompts * (max_new_tokens - 1)
        result = {"policy": name, "correct": correct, "prompts": n_prompts, "kv_bytes": kv_bytes,
                  "tokens_per_s": n_prompts * max_new_tokens / timings["seconds"],
                  "decode_tokens_per_s": decode_tokens / timings["decode_seconds"], **timings}
        print(f"  {name:<16} {correct}/{n_prompts}  {kv_bytes / 2**20:8.2f} MiB  prefill "
              f"{timings['prefill_seconds']:6.1f} s  decode {result['decode_tokens_per_s']:6.1f} tokens/s", flush=True)
        return result

    print(f"{model_name}: {n_prompts} passkey prompts, {inputs['input_ids'].shape[1]} tokens (padded), "
          f"{max_new_tokens} new tokens each, greedy{', decode step compiled' if compile else ''}", flush=True)
    with torch.inference_mode():
        generated, timings, cache = _generate(model, inputs, max_new_tokens, "unmodified (HF)", progress)
        unmodified = row("unmodified (HF)", generated, timings, _cache_bytes(cache))
        beside = [unmodified["decode_tokens_per_s"]]  # the unmodified runs, one before each recipe
        results = [unmodified]
        for index, name in enumerate(recipes):
            if index:
                _, timings, _ = _generate(model, inputs, max_new_tokens, "unmodified (HF)", progress)
                beside.append((n_prompts * (max_new_tokens - 1)) / timings["decode_seconds"])
            policy = el.load_recipe(RECIPES / f"{name}.yaml")
            with el.apply(model, policy, compile=compile, tokenizer=tokenizer) as patched:
                generated, timings, _ = _generate(model, inputs, max_new_tokens, name, progress)
                result = row(name, generated, timings, patched.stats()["kv_bytes"])
            result["unmodified_decode_tokens_per_s"] = beside[-1]
            results.append(result)
    unmodified["unmodified_decode_tokens_per_s"] = unmodified["decode_tokens_per_s"] = statistics.median(beside)
    unmodified["decode_spread"] = (min(beside), max(beside))
    return results


def table(results: list[dict]) -> str:
    full = results[0]["kv_bytes"]
    lines = [
        "| policy | passkey accuracy | retained KV | KV vs unmodified | prefill s | decode tokens/s | decode vs unmodified |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        decode = f"{r['decode_tokens_per_s']:.1f}"
        if "decode_spread" in r:  # the unmodified row: median of the runs beside each recipe, and their range
            decode += " ({:.1f}-{:.1f})".format(*r["decode_spread"])
        lines.append(
            f"| {r['policy']} | {r['correct']}/{r['prompts']} | {r['kv_bytes'] / 2**20:.2f} MiB | "
            f"{r['kv_bytes'] / full:.2f}x | {r['prefill_seconds']:.1f} | {decode} | "
            f"{r['decode_tokens_per_s'] / r['unmodified_decode_tokens_per_s']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evictlayers.demo", description=__doc__.splitlines()[0])
    packaged = "; ".join(f"'{name}': {model.description}" for name, model in PACKAGED_MODELS.items())
    parser.add_argument("--model", default="default",
                        help=f"'default' (the embedded SmolLM2-135M-Instruct), a packaged model ({packaged}), a "
                             "local checkpoint directory, or a Hugging Face id already in the local cache "
                             "(default: %(default)s)")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        help=f"recipe names from {RECIPES} (default: %(default)s)")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--target-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=24,
                        help="new tokens per prompt; all but the first are timed decode steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["max-autotune"],
                        help="compile each policy's decode steps (evictlayers.apply(compile=...), without "
                             "cpu_linear: the linear layers left as they are); '--compile max-autotune' also "
                             "freezes the weights into the graph")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: need >= 2 (one prefill token, then decode steps)")
    missing = [name for name in args.recipes if not (RECIPES / f"{name}.yaml").is_file()]
    if missing:
        available = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        parser.error(f"unknown recipe(s) {missing}; available in {RECIPES}: {available}")
    try:
        results = run(args.recipes, args.n_prompts, args.target_tokens, args.max_new_tokens, args.seed,
                      compile=args.compile, progress=not args.no_progress, model_name=args.model)
    except OSError as error:  # from load(): missing packages (the message has the pip command), no checkpoint
        parser.error(f"--model {args.model}: {error}")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
