"""The retrieval report of the tuning / held-out protocol (:mod:`evictlayers.eval.protocol`): RULER scores
on the tuning split beside the held-out split, per model, recipe and budget; the best recipe per held-out
task and budget, named from the held-out split only; the bounds check; and every configuration tried;
one such section per RULER setting (query-aware, query-agnostic) the runs scored.

Input: the ``ruler.json`` files of ``evictlayers eval --task ruler --split tuning|held_out`` runs
(several per split are merged: one may hold 1k prompts, another 2k), and optionally ``perplexity.json``
files of ``evictlayers eval --task perplexity --split ...``: streamed perplexity on the held-out books for
the perplexity bound, on the tuning books beside it. Each file names its model; a model's
tuning and held-out runs are matched by that name.

Scores compare like with like: a recipe's family score and the full cache's are means over the same
(task, length) cells, so a recipe run at fewer lengths is compared on those lengths only.

The bounds check, at :data:`CHECKED_BUDGET` (20%): a recipe is within the bounds when, on every model, its
worst held-out family is at most :data:`FAMILY_GAP_BOUND` points below the full cache's score on that
family (one prompt in eight) and its streamed perplexity at most :data:`PERPLEXITY_GAP_BOUND` above the
full cache's. The report lists every recipe run there with both gaps per model and says whether it is
within the bounds.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from evictlayers.eval.protocol import FAMILIES, SPLITS, family_of
from evictlayers.eval.report_common import budget_text
from evictlayers.eval.ruler_run import SETTINGS

__all__ = ["CHECKED_BUDGET", "FAMILY_GAP_BOUND", "PERPLEXITY_GAP_BOUND", "held_out_results", "load", "merge",
           "settings_of", "transfer_report", "transfer_section"]

#: the largest worst-family gap to the full cache within the bounds, in RULER's 0-100 points: one prompt in eight
FAMILY_GAP_BOUND = 12.5
#: the largest streamed perplexity over the full cache's, minus 1, within the bounds
PERPLEXITY_GAP_BOUND = 0.05
#: the budget the bounds are checked at
CHECKED_BUDGET = 0.2


def load(paths: Iterable[str | Path]) -> list[dict]:
    """The results at ``paths`` (a JSON file, or a directory holding ``ruler.json`` / ``perplexity.json``).

    Raises:
        FileNotFoundError: a path holds no result.
    """
    out = []
    for path in map(Path, paths):
        files = [path] if path.is_file() else [p for p in (path / "ruler.json", path / "perplexity.json") if p.is_file()]
        if not files:
            raise FileNotFoundError(f"{path}: no ruler.json or perplexity.json (write one with `evictlayers eval`)")
        out += [json.loads(f.read_text()) for f in files]
    return out


def _key(run: dict) -> str:
    return "full" if run["full_cache"] else f"{run['policy']}@{budget_text(run)}"


def merge(results: Sequence[dict]) -> dict:
    """``{model: {"tuning" | "held_out": {label: run}, "perplexity" | "perplexity_tuning": {label: run}}}``
    (streamed perplexity on the held-out / tuning split's books); a RULER run's
    ``scores[setting][length][task]`` cells are merged over the files (a later file wins a cell both hold).

    Raises:
        ValueError: a result without a split (run with ``--split``).
    """
    merged: dict = defaultdict(
        lambda: {"tuning": {}, "held_out": {}, "perplexity": {}, "perplexity_tuning": {}, "runs_with": set()}
    )
    for result in results:
        model = result.get("model") or "model"
        split = result["settings"].get("split")
        if split not in SPLITS:
            raise ValueError(f"a {result['task']} result of {model} has no split (split={split!r}); run it with "
                             f"--split {' or '.join(SPLITS)}")
        if result["task"] == "perplexity":
            for run in result["runs"]:
                merged[model]["perplexity" if split == "held_out" else "perplexity_tuning"][_key(run)] = run
            continue
        settings = result["settings"]
        generated = settings.get("max_new_tokens") or "RULER's per-task number of"
        template = "chat template" if settings.get("chat") else "plain text"
        merged[model]["runs_with"].add(
            f"{settings.get('samples', '?')} prompts per task and length, up to {generated} new tokens, {template}")
        for run in result["runs"]:
            slot = merged[model][split].setdefault(_key(run), {**run, "scores": {}})
            for setting, by_length in run["scores"].items():
                for length, by_task in by_length.items():
                    slot["scores"].setdefault(setting, {}).setdefault(length, {}).update(by_task)
    return dict(merged)


def _cells(run: dict, setting: str) -> dict[tuple[str, str], float]:
    return {(length, task): v for length, by_task in run["scores"].get(setting, {}).items() for task, v in by_task.items()}


def family_scores(run: dict, full: dict | None, setting: str) -> dict[str, tuple[float, float | None]]:
    """``{family: (recipe's mean, full cache's mean over the same cells or None)}``."""
    mine, ref = _cells(run, setting), _cells(full, setting) if full else {}
    out = {}
    for family in FAMILIES:
        cells = [c for c in mine if family_of(c[1]) == family]
        if cells:
            shared = [c for c in cells if c in ref]
            out[family] = (sum(mine[c] for c in cells) / len(cells),
                           sum(ref[c] for c in shared) / len(shared) if shared and len(shared) == len(cells) else None)
    return out


def mean_score(run: dict | None, setting: str) -> float | None:
    cells = _cells(run, setting) if run else {}
    return sum(cells.values()) / len(cells) if cells else None


def worst_gap(run: dict, full: dict | None, setting: str) -> tuple[float, str] | None:
    """The largest ``full - recipe`` over the run's families, and that family (``None``: no reference)."""
    gaps = [(ref - mine, family) for family, (mine, ref) in family_scores(run, full, setting).items() if ref is not None]
    return max(gaps) if gaps else None


def _ppl_gap(split: dict, policy: str, budget=CHECKED_BUDGET, books: str = "perplexity") -> float | None:
    """The streamed perplexity of ``policy`` at ``budget`` over the full cache's, minus 1 (``None``: not run),
    on the held-out books (``books="perplexity"``) or the tuning ones (``"perplexity_tuning"``)."""
    runs = split.get(books, {})
    full = runs.get("full")
    run = next((r for r in runs.values() if r["policy"] == policy and r["budget"] == budget), None)
    return None if full is None or run is None else run["score"] / full["score"] - 1.0


def _by_length(run: dict | None, setting: str) -> str:
    """``1024: 34.9, 2048: 30.1``: the run's mean score at each length."""
    by_length = (run or {}).get("scores", {}).get(setting, {})
    parts = [f"{length}: {sum(v.values()) / len(v):.1f}" for length, v in sorted(by_length.items(), key=lambda kv: int(kv[0]))
             if v]
    return ", ".join(parts) or "-"


def _task_mean(run: dict | None, task: str, setting: str) -> float | None:
    values = [v for (_, t), v in _cells(run, setting).items() if t == task] if run else []
    return sum(values) / len(values) if values else None


def _display(model: str) -> str:
    """``default`` as the embedded model's name."""
    return "default (SmolLM2-135M-Instruct)" if model == "default" else model


def _chosen(tuning: dict, setting: str) -> list[str]:
    """Per budget, the evicting recipe(s) with the best tuning score, with it."""
    out = []
    for budget in _budgets(tuning):
        scored = [(mean_score(r, setting), r["policy"]) for r in tuning.values()
                  if not r["full_cache"] and r["budget"] == budget and mean_score(r, setting) is not None]
        if scored:
            top = max(v for v, _ in scored)
            names = ", ".join(f"`{p}`" for v, p in scored if v == top)
            out.append(f"{_budget_label(budget)}: {names} ({top:.1f})")
    return out


def _budget_label(budget) -> str:
    """A budgeted run's budget as the report writes it (``20%``, ``512 tok``)."""
    return budget_text({"full_cache": False, "budget": budget})


def _budget_order(budget) -> tuple:
    return (isinstance(budget, int), budget)  # fractions first, then token counts


def _budgets(runs: dict) -> list:
    return sorted({r["budget"] for r in runs.values() if not r["full_cache"]}, key=_budget_order)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _model_lines(model: str, data: dict, setting: str) -> list[str]:
    tuning, held = data["tuning"], data["held_out"]
    full_h = held.get("full")
    families = [f for f in FAMILIES if any(family_of(t) == f for r in held.values() for _, t in _cells(r, setting))]
    lengths = sorted({length for r in held.values() for length, _ in _cells(r, setting)}, key=int)
    tuning_lengths = sorted({length for r in tuning.values() for length, _ in _cells(r, setting)}, key=int)
    out = [f"### {_display(model)}", "",
           f"Runs: {'; '.join(sorted(data['runs_with'])) or '-'}. "
           f"Lengths: tuning {', '.join(tuning_lengths) or '-'}, held-out {', '.join(lengths) or '-'} tokens. Cells: "
           "RULER score (0-100), mean over tasks and lengths; `[new]`: a family the tuning split never holds.", ""]
    head = ["recipe", "budget", "tuning"] + [f"held-out {f}" + ("" if f in SPLITS["tuning"].families else " [new]")
                                             for f in families] + ["held-out mean", "held-out by length",
                                                                   "worst gap to full", "tuning ppl vs full",
                                                                   "held-out ppl vs full"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # tuning-only runs are in the appendix; rows by budget, then name
    labels = ["full"] * ("full" in held) + sorted((k for k in held if k != "full"),
                                                  key=lambda k: (_budget_order(held[k]["budget"]), held[k]["policy"]))
    for label in labels:
        t, run = tuning.get(label), held[label]
        ref = None if run["full_cache"] else full_h
        fam = family_scores(run, ref, setting)
        gap = None if run["full_cache"] else worst_gap(run, full_h, setting)
        ppl = None if run["full_cache"] else _ppl_gap(data, run["policy"], run["budget"])
        ppl_t = None if run["full_cache"] else _ppl_gap(data, run["policy"], run["budget"], "perplexity_tuning")
        cells = [run["policy"], budget_text(run), _fmt(mean_score(t, setting))]
        cells += [_fmt(fam[f][0]) if f in fam else "-" for f in families]
        cells += [_fmt(mean_score(run, setting)), _by_length(run, setting), "-" if gap is None else f"{gap[0]:+.1f} ({gap[1]})",
                  "-" if ppl_t is None else f"{ppl_t:+.1%}", "-" if ppl is None else f"{ppl:+.1%}"]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Best on the tuning split by RULER score alone (its best evicting recipe per budget; ties named): "
            + ("; ".join(_chosen(tuning, setting)) or "no evicting recipe ran on it") + ".", ""]
    budgets = _budgets(held)
    out += ["Best recipe per held-out task and budget, from held-out scores only (ties named; `all`: every "
            "evicting recipe scored the same):", "",
            "| task | full | " + " | ".join(_budget_label(b) for b in budgets) + " |",
            "|---|---|" + "---|" * len(budgets)]
    for task in [t for f in families for t in FAMILIES[f]]:
        cells = [task, _fmt(_task_mean(full_h, task, setting))]
        for budget in budgets:
            scored = [(_task_mean(r, task, setting), r["policy"]) for r in held.values()
                      if not r["full_cache"] and r["budget"] == budget and _task_mean(r, task, setting) is not None]
            if not scored:
                cells.append("-")
                continue
            top = max(v for v, _ in scored)
            best = [p for v, p in scored if v == top]
            names = "all" if len(best) == len(scored) > 1 else ", ".join(f"`{p}`" for p in best)
            cells.append(f"{names} {top:.1f}")
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def bounds_lines(merged: dict, setting: str) -> list[str]:
    """Per recipe run at :data:`CHECKED_BUDGET` on any model's held-out split: its worst family gap and
    perplexity gap per model, and whether it is within the bounds on all of them."""
    models = list(merged)
    policies = list(dict.fromkeys(r["policy"] for data in merged.values() for r in data["held_out"].values()
                                  if not r["full_cache"] and r["budget"] == CHECKED_BUDGET))
    out = []
    for policy in policies:
        parts, ok = [], True
        for model in models:
            held = merged[model]["held_out"]
            run = held.get(f"{policy}@{_budget_label(CHECKED_BUDGET)}")
            gap = worst_gap(run, held.get("full"), setting) if run else None
            ppl = _ppl_gap(merged[model], policy)
            ok &= gap is not None and gap[0] <= FAMILY_GAP_BOUND and ppl is not None and ppl <= PERPLEXITY_GAP_BOUND
            parts.append(f"{_display(model)}: worst family {'not run' if gap is None else f'{gap[0]:+.1f} ({gap[1]})'}, "
                         f"perplexity {'not measured' if ppl is None else f'{ppl:+.1%}'}")
        out.append(f"- `{policy}`: {'; '.join(parts)}: {'within' if ok else 'outside'} the bounds")
    return out


def appendix_lines(merged: dict, setting: str) -> list[str]:
    """Every configuration that ran on a tuning split, best tuning score first, with its held-out score."""
    out = ["### Every configuration tried", "",
           "Sorted by tuning score within each model and budget; the held-out columns were not used to choose.", ""]
    for model, data in merged.items():
        rows = []
        for label, run in data["tuning"].items():
            if run["full_cache"]:
                continue
            held = data["held_out"].get(label)
            gap = worst_gap(held, data["held_out"].get("full"), setting) if held else None
            rows.append((run["budget"], -(mean_score(run, setting) or 0.0), run["policy"], run, held, gap))
        if not rows:
            continue
        out += [f"{_display(model)}:", "", "| recipe | budget | tuning | held-out mean | worst held-out gap |", "|---|---|---|---|---|"]
        for _, _, policy, run, held, gap in sorted(rows, key=lambda r: (r[0], r[1], r[2])):
            out.append(f"| {policy} | {budget_text(run)} | {_fmt(mean_score(run, setting))} | "
                       f"{_fmt(mean_score(held, setting))} | {'-' if gap is None else f'{gap[0]:+.1f} ({gap[1]})'} |")
        out.append("")
    return out


def settings_of(merged: dict) -> list[str]:
    """The RULER settings (``query_aware``, ``query_agnostic``) any run of any model scored, in that order."""
    held = {setting for data in merged.values() for split in ("tuning", "held_out")
            for run in data[split].values() for setting, cells in run["scores"].items() if cells}
    return [s for s in SETTINGS if s in held]


def transfer_report(merged: dict, settings: Sequence[str] | None = None) -> list[str]:
    """The report's markdown lines: one section per setting in ``settings`` (default: every setting the
    runs hold).

    Raises:
        ValueError: a requested setting no run holds (the message names those they hold).
    """
    present = settings_of(merged)
    missing = [s for s in settings or () if s not in present]
    if missing or not present:
        raise ValueError(f"no RULER run holds the setting(s) {', '.join(missing) or 'requested'}; the runs hold: "
                         f"{', '.join(present) or 'none'} (run `evictlayers eval --task ruler --ruler-setting ...`)")
    return [line for setting in (settings or present) for line in transfer_section(merged, setting)]


def transfer_section(merged: dict, setting: str = "query_aware") -> list[str]:
    """The markdown lines of the report for ``setting``."""
    tuning, held = SPLITS["tuning"], SPLITS["held_out"]
    out = [f"## Retrieval on prompts it was not tuned on: {setting.replace('_', '-')}", "",
           f"Tuning split: families {', '.join(tuning.families)}, every other PG-19 sample book from the first, "
           f"seed {tuning.seed}. Held-out split: families {', '.join(held.families)}, the other books, seed "
           f"{held.seed}; `[new]` marks families the tuning split never holds. Setting: {setting}. "
           f"Worst gap: the largest (full cache - recipe) over the held-out families. Perplexity: streamed, "
           f"at the row's budget where it was measured, on the held-out books, against the full cache.", ""]
    # only the runs that scored this setting; a model without any keeps its place in the bounds check
    merged = {model: {**data, **{split: {k: r for k, r in data[split].items() if _cells(r, setting)}
                                 for split in ("tuning", "held_out")}}
              for model, data in merged.items()}
    for model, data in merged.items():
        if data["tuning"] or data["held_out"]:
            out += _model_lines(model, data, setting)
    checked = _budget_label(CHECKED_BUDGET)
    out += [f"Bounds at {checked}: on every model, the worst held-out family within {FAMILY_GAP_BOUND:g} points (one "
            f"prompt in eight) of the full cache and streamed perplexity within {PERPLEXITY_GAP_BOUND:.0%}:", "",
            *(bounds_lines(merged, setting) or [f"- no recipe ran at {checked}"]), ""]
    return out + appendix_lines(merged, setting)


def held_out_results(merged: dict, settings: Sequence[str] = ("query_aware",)) -> list[dict]:
    """Each model's merged held-out runs as one result (``model``, ``settings``, ``runs``), the form
    :func:`evictlayers.eval.ruler_report.plot_ruler` draws one row of panels per model from (a line per
    recipe and setting); only the recipes every model ran (the search's single-model runs would crowd the
    plot)."""
    common = set.intersection(*({r["policy"] for r in data["held_out"].values()} for data in merged.values()))
    out = []
    for model, data in merged.items():
        runs = [r for r in data["held_out"].values() if r["policy"] in common]
        tasks = sorted({t for r in runs for setting in settings for _, t in _cells(r, setting)})
        out.append({"model": model, "settings": {"tasks": tasks, "setting": list(settings)}, "runs": runs})
    return out
