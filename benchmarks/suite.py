"""``python -m benchmarks``: run the benchmark families, print a table, write the results files."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import (
    cpu_kernel, cpu_linear, decode, gpu_decode, kernel, memory, overhead, prefill, prefill_kernel, report,
)
from benchmarks.common import DEFAULT_MODEL, MODELS, RESULTS_DIR, Context, Settings, cpu_count

# the order they run in: the quick ones first, so a broken setup shows within seconds
FAMILIES = {
    module.NAME: module
    for module in (memory, overhead, decode, prefill, cpu_kernel, cpu_linear, kernel, prefill_kernel, gpu_decode)
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Speed and memory of evictlayers against unmodified transformers, measured in one run "
        "(see benchmarks/README.md).",
    )
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes on a tiny random Llama (seconds); writes no results unless --out")
    parser.add_argument("--only", nargs="+", choices=list(FAMILIES), metavar="NAME",
                        help=f"run only these benchmarks ({', '.join(FAMILIES)})")
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (default: per benchmark)")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: all cores; 1 with --quick, whose tensors are too small to share)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile configurations")
    parser.add_argument("--out", type=Path, help=f"directory for <machine>.json/.md (default: {RESULTS_DIR})")
    parser.add_argument("--model", choices=list(MODELS), default=DEFAULT_MODEL,
                        help="the model under test: 'default' (the embedded SmolLM2-135M-Instruct) or "
                             "'gemma-3-270m' (Gemma 3 270M); results of another model than the default go to "
                             "<machine>-<model>.json/.md; with --quick a tiny random model of that family "
                             "(default: %(default)s)")
    parser.add_argument("--prompts", type=int, nargs="+", metavar="TOKENS",
                        help="prompt lengths for decode and prefill instead of their own")
    parser.add_argument("--configs", nargs="+", metavar="CONFIG",
                        help="run only these configurations (e.g. hf-eager el-h2o); a ratio needs its baseline")
    parser.add_argument("--interleave", nargs="?", const=decode.BASELINE, metavar="CONFIG",
                        help="decode: time each configuration's blocks alternating with blocks of CONFIG (default: "
                             "the baseline, hf-sdpa) decoding beside it, and report the median ratio of the pairs "
                             "(vs_<CONFIG>_beside, e.g. vs_hf_sdpa_beside)")
    args = parser.parse_args(argv)
    if args.interleave is not None and args.interleave not in decode.COMPILE:
        parser.error(f"--interleave {args.interleave}: not a decode configuration; choose one of "
                     f"{', '.join(decode.COMPILE)}")
    if args.interleave is not None and decode.COMPILE[args.interleave] and args.no_compile:
        parser.error(f"--interleave {args.interleave} compiles, which --no-compile rules out")
    if args.prompts is not None and min(args.prompts) < 2:
        parser.error("--prompts must be >= 2 tokens")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def machine_slug(model: str = DEFAULT_MODEL) -> str:
    """``cpu-<cores>core`` (``cuda-<GPU name>``, e.g. ``cuda-nvidia-h200``, on a machine with CUDA), ``-<model>``
    after it for another model than the default: the results of different machines and models go to different
    files."""
    slug = f"cpu-{cpu_count()}core"
    if torch.cuda.is_available():
        slug = "cuda-" + "-".join(torch.cuda.get_device_name().lower().replace("_", " ").split())
    return slug if model == DEFAULT_MODEL else f"{slug}-{model}"


def cpu_name() -> str:
    try:
        for text in open("/proc/cpuinfo"):
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(threads: int) -> dict:
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": cpu_count(),
        "threads": threads,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,  # other work at the start
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


class Progress:
    """A tqdm bar over the cases, or a plain ``[i/n] label`` line where tqdm is not installed."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True) if tqdm else None
        self.total, self.done = total, 0

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label)
        else:
            print(f"[{self.done + 1}/{self.total}] {label} ...", file=sys.stderr, flush=True)

    def finish(self, text: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(text)
            self.bar.update()
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_case(case) -> dict:
    """The case's row; an exception becomes an ``error`` row so one failure does not end a long run."""
    try:
        return case.run()
    except Exception as error:  # noqa: BLE001 - recorded in the results and printed with its traceback
        traceback.print_exc()
        return {"config": case.config, "params": case.params, "status": "error",
                "reason": f"{type(error).__name__}: {error}", "metrics": {}, "info": {}}


def run(settings: Settings, names: list[str]) -> dict:
    """Run the named benchmark families; returns the results document (not yet written)."""
    context = Context(settings)
    env = environment(settings.threads)
    planned, results = [], {}
    for name in names:
        family = FAMILIES[name]
        reason = family.skip_reason(context)
        if reason:
            print(f"{name}: skipped, {reason}", flush=True)
            results[name] = {"status": "skipped", "reason": reason, "env": env, "quick": settings.quick}
        else:
            planned.append((name, [case for case in family.cases(context) if settings.wants(case.config)]))
    if settings.configs is not None:
        known = {case.config for _, cases in planned for case in cases}
        unknown = [config for config in settings.configs if config not in known]
        if unknown:
            raise SystemExit(f"--configs: {unknown} match no configuration of {[n for n, _ in planned]}")
    estimate = sum(case.estimate_s for _, cases in planned for case in cases)
    print(f"model: {MODELS[settings.model][1]}{' (tiny random, --quick)' if settings.quick else ''}", flush=True)
    print(f"{sum(len(c) for _, c in planned)} measurements, estimated {estimate / 60:.1f} min on {settings.threads} "
          f"threads with {context.cores:.1f} cores free (load average {env['load_average']:.1f}; a rough model "
          "calibrated on a 2-core machine)", flush=True)
    if env["load_average"] > 0.5 and settings.threads > 1:
        print("note: other processes are using the cores; threads that wait for a busy core make timings "
              "erratic (a 2-thread decode step varied 30x here). Ratios within one run stay comparable, but "
              "--threads 1 or an idle machine gives steadier numbers", flush=True)
    progress = Progress(sum(len(c) for _, c in planned))
    try:
        while planned:
            name, cases = planned.pop(0)  # dropped when done: its cases hold prefilled caches
            rows, start = [], time.perf_counter()
            for case in cases:
                progress.start(case.label)
                rows.append(run_case(case))
                report.add_ratios(rows)
                progress.finish(report.line(name, rows[-1]))
                results[name] = {"status": "ok", "env": env, "quick": settings.quick,
                                 **subject_of(FAMILIES[name], context), "seconds": time.perf_counter() - start,
                                 "rows": rows}
                if settings.out is not None and own_results_file(name):
                    # a long family on a lent GPU: what it measured so far survives a timeout
                    write_own(document(settings, env, results), name, settings.out)
            del cases
            gc.collect()
    finally:
        progress.close()
    return document(settings, env, results)


def document(settings: Settings, env: dict, results: dict) -> dict:
    """The results document of a run (``report`` describes it)."""
    return {"schema": report.SCHEMA, "machine": machine_slug(settings.model), "model": settings.model, "env": env,
            "benchmarks": results}


def own_results_file(name: str) -> bool:
    """Whether family ``name`` writes a results file of its own, ``<machine>-<RESULTS_SUFFIX>.json``/``.md`` with
    its ``markdown`` (``gpu_decode``: ``cuda-<gpu>-e2e``, beside the kernel results of ``cuda-<gpu>.json``)."""
    return getattr(FAMILIES[name], "RESULTS_SUFFIX", None) is not None


def write_own(results: dict, name: str, out: Path) -> tuple[Path, Path]:
    """Write family ``name``'s own results file from the run's document (replacing an earlier one)."""
    family = FAMILIES[name]
    machine = f"{machine_slug()}-{family.RESULTS_SUFFIX}"  # the family builds its own models: no --model suffix
    own = {**results, "machine": machine, "benchmarks": {name: results["benchmarks"][name]}}
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{machine}.json", out / f"{machine}.md"
    json_path.write_text(json.dumps(own, indent=1) + "\n")
    md_path.write_text(family.markdown(own))
    return json_path, md_path


def subject_of(family, context: Context) -> dict:
    """``{"model": name}`` of the model a family measured (``memory``, ``decode``, ``prefill``); ``{}``
    for those that never load it (``overhead``, ``cpu_kernel``, ``cpu_linear``, ``kernel``, ``prefill_kernel``: random
    tensors of SmolLM2's shapes)."""
    return {"model": context.subject.name} if getattr(family, "USES_MODEL", False) else {}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = args.threads or (1 if args.quick else cpu_count())
    settings = Settings(quick=args.quick, repeats=args.repeats, threads=threads, compile=not args.no_compile,
                        out=args.out or (None if args.quick else RESULTS_DIR), model=args.model,
                        prompts=tuple(args.prompts) if args.prompts else None,
                        configs=tuple(args.configs) if args.configs else None, interleave=args.interleave)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = run(settings, [name for name in FAMILIES if args.only is None or name in args.only])
    finally:
        torch.set_num_threads(previous_threads)
    for name, result in results["benchmarks"].items():
        table = getattr(FAMILIES[name], "table", report.table)
        print(f"\n## {name}\n\n{table(result) if result['status'] == 'ok' else 'skipped: ' + result['reason']}")
    if settings.out is not None:
        shared = {name: r for name, r in results["benchmarks"].items() if not own_results_file(name)}
        written = [report.write({**results, "benchmarks": shared}, settings.out)] if shared else []
        written += [write_own(results, name, settings.out) for name, r in results["benchmarks"].items()
                    if own_results_file(name) and r["status"] == "ok"]  # not a file that only says skipped
        for json_path, md_path in written:
            print(f"\nwrote {json_path} and {md_path}")
    return results
