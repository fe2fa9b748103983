"""The needle heat map of RULER's single-needle tasks (``evictlayers eval ... --task ruler --ruler-depths``):
the score of each cell of a depth x context-length grid, the depth being where in the haystack the needle
sits (0% = before all of it, 100% = after all of it).

Each cell is RULER's score (0-100, the share of prompts whose answer holds the needle's value) over the
cell's prompts, ``--ruler-samples`` per task; with several single-needle tasks it is the mean of their
scores. One map per run (recipe, budget) and setting: a markdown table (rows: depth, columns: length)
and a heat map image. :func:`needle_map_tables` and :func:`plot_needle_map` take several runs' results
(``ruler.json`` read back), :func:`write_needle_map` writes both beside ``ruler.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from evictlayers.eval.report_common import budget_text, prefill_text, pyplot

__all__ = ["MARKDOWN", "PLOT", "map_cells", "needle_map_tables", "plot_needle_map", "write_needle_map"]

MARKDOWN, PLOT = "ruler_needle_map.md", "ruler_needle_map.png"
SHORT = {"query_aware": "query-aware", "query_agnostic": "query-agnostic"}
# the colours of the usual needle-in-a-haystack heat map: red (missed) through yellow to green (found)
COLOURS = ("#F0496E", "#EBB839", "#0CD79F")


def _results(results: dict | Sequence[dict]) -> list[dict]:
    return [results] if isinstance(results, dict) else list(results)


def map_cells(run: dict) -> dict[str, dict[int, dict[int, dict]]]:
    """``{setting: {depth: {length: {"score", "n", "by_task"}}}}`` of one run (an entry of a result's
    ``runs``), depths and lengths as ints, ascending; ``{}`` for a run without depths. Read from the run's
    ``needle_map``, or worked out from its ``examples`` where an older summary has none."""
    cells = run.get("needle_map")
    if cells is None:
        examples = [e for e in run.get("examples", ()) if e.get("depth") is not None]
        if not examples:
            return {}
        from evictlayers.eval.ruler_run import summarize_ruler

        cells = summarize_ruler(examples)["needle_map"]
    return {setting: {int(d): {int(n): cell for n, cell in sorted(by_len.items(), key=lambda kv: int(kv[0]))}
                      for d, by_len in sorted(by_depth.items(), key=lambda kv: int(kv[0]))}
            for setting, by_depth in cells.items()}


def _maps(results: dict | Sequence[dict]):
    """``(result, run, setting, {depth: {length: cell}})`` for every map in ``results``."""
    for result in _results(results):
        for run in result["runs"]:
            for setting, grid in map_cells(run).items():
                yield result, run, setting, grid


def _title(result: dict, run: dict, setting: str, sep: str = ", ") -> str:
    budget = "full cache" if budget_text(run) == "full" else f"budget {budget_text(run)}"
    chunk = f", {prefill_text(run)}" if run.get("prefill_chunk") is not None else ""
    return f"{result.get('model') or 'model'}: {run['policy']}{sep}{budget}{chunk}, {SHORT[setting]}"


def _table(grid: dict[int, dict[int, dict]]) -> tuple[str, str]:
    """(the markdown table, a line saying how many prompts each cell holds)."""
    lengths = sorted({n for by_len in grid.values() for n in by_len})
    counts = {cell["n"] for by_len in grid.values() for cell in by_len.values()}
    same = len(counts) == 1

    def text(cell):
        if cell is None:
            return "-"
        return f"{cell['score']:.1f}" if same else f"{cell['score']:.1f} ({cell['n']})"

    lines = ["| depth \\ length | " + " | ".join(str(n) for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
    for depth, by_len in grid.items():
        lines.append(f"| {depth}% | " + " | ".join(text(by_len.get(n)) for n in lengths) + " |")
    tasks = sorted({t for by_len in grid.values() for cell in by_len.values() for t in cell["by_task"]})
    what = f"task {tasks[0]}" if len(tasks) == 1 else f"the mean of tasks {', '.join(tasks)}"
    count = f"{counts.pop()} prompt(s) per cell" if same else "the prompts per cell in brackets"
    return "\n".join(lines), f"RULER score (0-100) of {what}; {count}."


def needle_map_tables(results: dict | Sequence[dict]) -> str:
    """One markdown table per model, recipe, budget and setting of ``results`` (one result, or several
    runs' results): rows = needle depth (%), columns = context length (tokens), cell = RULER score."""
    parts = []
    for result, run, setting, grid in _maps(results):
        table, note = _table(grid)
        parts.append(f"### {_title(result, run, setting)}\n\n{note}\n\n{table}")
    return "\n\n".join(parts)


def plot_needle_map(results: dict | Sequence[dict], path: str | Path, title: str | None = None) -> Path | None:
    """The heat maps of ``results``: one panel per model, recipe, budget and setting, depth down (0% at the
    top), length across, each cell coloured by its score (red 0 to green 100) and labelled with it.
    Returns the path, or ``None`` when matplotlib is missing or there is no map."""
    plt = pyplot()
    maps = list(_maps(results))
    if plt is None or not maps:
        return None
    from matplotlib.colors import LinearSegmentedColormap

    colours = LinearSegmentedColormap.from_list("needle", COLOURS)
    columns = min(len(maps), 3)
    rows = -(-len(maps) // columns)
    depths_max = max(len(grid) for *_, grid in maps)
    lengths_max = max(len({n for by_len in grid.values() for n in by_len}) for *_, grid in maps)
    width, height = max(3.4, 1.6 + 0.75 * lengths_max), 1.4 + 0.32 * depths_max
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False)
    image = None
    for ax, (result, run, setting, grid) in zip(axes.flat, maps):
        depths = list(grid)
        lengths = sorted({n for by_len in grid.values() for n in by_len})
        values = [[grid[d][n]["score"] if n in grid[d] else float("nan") for n in lengths] for d in depths]
        image = ax.imshow(values, cmap=colours, vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                if value == value:
                    ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=8)
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
        ax.set_title(_title(result, run, setting, sep="\n"), fontsize=8)
    for ax in list(axes.flat)[len(maps):]:
        ax.axis("off")
    fig.suptitle(title or "RULER needle heat map (score 0-100)", fontsize=10)
    fig.tight_layout()
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="RULER score")
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_needle_map(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """``ruler_needle_map.md`` and ``ruler_needle_map.png`` (without matplotlib: the table only) in
    ``out_dir`` when ``result`` is a RULER run with needle depths; ``{}`` otherwise. Returns what was
    written."""
    if result.get("task") != "ruler" or not result["settings"].get("depths"):
        return {}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = result["settings"]
    written = {"needle_map": out / MARKDOWN}
    split = f", {settings['split']} split" if settings.get("split") else ""
    written["needle_map"].write_text(
        f"# RULER needle heat map on {result.get('model') or 'the model'}\n\n"
        f"Tasks {', '.join(settings['tasks'])}; depths {', '.join(f'{d}%' for d in settings['depths'])} "
        f"(where the needle sits in the haystack: 0% before all of it, 100% after all of it); lengths "
        f"{', '.join(str(n) for n in settings['lengths'])} tokens (generation included); seed {settings['seed']}"
        f"{split}.\n\n{needle_map_tables(result)}\n"
    )
    plot = plot_needle_map(result, out / PLOT)
    if plot is not None:
        written["needle_map_plot"] = plot
    return written
