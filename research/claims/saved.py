"""The artifacts of a run on disk (``<key>.json`` per experiment, ``run.json`` with the run's meta and
what was not run), and merging a partial re-run into them."""

from __future__ import annotations

import json
from pathlib import Path

from research.claims.experiments import EXPERIMENTS


def load_saved(artifacts: Path) -> tuple[dict, dict, dict]:
    """``(meta, unavailable, results by key)`` of an earlier run in ``artifacts``."""
    run_file = artifacts / "run.json"
    if not run_file.is_file():
        raise FileNotFoundError(f"{run_file} not found: --render-only and --only need the artifacts of an earlier run")
    saved = json.loads(run_file.read_text())
    results = {e.key: json.loads((artifacts / f"{e.key}.json").read_text()) for e in EXPERIMENTS
               if (artifacts / f"{e.key}.json").is_file()}
    return saved["meta"], saved["unavailable"], results


def save(artifacts: Path, meta: dict, unavailable: dict, results: dict) -> None:
    """Write ``results`` (only these experiments' files) and ``run.json`` into ``artifacts``."""
    for key, result in results.items():
        (artifacts / f"{key}.json").write_text(json.dumps(result, indent=1, default=str))
    (artifacts / "run.json").write_text(json.dumps({"meta": meta, "unavailable": unavailable}, indent=1))


def merge_runs(old: dict | None, new: dict, date: str) -> dict:
    """``new`` runs replace ``old`` runs of the same label; the rest of ``old`` stays (with its settings,
    which must match). The merged result records which labels were measured when (``measured``)."""
    if old is None:
        return {**new, "measured": [{"date": date, "labels": [r["label"] for r in new["runs"]]}]}
    if old["settings"] != new["settings"]:
        raise ValueError(f"cannot merge runs of {new['task']} with different settings: "
                         f"{old['settings']} vs {new['settings']}")
    labels = {r["label"] for r in new["runs"]}
    runs = [r for r in old["runs"] if r["label"] not in labels] + new["runs"]
    measured = old.get("measured", [{"date": "earlier", "labels": [r["label"] for r in old["runs"]]}])
    budgets = sorted({*(old["budgets"] or []), *(new["budgets"] or [])})
    return {**old, "runs": runs, "budgets": budgets,
            "measured": [*measured, {"date": date, "labels": sorted(labels)}]}


def merge_rerun(results: dict, unavailable: dict, new: dict, new_unavailable: dict, date: str) -> tuple[dict, dict]:
    """``(results, unavailable)`` after a partial re-run: each experiment of ``new`` merged into the saved
    one (:func:`merge_runs`); a recipe counts as unavailable unless some experiment now has a run of it."""
    results = {**results, **{key: merge_runs(results.get(key), result, date) for key, result in new.items()}}
    unavailable = {**unavailable, **new_unavailable}
    ran = {run["policy"] for result in results.values() for run in result["runs"]}
    return results, {name: reason for name, reason in unavailable.items() if name not in ran}
