"""kvpress's raw predictions scored with evictlayers' RULER scoring, as a ``ruler.json`` of ``evictlayers eval``.

Runs in the main install, from the repository root::

    python -m research.kvpress.score out/kvpress/default-4096/prompts.json out/kvpress/default-4096/raw-*.json \\
        --out out/kvpress/default-4096 [--evictlayers out/ruler-default-4096/ruler.json]

Each answer is scored as ``evictlayers eval --task ruler`` scores its own: the generated ids up to the first
end-of-sequence token, decoded with evictlayers' tokenizer of the model (special tokens skipped),
post-processed and matched as RULER does (:mod:`evictlayers.eval.tasks.ruler.scoring`), summarised by
``summarize_ruler``. One run per press and compression ratio, in the shape of ``ruler.json``'s runs:
``policy`` ``kvpress:<press>``, ``budget`` ``1 - ratio`` (the share of the compressed ids a press keeps), so
that ``plot_ruler`` puts it at compression ratio ``ratio`` and ``research.transfer`` reads it beside the
recipes' runs. A (press, ratio, setting) cell whose prompts did not all run (the press failed) is left out
of the run and listed in the markdown with its error.

``KV kept`` (``kept_fraction``) is counted as evictlayers counts it: the KV slots held at the end of
generation (the compressed context, plus the ids fed after it and the generated ones) over those the full
cache holds; ``kept_context_fraction`` is the compressed part alone (what the ratio sets). A head-wise press
(AdaKV, KVzip) masks keys instead of removing them, so its ``kv_bytes`` (K and V in float32 of the kept
slots) is the memory a real eviction would hold, not what kvpress's cache held.

``no_press`` (kvpress's pipeline without a press) is not one of the runs: its answers are compared with
evictlayers' full cache where ``--evictlayers`` gives one (the same model on the same ids should answer the
same), and reported as a check. ``--evictlayers`` also writes ``ruler_with_evictlayers.json`` and its plot:
the recipes' runs and the presses' runs in one result, refused unless both ran the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PROMPT_SETTINGS", "kvpress_result", "main", "markdown", "merge_with", "score_records"]

# the settings that fix which prompts a ruler.json ran: two results compare like with like when these agree
PROMPT_SETTINGS = ("tasks", "lengths", "samples", "template", "chat", "seed", "max_new_tokens", "sources", "split",
                   "depths")
FLOAT_BYTES = 4  # the model runs in float32 on both sides


def _decode(tokenizer, ids: Sequence[int]) -> tuple[str, int]:
    """``(post-processed text, generated tokens counted)`` as ``RulerTask.run`` decodes a row."""
    from evictlayers.eval.tasks.ruler import postprocess

    tokens = list(ids)
    eos = tokenizer.eos_token_id
    if eos in tokens:  # what follows the end of sequence is not the answer
        tokens = tokens[: tokens.index(eos) + 1]
    return postprocess(tokenizer.decode(tokens, skip_special_tokens=True)), len(tokens)


def score_records(tokenizer, prompts: dict, raws: Sequence[dict]) -> tuple[dict, list[dict], list[dict]]:
    """``(records by (press, ratio, setting), failures, incomplete cells)``: each raw record decoded and scored,
    in the fields of ``ruler.json``'s examples (plus kvpress's own)."""
    from evictlayers.eval.tasks.ruler import group_of, sample_score

    by_id = {p["id"]: p for p in prompts["prompts"]}
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    failures = []
    for raw in raws:
        if raw.get("model") != prompts["model"]:
            raise ValueError(f"a raw file of model {raw.get('model')!r} beside prompts of {prompts['model']!r}")
        failures += raw.get("failures", [])
        for r in raw["records"]:
            prompt = by_id.get(r["id"])
            if prompt is None:
                raise ValueError(f"raw record {r['id']} is not a prompt of the export (another export's raw file?)")
            generated, n_generated = _decode(tokenizer, r["generated_ids"])
            layers, heads = r["n_layers"], r["n_kv_heads"]
            fed_after = prompt["n_tokens"] - r["compressed_tokens"] + n_generated - 1  # the last token is not fed
            retained = r["kept_context_slots"] + fed_after * layers * heads
            full = (prompt["n_tokens"] + n_generated - 1) * layers * heads
            cells[(r["press"], r["ratio"], r["setting"])][r["id"]] = {
                "task": prompt["task"], "group": group_of(prompt["task"]), "length": prompt["length"],
                "sample": prompt["sample"], "setting": r["setting"], "n_context": prompt["n_context"],
                "n_question_end": prompt["n_question_end"], "compressed_tokens": r["compressed_tokens"],
                "answers": prompt["answers"], "max_new_tokens": prompt["max_new_tokens"],
                "n_tokens": prompt["n_tokens"], "haystack": prompt["haystack"], "retained_slots": retained,
                "full_slots": full, "seen_tokens": prompt["n_tokens"] + n_generated - 1,
                "kept_context_slots": r["kept_context_slots"], "context_slots": r["context_slots"],
                "budget_tokens": r["kept_context_slots"] / (layers * heads),
                "kv_bytes": retained * r["head_dim"] * 2 * FLOAT_BYTES, "sketch_bytes": 0.0,
                "seconds": r["seconds"], "generated": generated, "generated_kvpress": r["generated_kvpress"],
                "score": sample_score(generated, prompt["answers"]), "prompt_tokens": prompt["n_tokens"],
                "tokens": prompt["n_tokens"] + n_generated, "attn": r.get("attn"),
            }
    wanted = {p["id"] for p in prompts["prompts"]}
    incomplete = []
    for key, records in list(cells.items()):
        if set(records) != wanted:
            incomplete.append({"press": key[0], "ratio": key[1], "setting": key[2],
                               "ran": len(records), "of": len(wanted)})
            del cells[key]
    order = {p["id"]: i for i, p in enumerate(prompts["prompts"])}
    return ({k: sorted(v.values(), key=lambda r: order[f"{r['task']}/{r['length']}/{r['sample']}"])
             for k, v in cells.items()}, failures, incomplete)


def _memory(records: Sequence[dict]) -> dict:
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["seconds"] for r in records)
    return {
        "kept_fraction": sum(r["retained_slots"] for r in records) / sum(r["full_slots"] for r in records),
        "kept_context_fraction": (sum(r["kept_context_slots"] for r in records)
                                  / sum(r["context_slots"] for r in records)),
        "kv_bytes": sum(r["kv_bytes"] for r in records) / len(records),
        "budget_tokens": sum(r["budget_tokens"] for r in records) / len(records),
        "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
    }


def _run(press: str, ratio: float, by_setting: dict[str, list[dict]], registry: str, version: str) -> dict:
    from evictlayers.eval.ruler_run import summarize_ruler
    from evictlayers.eval.runner import budget_label

    records = [r for setting in by_setting.values() for r in setting]
    budget = None if press == "no_press" else round(1.0 - ratio, 6)
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["seconds"] for r in records)
    return {
        "label": f"kvpress:{press}@{budget_label(budget)}", "policy": f"kvpress:{press}",
        "recipe": f"kvpress {version}: {registry}, compression_ratio={ratio:g}", "budget": budget,
        "full_cache": press == "no_press", "compression_ratio": ratio,
        **summarize_ruler(records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records) / len(records), "prefill_chunk": None,
        "memory_by_setting": {s: _memory(rs) for s, rs in by_setting.items()},
        "n": len(records), **{k: v for k, v in _memory(records).items() if k != "tokens_per_s"},
        "sketch_bytes": 0.0, "tokens": tokens, "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "seconds_per_prompt": seconds / len(records),
        "examples": [{"index": i, **r} for i, r in enumerate(records)],
    }


def kvpress_result(tokenizer, prompts: dict, raws: Sequence[dict], raw_files: Sequence[str] = ()) -> dict:
    """The ``ruler.json``-shaped result of the raw files ``raws`` of the export ``prompts``."""
    from evictlayers.eval.ruler_run import SETTINGS

    cells, failures, incomplete = score_records(tokenizer, prompts, raws)
    registry = {k: v for raw in raws for k, v in raw.get("presses", {}).items()}
    meta = next((raw for raw in raws if raw.get("kvpress")), {})
    version = meta.get("kvpress", "?")
    runs, no_press = [], None
    for press, ratio in dict.fromkeys((p, r) for p, r, _ in cells):
        by_setting = {s: cells[(press, ratio, s)] for s in SETTINGS if (press, ratio, s) in cells}
        run = _run(press, ratio, by_setting, registry.get(press, "?"), version)
        if press == "no_press":
            no_press = run
        else:
            runs.append(run)
    runs.sort(key=lambda r: (list(registry).index(r["policy"][8:]) if r["policy"][8:] in registry else 99,
                             r["compression_ratio"]))
    settings_run = [s for s in SETTINGS if any(s in r["scores"] for r in runs + [no_press] if r)]
    return {
        "task": "ruler", "score_name": "RULER score", "higher_is_better": True, "model": prompts["model"],
        "settings": {**prompts["settings"], "setting": settings_run, "n_bins": 20},
        "n_examples": sum(r["n"] for r in runs), "budgets": sorted({r["budget"] for r in runs}, reverse=True),
        "batch_size": 1, "devices": 1, "threads": meta.get("threads"), "compile": False, "seed": 0,
        "wall_seconds": sum(r["seconds"] for r in runs + ([no_press] if no_press else [])),
        "runs": runs,
        "kvpress": {
            "version": version, "transformers": meta.get("transformers"), "torch": meta.get("torch"),
            "model_source": meta.get("model_source"), "presses": registry, "raw_files": list(raw_files),
            "split": {"query_agnostic": "ids[:n_context] compressed, then the rest",
                      "query_aware": "ids[:n_question_end] (context and question) compressed, then the end of the "
                                     "chat template and the answer prefix"},
            "failures": failures, "incomplete": incomplete, "no_press": no_press,
            "prompts_per_point": len(prompts["prompts"]),
        },
    }


def merge_with(result: dict, evictlayers: dict) -> dict:
    """``evictlayers`` (a ``ruler.json`` of ``evictlayers eval``) with the presses' runs added: one result for
    ``plot_ruler`` and ``research.transfer``.

    Raises:
        ValueError: the two ran other prompts (another model, split, length, sample count, ...).
    """
    if evictlayers.get("task") != "ruler":
        raise ValueError(f"--evictlayers: a {evictlayers.get('task')} result, not a ruler.json")
    differ = [f"{k}: evictlayers {evictlayers['settings'].get(k)!r}, kvpress {result['settings'].get(k)!r}"
              for k in PROMPT_SETTINGS if evictlayers["settings"].get(k) != result["settings"].get(k)]
    if evictlayers.get("model") != result["model"]:
        differ.insert(0, f"model: evictlayers {evictlayers.get('model')!r}, kvpress {result['model']!r}")
    if differ:
        raise ValueError("--evictlayers ran other prompts than the export: " + "; ".join(differ))
    names = {r["policy"] for r in evictlayers["runs"]} & {r["policy"] for r in result["runs"]}
    if names:
        raise ValueError(f"--evictlayers already holds runs named {sorted(names)}")
    from evictlayers.eval.ruler_run import SETTINGS

    present = set(evictlayers["settings"]["setting"]) | set(result["settings"]["setting"])
    merged = {**evictlayers, "runs": evictlayers["runs"] + result["runs"], "kvpress": result["kvpress"]}
    merged["settings"] = {**evictlayers["settings"], "setting": [s for s in SETTINGS if s in present]}
    merged["budgets"] = sorted({r["budget"] for r in merged["runs"] if r["budget"] is not None}, reverse=True)
    return merged


def agreement(no_press: dict | None, evictlayers: dict | None) -> list[str]:
    """Markdown lines: kvpress without a press against evictlayers' full cache, prompt by prompt."""
    if no_press is None:
        return ["kvpress without a press (`no_press`) was not run."]
    full = next((r for r in (evictlayers or {}).get("runs", []) if r["full_cache"]), None)
    score = ", ".join(f"{s}: {v:.1f}" for s, v in no_press["by_setting"].items())
    lines = [f"kvpress without a press (`no_press`): RULER score {score}."]
    if full is None or "examples" not in full:
        return lines + ["(No evictlayers full-cache run with examples given: `--evictlayers` compares them.)"]
    theirs = {(e["setting"], e["task"], e["length"], e["sample"]): e for e in full["examples"]}
    same = total = 0
    differ = []
    for e in no_press["examples"]:
        other = theirs.get((e["setting"], e["task"], e["length"], e["sample"]))
        if other is None:
            continue
        total += 1
        if other["generated"] == e["generated"]:
            same += 1
        else:
            differ.append(f"{e['setting']} {e['task']}/{e['length']}/{e['sample']}")
    full_score = ", ".join(f"{s}: {v:.1f}" for s, v in full["by_setting"].items())
    lines.append(f"evictlayers' full cache: {full_score}. The same answer text on {same} of {total} prompts"
                 + (f" (differ: {', '.join(differ[:10])}{' ...' if len(differ) > 10 else ''})." if differ else "."))
    return lines


def markdown(result: dict, evictlayers: dict | None = None) -> str:
    """The presses' table (``ruler_report.markdown_table``), seconds per prompt, failures and the check."""
    from evictlayers.eval.ruler_report import markdown_table

    kv = result["kvpress"]
    s = result["settings"]
    head = [f"# kvpress {kv['version']} presses on evictlayers' RULER prompts: {result['model']}", "",
            f"Split {s['split']}, lengths {', '.join(map(str, s['lengths']))}, {s['samples']} prompt(s) per task and "
            f"length ({kv['prompts_per_point']} per press, ratio and setting), chat template: {s['chat']}, "
            f"max_new_tokens: {s['max_new_tokens'] or 'RULER per task'}; transformers {kv['transformers']}, "
            f"torch {kv['torch']}, {result['threads']} thread(s). Budget = 1 - compression ratio; KV kept: slots held "
            "at the end of generation over the full cache's (evictlayers' measure).", ""]
    table = markdown_table(result) if result["runs"] else "(no press ran on every prompt)"
    timing = ["", "| press | ratio | setting | seconds per prompt | kept of the compressed ids |",
              "|---|---|---|---|---|"]
    for run in result["runs"] + ([kv["no_press"]] if kv.get("no_press") else []):
        for setting, memory in run["memory_by_setting"].items():
            rs = [e for e in run["examples"] if e["setting"] == setting]
            timing.append(f"| {run['policy']} | {run['compression_ratio']:g} | {setting} | "
                          f"{sum(e['seconds'] for e in rs) / len(rs):.2f} | {memory['kept_context_fraction']:.1%} |")
    out = head + [table] + timing + ["", *agreement(kv.get("no_press"), evictlayers), ""]
    if kv["failures"] or kv["incomplete"]:
        out += ["Not scored (a press that failed, or a cell not every prompt of which ran):", ""]
        out += [f"- `{f['press']}` ratio {f['ratio']:g} {f['setting']} on {f['id']}: {f['error']}"
                f" ({f.get('skipped', 0)} more prompts skipped)" for f in kv["failures"]]
        out += [f"- `{c['press']}` ratio {c['ratio']:g} {c['setting']}: {c['ran']} of {c['of']} prompts ran"
                for c in kv["incomplete"]]
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.kvpress.score", description=__doc__.split("\n")[0])
    parser.add_argument("prompts", type=Path, help="the export (research.kvpress.export_prompts)")
    parser.add_argument("raw", type=Path, nargs="+", help="raw files of research.kvpress.run_presses")
    parser.add_argument("--evictlayers", type=Path, default=None,
                        help="a ruler.json of `evictlayers eval` on the same prompts: merged, and its full cache "
                             "compared with kvpress's no_press")
    parser.add_argument("--out", type=Path, required=True, help="folder for ruler.json, ruler.md and the plot")
    args = parser.parse_args(argv)

    prompts = json.loads(args.prompts.read_text())
    raws = [json.loads(p.read_text()) for p in args.raw]
    evictlayers = json.loads(args.evictlayers.read_text()) if args.evictlayers else None
    from evictlayers.cli import load_model
    from evictlayers.eval.ruler_report import plot_ruler

    _, tokenizer = load_model(prompts["model"], prog=parser.prog)
    try:
        result = kvpress_result(tokenizer, prompts, raws, [str(p) for p in args.raw])
        merged = merge_with(result, evictlayers) if evictlayers else None
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    written = [args.out / "ruler.json", args.out / "ruler.md"]
    written[0].write_text(json.dumps(result, indent=1))
    text = markdown(result, evictlayers)
    written[1].write_text(text + "\n")
    title = f"kvpress {result['kvpress']['version']} on evictlayers' RULER prompts ({result['settings']['split']})"
    if result["runs"]:
        written.append(plot_ruler([result], args.out / "ruler_score_vs_compression.png", title=title))
    if merged is not None:
        (args.out / "ruler_with_evictlayers.json").write_text(json.dumps(merged, indent=1))
        written += [args.out / "ruler_with_evictlayers.json",
                    plot_ruler([merged], args.out / "ruler_with_evictlayers.png", title=title + ", with evictlayers")]
    print(text)
    print("wrote " + ", ".join(str(p) for p in written if p is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
