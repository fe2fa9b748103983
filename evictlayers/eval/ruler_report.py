"""RULER results on disk: a markdown table (one row per recipe, budget, setting and length; one column
per task) and the plot KV-compression work shows for RULER (kvpress's leaderboard): score against
compression ratio, one line per recipe, one panel per model and task group.

The compression ratio is the share of the KV cache removed: ``1 - budget`` for fractional budgets,
``1 - kept fraction`` (measured) for token budgets, 0 for the full cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from evictlayers.eval.report_common import budget_text, chunked_prefill, prefill_text, pyplot
from evictlayers.eval.tasks.ruler import GROUPS, TASKS

__all__ = ["compression_ratio", "markdown_table", "plot_ruler", "score_of"]

SHORT = {"query_aware": "aware", "query_agnostic": "agnostic"}


def compression_ratio(run: dict) -> float:
    if run["full_cache"] or run["budget"] is None:
        return 0.0
    if isinstance(run["budget"], float):
        return 1.0 - run["budget"]
    return 1.0 - run["kept_fraction"]


def score_of(run: dict, setting: str, tasks: Sequence[str] | None = None) -> float | None:
    """Mean RULER score of ``run`` in ``setting`` over ``tasks`` (all by default) and every length;
    ``None`` when the run has none of them."""
    values = [v for by_task in run["scores"].get(setting, {}).values() for t, v in by_task.items()
              if tasks is None or t in tasks]
    return sum(values) / len(values) if values else None


def markdown_table(result: dict) -> str:
    """RULER's task scores (0-100) per recipe, budget, setting and length, with their average (and how the
    prompts were fed, where they went in chunks)."""
    tasks = [t for t in TASKS if t in result["settings"]["tasks"]]
    prefill = chunked_prefill(result)
    header = ["policy", "budget", *(["prefill"] if prefill else []), "setting", "length", *tasks, "average",
              "KV kept", "tokens/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in result["runs"]:
        for setting, by_length in run["scores"].items():
            memory = run.get("memory_by_setting", {}).get(setting, run)
            for length, by_task in by_length.items():
                cells = [run["policy"], budget_text(run), *([prefill_text(run)] if prefill else []), SHORT[setting],
                         length]
                cells += [f"{by_task[t]:.1f}" if t in by_task else "-" for t in tasks]
                cells += [f"{sum(by_task.values()) / len(by_task):.1f}", f"{memory['kept_fraction']:.1%}",
                          f"{memory['tokens_per_s']:.1f}"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_ruler(results: Sequence[dict], path: str | Path, title: str | None = None) -> Path | None:
    """Score against compression ratio: one row of panels per model (each result is one model's run),
    one column for the average and one per RULER task group present; one line per recipe (solid, filled
    circles: query-aware; dashed, open squares: query-agnostic), the full cache as a black horizontal line. Returns the path,
    or ``None`` when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    present = {t for r in results for t in r["settings"]["tasks"]}
    panels = [("average", None)] + [(g, names) for g, names in GROUPS.items() if present & set(names)]
    fig, axes = plt.subplots(len(results), len(panels), figsize=(3.6 * len(panels), 3.0 * len(results)),
                             squeeze=False, sharey=True)
    styles = {"query_aware": "-", "query_agnostic": "--"}
    markers = {"query_aware": {"marker": "o"}, "query_agnostic": {"marker": "s", "fillstyle": "none"}}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    policies = list(dict.fromkeys(r["policy"] for result in results for r in result["runs"] if not r["full_cache"]))
    for row, result in enumerate(results):
        for col, (group, names) in enumerate(panels):
            ax = axes[row][col]
            for setting in result["settings"]["setting"]:
                for run in result["runs"]:
                    if run["full_cache"]:
                        value = score_of(run, setting, names)
                        if value is not None:
                            ax.axhline(value, color="black", linestyle=styles[setting], linewidth=1,
                                       label=f"{run['policy']} ({SHORT[setting]})")
                for policy in policies:
                    points = sorted((compression_ratio(r), score_of(r, setting, names)) for r in result["runs"]
                                    if r["policy"] == policy and not r["full_cache"])
                    points = [p for p in points if p[1] is not None]
                    if points:
                        ax.plot([x for x, _ in points], [y for _, y in points], linestyle=styles[setting],
                                color=colors[policies.index(policy) % len(colors)], **markers[setting],
                                label=f"{policy} ({SHORT[setting]})")
            ax.set_title(f"{result.get('model') or 'model'}: {group}", fontsize=9)
            ax.set_xlim(-0.02, 1.0)
            ax.grid(alpha=0.3)
            if row == len(results) - 1:
                ax.set_xlabel("compression ratio (share of KV removed)")
            if col == 0:
                ax.set_ylabel("RULER score")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    fig.suptitle(title or "RULER score vs compression ratio", fontsize=10)
    fig.tight_layout()
    # beside the panels, not over them; the saved image is widened to hold it
    fig.legend([handles[lab] for lab in labels], labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
