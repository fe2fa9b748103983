"""``python -m research.claims``: run the experiments (or re-run part of them, or none), judge the claims
and write research/reports/results.md with its JSON files and plots (research/results/results/).

Paths are relative to the working directory: run it from the repository root.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

from evictlayers.eval.report import plot_positions, plot_score_vs_budget
from research.claims.experiments import EXPERIMENTS
from research.claims.render import render
from research.claims.run import run_experiments
from research.claims.saved import load_saved, merge_rerun, save
from research.claims.verdicts import CLAIMS

REPORT = Path("research/reports/results.md")
# the committed report keeps its runs with the other raw runs, not beside it
REPORT_ARTIFACTS = Path("research/results/results")


def default_artifacts(doc: str | os.PathLike) -> Path:
    """Where the JSON files and plots of the report at ``doc`` go: research/results/results/ for the
    committed report (:data:`REPORT`), else ``doc`` without its suffix (``out/results.md`` -> ``out/results/``),
    so a trial run elsewhere never overwrites the committed runs."""
    doc = Path(doc)
    return REPORT_ARTIFACTS if doc.resolve() == REPORT.resolve() else doc.with_suffix("")


def main(doc: str | os.PathLike = REPORT, artifacts: str | os.PathLike | None = None, data=None,
         model_name: str = "default", devices: int = 1, threads: int | None = None, quick: bool = False,
         progress: bool = True, model=None, tokenizer=None, render_only: bool = False, compile: bool = False,
         only: Sequence[str] | None = None, recipes: Sequence[str] | None = None) -> str:
    """Run the experiments and write the report to ``doc`` (JSON and plots under ``artifacts``, by default
    :func:`default_artifacts`); returns the report's text.

    ``render_only`` rebuilds the report, verdicts and plots from the JSON files of an earlier run in
    ``artifacts`` without evaluating anything. ``only`` (experiment keys) and ``recipes`` (names) re-run
    part of an earlier run: the new runs replace the saved ones of the same label, everything else is
    kept, and the report says which runs were measured when.
    """
    started = time.perf_counter()
    keys = [e.key for e in EXPERIMENTS]
    unknown = sorted(set(only or ()) - set(keys))
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; the experiments are {', '.join(keys)}")
    doc = Path(doc)
    artifacts = Path(artifacts) if artifacts is not None else default_artifacts(doc)
    artifacts.mkdir(parents=True, exist_ok=True)
    doc.parent.mkdir(parents=True, exist_ok=True)
    partial = only is not None or recipes is not None
    if render_only:
        meta, unavailable, results = load_saved(artifacts)
    else:
        if model is None:
            from evictlayers.models import load

            model, tokenizer = load(model_name)
        if partial:  # before the (long) run: a re-run needs the saved one
            meta, unavailable, results = load_saved(artifacts)
        new, new_unavailable = run_experiments(model, tokenizer, data=data, devices=devices, threads=threads,
                                               quick=quick, progress=progress, model_name=model_name,
                                               compile=compile, only=only, recipes=recipes)
        date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        minutes = (time.perf_counter() - started) / 60
        if partial:
            results, unavailable = merge_rerun(results, unavailable, new, new_unavailable, date)
            meta["updates"] = [*meta.get("updates", []), {
                "date": date, "minutes": minutes, "experiments": sorted(new),
                "recipes": sorted(recipes) if recipes else "all",
            }]
            save(artifacts, meta, unavailable, {key: results[key] for key in new})
        else:
            results, unavailable = new, new_unavailable
            meta = _meta(date, minutes, model_name, devices, threads, compile, quick)
            save(artifacts, meta, unavailable, results)
    verdicts = [(claim, claim.judge(results, unavailable)) for claim in CLAIMS]
    plots = _plots(results, artifacts, os.path.relpath(artifacts, doc.parent))
    # per-head needle dumps written beside the artifacts by research/scripts/results.sh (python -m research.needles)
    needles = [json.loads(p.read_text()) for p in sorted((artifacts / "needles").glob("*/needles.json"))]
    text = render(results, unavailable, verdicts, meta, plots, needles)
    doc.write_text(text)
    (artifacts / "verdicts.json").write_text(json.dumps(
        {str(c.number): {"status": v.status, "summary": v.summary, "details": v.details} for c, v in verdicts},
        indent=1))
    how = "rendered from saved results" if render_only else f"{(time.perf_counter() - started) / 60:.1f} min"
    print(f"[claims] wrote {doc} and {artifacts}/ ({how})")
    for claim, verdict in verdicts:
        print(f"  claim {claim.number}: {verdict.status} -- {verdict.summary}")
    return text


def _meta(date: str, minutes: float, model_name: str, devices: int, threads: int | None, compile: bool,
          quick: bool) -> dict:
    """What the report says about a full run: when, how long, on what, with which model."""
    return {
        "date": date,
        "minutes": minutes,
        "cpu": _cpu(),
        "devices": devices,
        "threads": threads,
        "compile": compile,
        "quick": quick,
        "model_short": "SmolLM2-135M" if model_name == "default" else model_name,
        "model": "SmolLM2-135M-Instruct, the embedded GGUF (`evictlayers.models.load_default`)"
        if model_name == "default" else model_name,
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _plots(results: dict, artifacts: Path, rel: str) -> dict[str, str]:
    """Draw each experiment's plots into ``artifacts``; caption -> path relative to the report (``rel``:
    ``artifacts`` seen from the report's folder)."""
    plots = {}
    for key, result in results.items():
        if len(result["budgets"] or []) > 1:
            path = plot_score_vs_budget(result, artifacts / f"{key}_score_vs_budget.png",
                                        title=f"{key}: {result['score_name']} vs KV budget")
            if path is not None:
                caption = f"{key}: {result['score_name']} vs budget (full cache dashed), as H2O Fig. 4"
                plots[caption] = f"{rel}/{path.name}"
        path = plot_positions(result, artifacts / f"{key}_positions.png", budget=0.2,
                              title=f"{key}: which original positions are kept at 20%")
        if path is not None:
            caption = f"{key}: retained original positions at 20%, all layers and heads (AhaKV Fig. 2c)"
            plots[caption] = f"{rel}/{path.name}"
    return plots
