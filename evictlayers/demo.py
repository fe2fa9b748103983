"""The README side-by-side: passkey retrieval on the embedded model under several recipes.

``python -m evictlayers.demo`` loads SmolLM2-135M-Instruct (``evictlayers.models.load_default``),
builds passkey prompts (``evictlayers.eval.tasks.passkey``), and generates greedily for every prompt
in one left-padded batch, once with the unmodified model and once per recipe. It prints accuracy, the
KV bytes the cache physically holds after generation, and generation throughput measured in this run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import evictlayers as el
from evictlayers.eval.tasks.passkey import passkey_prompts, score_passkey
from evictlayers.models import load_default

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPES = ("full", "local", "streaming_llm", "h2o", "h2o_averaged", "scissorhands", "ahakv")


def _generate(model, inputs, max_new_tokens: int):
    """Greedy generation of exactly ``max_new_tokens``; returns (new ids, seconds, cache)."""
    start = time.perf_counter()
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        return_dict_in_generate=True,
    )
    elapsed = time.perf_counter() - start
    return out.sequences[:, inputs["input_ids"].shape[1] :], elapsed, out.past_key_values


def _cache_bytes(cache) -> int:
    """KV bytes a transformers cache physically holds (the unmodified model's DynamicCache)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run(recipes: list[str], n_prompts: int, target_tokens: int, max_new_tokens: int, seed: int) -> list[dict]:
    torch.manual_seed(seed)
    model, tokenizer = load_default()
    prompts = passkey_prompts(tokenizer, n_prompts=n_prompts, target_tokens=target_tokens, seed=seed)
    inputs = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    new_tokens = n_prompts * max_new_tokens

    def row(name: str, generated, elapsed: float, kv_bytes: int) -> dict:
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        correct = sum(score_passkey(text, p.answer) for text, p in zip(texts, prompts, strict=True))
        result = {"policy": name, "correct": correct, "prompts": n_prompts, "kv_bytes": kv_bytes,
                  "tokens_per_s": new_tokens / elapsed, "seconds": elapsed}
        print(f"  {name:<16} {correct}/{n_prompts}  {kv_bytes / 2**20:8.2f} MiB  {elapsed:6.1f} s", flush=True)
        return result

    print(f"{n_prompts} passkey prompts, {inputs['input_ids'].shape[1]} tokens (padded), "
          f"{max_new_tokens} new tokens each, greedy", flush=True)
    with torch.inference_mode():
        generated, elapsed, cache = _generate(model, inputs, max_new_tokens)
        results = [row("unmodified (HF)", generated, elapsed, _cache_bytes(cache))]
        for name in recipes:
            policy = el.load_recipe(RECIPES / f"{name}.yaml")
            with el.apply(model, policy) as patched:
                generated, elapsed, _ = _generate(model, inputs, max_new_tokens)
                results.append(row(name, generated, elapsed, patched.stats()["kv_bytes"]))
    return results


def table(results: list[dict]) -> str:
    full = results[0]["kv_bytes"]
    lines = [
        "| policy | passkey accuracy | retained KV | KV vs unmodified | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['policy']} | {r['correct']}/{r['prompts']} | {r['kv_bytes'] / 2**20:.2f} MiB | "
            f"{r['kv_bytes'] / full:.2f}x | {r['tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evictlayers.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        help=f"recipe names from {RECIPES} (default: %(default)s)")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--target-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    missing = [name for name in args.recipes if not (RECIPES / f"{name}.yaml").is_file()]
    if missing:
        available = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        parser.error(f"unknown recipe(s) {missing}; available in {RECIPES}: {available}")
    results = run(args.recipes, args.n_prompts, args.target_tokens, args.max_new_tokens, args.seed)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
