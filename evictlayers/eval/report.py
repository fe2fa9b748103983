"""Results on disk: JSON, a markdown table, and plots (score vs budget per policy, as H2O Fig. 4;
retained-position histograms, as AhaKV Fig. 2(c); for RULER, score vs compression ratio,
:mod:`evictlayers.eval.ruler_report`). Plots need matplotlib (``pip install
evictlayers[eval]``); without it the plot functions return ``None`` and the rest is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from evictlayers.eval import ruler_report
from evictlayers.eval.report_common import budget_text, chunked_prefill, prefill_text, pyplot

__all__ = [
    "format_score",
    "markdown_table",
    "plot_positions",
    "plot_score_vs_budget",
    "write_results",
]


def format_score(value: float, score_name: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if score_name == "perplexity":
        return f"{value:.2f}"
    return f"{value:.3f}"


def markdown_table(result: dict) -> str:
    """One row per policy x budget: score, task extras, memory kept, throughput, and how the prompts were fed
    where they went in chunks (RULER: one column per task, :func:`evictlayers.eval.ruler_report.markdown_table`)."""
    task, score_name = result["task"], result["score_name"]
    if task == "ruler":
        return ruler_report.markdown_table(result)
    extra: list[tuple[str, str]] = []
    if task == "agreement":
        extra = [("KL (nats)", "kl"), ("perplexity", "perplexity")]
    elif task in ("passkey", "lines"):
        extra = [("correct", "correct")]
    prefill = chunked_prefill(result)
    header = ["policy", "budget", *(["prefill"] if prefill else []), score_name, *[name for name, _ in extra],
              "KV kept", "KV MiB / seq", "tokens/s", "evenness"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in result["runs"]:
        cells = [run["policy"], budget_text(run), *([prefill_text(run)] if prefill else []),
                 format_score(run["score"], score_name)]
        for _, key in extra:
            value = run.get(key)
            if key == "correct":
                cells.append(f"{value}/{run['n']}")
            elif key == "kl":
                cells.append(f"{max(value, 0.0):.4f}")  # float noise can make a zero KL slightly negative
            else:
                cells.append(format_score(value, key))
        cells += [
            f"{run['kept_fraction']:.1%}",
            f"{run['kv_bytes'] / 2**20:.2f}",
            f"{run['tokens_per_s']:.1f}",
            f"{run['evenness']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_score_vs_budget(result: dict, path: str | Path, title: str | None = None) -> Path | None:
    """Score against KV budget, one line per policy, the full cache as a dashed line (H2O Fig. 4).

    The x axis is the nominal budget when every budget is a fraction, else the measured fraction of
    KV slots kept. Returns the path, or ``None`` when matplotlib is missing.
    """
    plt = pyplot()
    if plt is None:
        return None
    runs = result["runs"]
    budgets = [r["budget"] for r in runs if not r["full_cache"]]
    nominal = bool(budgets) and all(isinstance(b, float) for b in budgets)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    policies: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        if run["full_cache"]:
            ax.axhline(run["score"], color="black", linestyle="--", linewidth=1, label=f"{run['policy']} (full cache)")
            continue
        x = run["budget"] if nominal else run["kept_fraction"]
        policies.setdefault(run["policy"], []).append((x, run["score"]))
    markers, styles = "osD^vP*X", ["-", "--", "-.", ":"]
    span = max((p[0] for pts in policies.values() for p in pts), default=1) - min(
        (p[0] for pts in policies.values() for p in pts), default=0)
    for i, (name, points) in enumerate(policies.items()):
        points.sort()
        # a small horizontal offset per policy keeps equal scores at equal budgets from hiding each other
        shift = (i - (len(policies) - 1) / 2) * 0.008 * (span or 1)
        ax.plot([p[0] + shift for p in points], [p[1] for p in points], marker=markers[i % len(markers)],
                linestyle=styles[i % len(styles)], label=name, alpha=0.85)
    ax.set_xlabel("KV budget (fraction of the prompt)" if nominal else "fraction of KV slots kept")
    ax.set_ylabel(result["score_name"])
    ax.set_title(title or f"{result['task']}: {result['score_name']} vs KV budget")
    if result["score_name"] == "perplexity":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(plt, fig, path)


def plot_positions(
    result: dict, path: str | Path, budget: int | float | None = None, title: str | None = None,
    policies: Sequence[str] | None = None,
) -> Path | None:
    """Share of retained KV slots per relative-position bin, one line per policy, at ``budget``
    (default: the first budget of the run). Returns the path, or ``None`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    runs = [r for r in result["runs"] if policies is None or r["policy"] in policies]
    budgets = [r["budget"] for r in runs if not r["full_cache"]]
    if budget is None and budgets:
        budget = budgets[0]
    chosen = [r for r in runs if r["full_cache"] or r["budget"] == budget]
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in chosen:
        counts = run["histogram"]
        total = sum(counts) or 1
        n_bins = len(counts)
        centres = [(i + 0.5) / n_bins for i in range(n_bins)]
        style = {"color": "black", "linestyle": "--", "linewidth": 1} if run["full_cache"] else {"marker": "."}
        ax.plot(centres, [c / total for c in counts], label=f"{run['policy']} (evenness {run['evenness']:.2f})",
                **style)
    ax.set_xlabel("original position / tokens seen")
    ax.set_ylabel("share of retained KV slots")
    where = "full cache only" if budget is None else f"budget {budget:.0%}" if isinstance(budget, float) else f"budget {budget} tokens"
    ax.set_title(title or f"{result['task']}: retained positions ({where})")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``<task>.json``, ``<task>.md`` and the plots into ``out_dir``; returns what was written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = result["task"]
    written = {"json": out / f"{task}.json", "markdown": out / f"{task}.md"}
    written["json"].write_text(json.dumps(result, indent=1, default=str))
    settings = ", ".join(f"{k}={v}" for k, v in result["settings"].items())
    table = markdown_table(result)
    if task == "ruler":
        note = ("Scores: RULER's string match (share of the reference answers found in the output), 0-100. "
                "KV kept: share of the KV slots a full cache would hold at the end of each example.\n")
    else:
        note = ("KV kept: share of the KV slots a full cache would hold at the end of each example; "
                "evenness: normalised entropy of the retained-position histogram (1 = uniform).\n")
    written["markdown"].write_text(
        f"# {task} on {result['model'] or 'the model'}\n\n"
        f"{result['n_examples']} examples; {settings}; seed {result['seed']}; "
        f"{result['devices']} process(es); {result['wall_seconds']:.0f} s.\n\n"
        f"{table}\n\n{note}"
    )
    if task == "ruler":
        score = ruler_report.plot_ruler([result], out / "ruler_score_vs_compression.png")
    else:
        score = plot_score_vs_budget(result, out / f"{task}_score_vs_budget.png")
    if score is not None:
        written["score_plot"] = score
        written["positions_plot"] = plot_positions(result, out / f"{task}_positions.png")
    return written
