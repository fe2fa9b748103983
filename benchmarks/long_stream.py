"""``python -m benchmarks.long_stream``: streamed perplexity far past the context window.

The embedded model (context 8,192 tokens) reads 5x its window of PG-19 text (the sample books, an equal
share of each, concatenated) and predicts every next token. Configurations:

| config | what runs |
|---|---|
| `hf` | the unmodified model, `DynamicCache` over every token: positions run past its trained window |
| `hf-windows` | the unmodified model with a fresh cache at every context window: what each window's text costs within the trained context (the reference the others are divided by, per window) |
| `el-<recipe>-rolling` | the recipe at a fixed token budget with `positions="rolling"`: ranks in the cache |
| `el-<recipe>-absolute` | the same budget with each key at its original position (the default) |

Text is fed in chunks (`--chunk`, default 64): a chunk attends to the cache plus itself, then the
policy evicts down to its budget (the store's multi-token step). Each config records the negative
log-likelihood of every token, the resident memory (RSS) after every chunk and the KV bytes the cache
holds. Results: `benchmarks/results/long_stream.json`, `.md` (perplexity per context-window-sized
window, RSS first vs last) and `.png` (perplexity per block and RSS along the stream).
``--quick`` runs a tiny random Llama (context 128) on random ids: a smoke run of the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, load_subject, recipe, rss_mib
from benchmarks.suite import environment

DEFAULT_RECIPES = ("streaming_llm", "h2o")


def stream_tokens(subject, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids: an equal share of every PG-19 sample book (from 10% in), concatenated."""
    if subject.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(3, subject.model.config.vocab_size, (1, tokens), generator=generator)
    from evictlayers.eval.tasks.documents import document_windows, read_texts

    texts = read_texts()
    share = -(-tokens // len(texts))
    pieces = [document_windows(subject.tokenizer, [text], 1, share)[0]["input_ids"] for text in texts]
    return torch.tensor([sum(pieces, [])[:tokens]])


def run_config(model, ids: torch.Tensor, policy, chunk: int, reset_every: int | None = None) -> dict:
    """Feed ``ids`` in chunks; per-token NLL, RSS after each chunk, KV bytes held at the end.

    ``policy`` ``None`` is the unmodified model; ``reset_every`` (a multiple of ``chunk``) starts it on a
    fresh cache every that many tokens."""
    import evictlayers as el
    from transformers import DynamicCache

    n = ids.shape[1] - 1
    nll = torch.empty(n, dtype=torch.float64)
    rss, started = [], time.perf_counter()
    with torch.inference_mode():
        run = el.apply(model, policy) if policy is not None else None
        try:
            cache = run.new_cache() if run is not None else DynamicCache(config=model.config)
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                if reset_every and start % reset_every == 0 and start:
                    cache = DynamicCache(config=model.config)
                offset = start - start % reset_every if reset_every else 0
                mask = torch.ones(1, end - offset, dtype=torch.long)
                logits = model(input_ids=ids[:, start:end], attention_mask=mask, past_key_values=cache).logits
                logp = torch.log_softmax(logits[0].float(), dim=-1)
                nll[start:end] = -logp.gather(-1, ids[0, start + 1 : end + 1, None])[:, 0].double()
                rss.append(rss_mib())
            if run is not None:
                kv_bytes = run.stats()["kv_bytes"]
            else:
                kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        finally:
            if run is not None:
                run.remove()
    return {"nll": nll.tolist(), "rss_mib": rss, "kv_bytes": kv_bytes, "seconds": time.perf_counter() - started}


def windows(nll: list[float], size: int) -> list[float]:
    """Perplexity of each ``size``-token window of the stream (the last one may be shorter)."""
    return [math.exp(sum(nll[s : s + size]) / len(nll[s : s + size])) for s in range(0, len(nll), size)]


def summarize(name: str, result: dict, context: int, block: int, reference: dict | None) -> dict:
    """Perplexities over the first window, past it, per window and per block; with ``reference`` (the
    ``hf-windows`` result) each window's perplexity over the reference's on the same text."""
    nll = result["nll"]
    per_window = windows(nll, context)
    ratio = None
    if reference is not None:
        ratio = [p / q for p, q in zip(per_window, reference["perplexity_per_window"])]
    first, past = nll[:context], nll[context:]
    rss = result["rss_mib"]
    warm = rss[len(rss) // 5 :]  # after the first fifth: allocator and first-window growth settle
    return {
        "config": name,
        "perplexity_first_window": math.exp(sum(first) / len(first)),
        "perplexity_past_window": math.exp(sum(past) / len(past)) if past else None,
        "perplexity_per_window": per_window,
        "per_window_vs_hf_windows": ratio,
        "perplexity_per_block": windows(nll, block),
        "rss_mib_first": rss[0],
        "rss_mib_last": rss[-1],
        "rss_mib_drift_after_warmup": max(warm) - min(warm),
        "rss_mib": rss,
        "kv_bytes": result["kv_bytes"],
        "seconds": result["seconds"],
    }


def markdown(payload: dict) -> str:
    s = payload["settings"]
    lines = [
        f"# Streamed perplexity past the context window ({payload['subject']})",
        "",
        f"{s['tokens']:,} tokens of PG-19 (the sample books concatenated), context window {s['context']:,}, "
        f"budget {s['budget']} tokens per head, chunks of {s['chunk']}; {payload['environment']['date']}, "
        f"{payload['environment']['threads']} thread(s). Rerun: `{payload['command']}`.",
        "",
        "| config | ppl, first window | ppl, past the window | ppl per window | per window / hf-windows "
        "| KV MiB at the end | RSS MiB first -> last | RSS drift after warm-up | minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        past = f"{r['perplexity_past_window']:.2f}" if r["perplexity_past_window"] is not None else "-"
        per = " / ".join(f"{p:.1f}" for p in r["perplexity_per_window"])
        ratio = " / ".join(f"{p:.2f}" for p in r["per_window_vs_hf_windows"] or [])
        lines.append(
            f"| {r['config']} | {r['perplexity_first_window']:.2f} | {past} | {per} | {ratio} | {r['kv_bytes'] / 2**20:.1f} "
            f"| {r['rss_mib_first']:.0f} -> {r['rss_mib_last']:.0f} | {r['rss_mib_drift_after_warmup']:.0f} "
            f"| {r['seconds'] / 60:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = payload["settings"]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in payload["results"]:
        blocks = r["perplexity_per_block"]
        top.plot([(i + 0.5) * s["block"] for i in range(len(blocks))], blocks, label=r["config"])
        bottom.plot([min((i + 1) * s["chunk"], s["tokens"]) for i in range(len(r["rss_mib"]))], r["rss_mib"],
                    label=r["config"])
    for axis in (top, bottom):
        axis.axvline(s["context"], color="grey", linestyle="--", linewidth=1)
    top.set_yscale("log")
    top.set_ylabel(f"perplexity per {s['block']}-token block")
    top.set_title(f"{payload['subject']}: {s['tokens']:,} tokens, context {s['context']:,} (dashed)")
    top.legend()
    bottom.set_ylabel("RSS (MiB)")
    bottom.set_xlabel("tokens streamed")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_stream", description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=float, default=5.0, help="stream length in context windows (default 5)")
    parser.add_argument("--budget", type=int, default=512, help="tokens per head the policies keep (default 512)")
    parser.add_argument("--chunk", type=int, default=64, help="tokens fed per forward (default 64)")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), help="shipped recipes to run")
    parser.add_argument("--no-absolute", action="store_true", help="skip the positions='absolute' runs")
    parser.add_argument("--no-hf", action="store_true",
                        help="skip the unmodified model's runs (hf, the longest, and hf-windows)")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, context 128: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"output directory (default {RESULTS_DIR})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    subject = load_subject(args.quick)
    model = subject.model
    if args.quick:
        model.config.max_position_embeddings = 128
    context = model.config.max_position_embeddings
    tokens = int(args.windows * context)
    budget = min(args.budget, context // 4) if args.quick else args.budget
    ids = stream_tokens(subject, tokens + 1)
    configs: list[tuple[str, object]] = [] if args.no_hf else [("hf-windows", None)]
    for name in args.recipes:
        for positions in ("rolling",) if args.no_absolute else ("rolling", "absolute"):
            configs.append((f"el-{name}-{positions}", recipe(name, budget, positions=positions)))
    if not args.no_hf:  # last: the longest run
        configs.append(("hf", None))
    block = max(context // 8, 1)
    if context % args.chunk:
        raise SystemExit(f"--chunk {args.chunk} must divide the context window ({context})")
    results, reference = [], None
    for name, policy in configs:
        print(f"[{name}] streaming {tokens:,} tokens ...", flush=True)
        reset = context if name == "hf-windows" else None
        result = summarize(name, run_config(model, ids, policy, args.chunk, reset), context, block, reference)
        if name == "hf-windows":
            reference = result
        print(
            f"[{name}] ppl first window {result['perplexity_first_window']:.2f}, past it "
            f"{result['perplexity_past_window']:.2f}, KV {result['kv_bytes'] / 2**20:.1f} MiB, "
            f"RSS {result['rss_mib_first']:.0f} -> {result['rss_mib_last']:.0f} MiB, {result['seconds'] / 60:.1f} min",
            flush=True,
        )
        results.append(result)
    command = "python -m benchmarks.long_stream " + " ".join(argv if argv is not None else sys.argv[1:])
    payload = {
        "subject": subject.name,
        "command": command.strip(),
        "settings": {"tokens": tokens, "context": context, "budget": budget, "chunk": args.chunk, "block": block},
        "environment": environment(torch.get_num_threads()),
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("long_stream-quick" if args.quick else "long_stream")
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    stem.with_suffix(".md").write_text(markdown(payload))
    plot(payload, stem.with_suffix(".png"))
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    main()
