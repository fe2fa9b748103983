"""The ``retrieval`` section of research/reports/results.md: every shipped recipe on passkey (filler and
prose haystacks) and lines at 10%, 20% and 50%, beside its streamed perplexity, with the best recipe per
task and budget and the target check, all computed from the saved runs."""

from __future__ import annotations

from typing import Sequence

from research.passkey_needles import summary_lines

TASKS = (("retrieval_filler", "passkey, filler"), ("retrieval_prose", "passkey, prose"), ("retrieval_lines", "lines"))
PPL_TARGET = 0.05  # streamed perplexity at 20% within 5% of the full cache
LINES_TARGET = 1  # lines at 50% within one record of the full cache


def _runs(results: dict, key: str) -> list[dict]:
    return results.get(key, {}).get("runs", [])


def _find(results: dict, key: str, policy: str, budget: float | None) -> dict | None:
    """A recipe's run at ``budget``; the full cache's single run stands for every budget."""
    for run in _runs(results, key):
        if run["policy"] == policy and (run["full_cache"] or run["budget"] == budget):
            return run
    return None


def _names(results: dict) -> list[str]:
    names: list[str] = []
    for key, _ in TASKS:
        for run in _runs(results, key):
            if run["policy"] not in names:
                names.append(run["policy"])
    return names


def _budgets(results: dict) -> list[float]:
    return sorted({b for key, _ in TASKS for b in (results.get(key, {}).get("budgets") or []) if b is not None})


def _stream_gap(results: dict, policy: str) -> float | None:
    """Streamed perplexity at 20% relative to the full cache's (``None``: not in the stream experiment)."""
    runs = _runs(results, "stream")
    full = next((r for r in runs if r["full_cache"]), None)
    run = next((r for r in runs if r["policy"] == policy and r["budget"] == 0.2), None)
    if full is None or run is None:
        return None
    return run["perplexity"] / full["perplexity"] - 1.0


def best_per_task(results: dict) -> list[str]:
    """One line per task and budget naming the evicting recipe(s) with the most correct answers, and the
    recipe(s) with the lowest streamed perplexity at 20%."""
    lines = []
    for key, title in TASKS:
        for budget in _budgets(results):
            scored = [(r["correct"], r["policy"]) for r in _runs(results, key) if not r["full_cache"] and r["budget"] == budget]
            if not scored:
                continue
            top = max(c for c, _ in scored)
            full = _find(results, key, "full", None)
            n = next(r["n"] for r in _runs(results, key) if not r["full_cache"])
            names = ", ".join(f"`{p}`" for c, p in scored if c == top)
            ref = f"; full cache {full['correct']}/{full['n']}" if full else ""
            lines.append(f"- {title} at {budget:.0%}: {names} ({top}/{n}{ref})")
    stream = [r for r in _runs(results, "stream") if not r["full_cache"] and r["budget"] == 0.2]
    if stream:
        low = min(r["perplexity"] for r in stream)
        names = ", ".join(f"`{r['policy']}`" for r in stream if r["perplexity"] == low)
        gap = _stream_gap(results, next(r["policy"] for r in stream if r["perplexity"] == low))
        lines.append(f"- language modelling (streamed perplexity at 20%): {names} ({low:.2f}, {gap:+.1%} vs full)")
    return lines


def target_check(results: dict) -> tuple[list[str], list[str]]:
    """``(recipes meeting the retrieval target, one line per recipe that meets the passkey part)``: >= 7/8
    passkey at 20% on both haystacks, lines at 50% within one record of the full cache, streamed
    perplexity at 20% within 5% of the full cache's."""
    met, notes = [], []
    full_lines = _find(results, "retrieval_lines", "full", None)
    for name in _names(results):
        if name == "full":
            continue
        filler, prose = (_find(results, key, name, 0.2) for key in ("retrieval_filler", "retrieval_prose"))
        if filler is None or prose is None:
            continue
        passkey_ok = all(r["correct"] >= 7 * r["n"] / 8 for r in (filler, prose))
        if not passkey_ok:
            continue
        lines = _find(results, "retrieval_lines", name, 0.5)
        lines_ok = lines is not None and full_lines is not None and full_lines["correct"] - lines["correct"] <= LINES_TARGET
        gap = _stream_gap(results, name)
        ppl_ok = gap is not None and gap <= PPL_TARGET
        parts = [
            f"passkey 20% filler {filler['correct']}/{filler['n']}, prose {prose['correct']}/{prose['n']}",
            f"lines 50% {lines['correct']}/{lines['n']} vs full {full_lines['correct']}/{full_lines['n']}"
            if lines and full_lines else "lines 50% not measured",
            f"streamed perplexity {gap:+.1%} vs full" if gap is not None else "streamed perplexity not measured",
        ]
        verdict = "meets the target" if passkey_ok and lines_ok and ppl_ok else "misses the target"
        notes.append(f"- `{name}`: {'; '.join(parts)}: {verdict}")
        if passkey_ok and lines_ok and ppl_ok:
            met.append(name)
    return met, notes


def best_passkey(results: dict) -> str:
    """The recipe(s) with the most passkey answers at 20% over both haystacks, with their numbers."""
    totals = {}
    for name in _names(results):
        runs = [_find(results, key, name, 0.2) for key in ("retrieval_filler", "retrieval_prose")]
        if name != "full" and all(runs):
            totals[name] = (sum(r["correct"] for r in runs), runs)
    if not totals:
        return "no recipe ran on both haystacks at 20%"
    top = max(total for total, _ in totals.values())
    full = [_find(results, key, "full", None) for key in ("retrieval_filler", "retrieval_prose")]
    parts = [f"`{name}` (filler {runs[0]['correct']}/{runs[0]['n']}, prose {runs[1]['correct']}/{runs[1]['n']})"
             for name, (total, runs) in totals.items() if total == top]
    reference = f"; full cache {full[0]['correct']}/{full[0]['n']} and {full[1]['correct']}/{full[1]['n']}" if all(full) else ""
    return f"the best at 20% over both: {', '.join(parts)}{reference}"


def _cell(run: dict | None) -> str:
    return f"{run['correct']}/{run['n']}" if run else "-"


def retrieval_section(results: dict, needles: Sequence[dict] = ()) -> list[str]:
    """The markdown lines of the section (empty when the retrieval experiments were not run), ending
    with the per-head needle dumps (``python -m research.needles`` payloads) when there are any."""
    if not any(key in results for key, _ in TASKS):
        return []
    budgets = _budgets(results)
    head = ["recipe"] + [f"{title} {b:.0%}" for _, title in TASKS for b in budgets] + ["streamed ppl 20% vs full"]
    out = ["## Retrieval under a budget", "",
           "The same question on RULER's synthetic tasks, on SmolLM2 and Gemma 3 270M, with recipes chosen on a "
           "tuning split and reported on held-out books, seeds and haystack families: [retrieval.md](retrieval.md).", ""]
    settings = {key: results[key]["settings"] for key, _ in TASKS if key in results}
    if "retrieval_filler" in settings:
        s = settings["retrieval_filler"]
        out.append(f"Passkey: {len(s['depths'])} prompts of ~{s['lengths'][0]} tokens per haystack, key at evenly "
                   "spread depths, the same prompts for every recipe. *Filler*: repeated sentences, raw text. "
                   "*Prose*: consecutive sentences of the PG-19 sample books, chat format (the full cache finds "
                   "more prose keys in the chat format; see `evictlayers/eval/tasks/passkey.py`). *Lines*: "
                   "LongEval-style records. Every shipped recipe (`evictlayers/recipes/*.yaml`) at each budget; the full cache once.")
        out.append("")
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in _names(results):
        cells = [name] + [_cell(_find(results, key, name, b)) for key, _ in TASKS for b in budgets]
        gap = None if name == "full" else _stream_gap(results, name)
        in_stream = any(r["full_cache"] for r in _runs(results, "stream"))
        cells.append(("reference" if in_stream else "-") if name == "full" else "-" if gap is None else f"{gap:+.1%}")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Best recipe per task and budget (most correct answers; ties named):", "", *best_per_task(results), ""]
    met, notes = target_check(results)
    out.append("Target: >= 7/8 passkey at 20% on both haystacks, lines at 50% within 1/16 of the full "
               "cache, streamed perplexity at 20% within 5% of full. "
               + (f"Met by {', '.join(f'`{m}`' for m in met)}." if met else "No recipe meets all three."))
    out += ["", *(notes or ["- no recipe reaches 7/8 passkey at 20% on both haystacks; " + best_passkey(results)]), ""]
    for key, title in TASKS[:2]:
        runs = [r for r in _runs(results, key) if r["full_cache"] or r["budget"] == 0.2]
        if not runs:
            continue
        depths = list(runs[0]["by_depth"])
        out += [f"Per depth, {title} at 20% (1 = key found):", "",
                "| recipe | " + " | ".join(depths) + " |", "|---|" + "---|" * len(depths)]
        for run in runs:
            out.append(f"| {run['policy']} | " + " | ".join(f"{run['by_depth'][d]:.0f}" for d in depths) + " |")
        out.append("")
    for payload in needles:
        out += summary_lines(payload, heading="###")
    return out
