"""The papers' claims, reproduced on the embedded model; writes ``docs/results.md``.

``evictlayers claims`` (what ``scripts/results.sh`` runs) evaluates every available recipe in three
experiments (:data:`EXPERIMENTS`: a streamed perplexity/agreement run on PG-19 books, passkey and
LongEval-style lines) and judges each claim of :data:`CLAIMS` from the numbers, with the criteria
written in the report. A claim whose recipes are missing (its component has not landed) is reported
as *pending* and nothing is run for it; adding the recipe file is all it takes to run it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from evictlayers.eval.metrics import histogram_evenness
from evictlayers.eval.report import markdown_table, plot_positions, plot_score_vs_budget
from evictlayers.eval.retrieval_report import retrieval_section
from evictlayers.eval.runner import PolicySpec, available_recipes, evaluate, inline_spec, recipes_dir, resolve_recipe

__all__ = ["CLAIMS", "EXPERIMENTS", "INLINE_RECIPES", "main", "render", "run_experiments"]

# ---- what runs ---------------------------------------------------------------------------------

# Recipes that are ablations rather than shipped policies: H2O Table 9's "w. H2" (heavy hitters only)
INLINE_RECIPES: dict[str, dict] = {
    "h2_only": {
        "budget": 0.2,
        "modules": [{"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Cumulative"}}],
    },
}

# Recipe names the pending components will ship as (add the file under recipes/ and rerun)
PENDING_NAMES = {
    "clustergen": "ClusterSketch (ClusterGen Alg. 1 with a recent window)",
    "h2o_int4": "H2O + 4-bit QuantizedKV",
    "scissorhands_int4": "Scissorhands + 4-bit QuantizedKV",
}


@dataclasses.dataclass(frozen=True)
class Experiment:
    key: str
    task: str
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    options: dict
    quick_options: dict
    batch_size: int


SHIPPED = ()  # an experiment whose ``policies`` is SHIPPED runs every recipe in the recipes directory
RETRIEVAL_BUDGETS = (0.1, 0.2, 0.5)
RETRIEVAL_PROMPT_TOKENS = 1000

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        key="stream",
        task="agreement",
        policies=("full", "local", "streaming_llm", "h2o", "h2_only", "h2o_averaged", "scissorhands", "ahakv",
                  "h2o_int4", "scissorhands_int4"),
        budgets=(0.2,),
        options={"n_docs": 4, "doc_tokens": 1025, "chunk": 1},
        quick_options={"n_docs": 2, "doc_tokens": 257, "chunk": 1},
        batch_size=4,
    ),
    Experiment(
        key="passkey",
        task="passkey",
        policies=("full", "local", "streaming_llm", "h2o", "h2o_averaged", "scissorhands", "ahakv",
                  "h2o_int4", "scissorhands_int4"),
        budgets=(0.2, 0.5),
        options={"lengths": [700], "depths": 8},
        quick_options={"lengths": [300], "depths": 2},
        batch_size=8,
    ),
    Experiment(
        key="lines",
        task="lines",
        policies=("full", "local", "streaming_llm", "h2o", "scissorhands", "ahakv", "clustergen"),
        budgets=(0.2, 0.5),
        options={"n_prompts": 16, "n_lines": 10},
        quick_options={"n_prompts": 2, "n_lines": 3},
        batch_size=8,
    ),
    # the retrieval section: every shipped recipe, two haystacks and lines, three budgets
    Experiment(
        key="retrieval_filler",
        task="passkey",
        policies=SHIPPED,
        budgets=RETRIEVAL_BUDGETS,
        options={"lengths": [RETRIEVAL_PROMPT_TOKENS], "depths": 8},
        quick_options={"lengths": [300], "depths": 2},
        batch_size=8,
    ),
    Experiment(
        key="retrieval_prose",
        task="passkey",
        policies=SHIPPED,
        budgets=RETRIEVAL_BUDGETS,
        options={"lengths": [RETRIEVAL_PROMPT_TOKENS], "depths": 8, "haystack": "prose", "chat": True},
        quick_options={"lengths": [300], "depths": 2, "haystack": "prose", "chat": True},
        batch_size=8,
    ),
    Experiment(
        key="retrieval_lines",
        task="lines",
        policies=SHIPPED,
        budgets=RETRIEVAL_BUDGETS,
        options={"n_prompts": 16, "n_lines": 10},
        quick_options={"n_prompts": 2, "n_lines": 3},
        batch_size=8,
    ),
)
# the stream experiment also runs the recipes added after the seed papers (language modelling beside retrieval)
STREAM_EXTRA = ("keydiff", "knorm", "snapkv", "tova", "tova_keydiff")


def _spec(name: str) -> PolicySpec | str:
    """The policy for ``name``, or why it is unavailable (a string)."""
    if name in INLINE_RECIPES:
        return inline_spec(name, INLINE_RECIPES[name])
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        return f"recipes/{name}.yaml does not exist yet"
    try:
        return resolve_recipe(name)
    except Exception as error:  # a recipe whose component is not registered yet, or a bad one
        return f"recipes/{name}.yaml does not load: {str(error).splitlines()[-1].strip()}"


def experiment_policies(experiment: Experiment) -> tuple[str, ...]:
    """The recipe names an experiment runs (``SHIPPED``: every recipe found, ``full`` first)."""
    if experiment.policies is SHIPPED:
        names = available_recipes()
        return tuple(sorted(names, key=lambda n: n != "full"))
    if experiment.key == "stream":
        return experiment.policies + tuple(n for n in STREAM_EXTRA if n not in experiment.policies)
    return experiment.policies


def run_experiments(model, tokenizer, data=None, devices: int = 1, threads: int | None = None, quick: bool = False,
                    progress: bool = True, model_name: str = "default", log=print,
                    compile: bool = False, only: Sequence[str] | None = None,
                    recipes: Sequence[str] | None = None) -> tuple[dict, dict]:
    """Run the experiments (``only`` these keys, default all) with the recipes available (``recipes``:
    only these names); returns ``(results by key, unavailable)`` where ``unavailable`` maps a recipe
    name to the reason it was not run."""
    results, unavailable = {}, {}
    for experiment in EXPERIMENTS:
        if only is not None and experiment.key not in only:
            continue
        specs = []
        for name in experiment_policies(experiment):
            if recipes is not None and name not in recipes:
                continue
            spec = _spec(name)
            if isinstance(spec, str):
                unavailable[name] = spec
            else:
                specs.append(spec)
        options = dict(experiment.quick_options if quick else experiment.options)
        if data is not None and (experiment.task in ("perplexity", "agreement") or options.get("haystack") == "prose"):
            options["data"] = data
        log(f"[claims] {experiment.key}: {experiment.task} with {', '.join(s.name for s in specs)} "
            f"at budgets {list(experiment.budgets)}")
        started = time.perf_counter()
        shortest = _shortest_prompt(tokenizer, experiment.task, options)
        merged = None
        for index, budget in enumerate(experiment.budgets):
            # the full cache runs once; a recipe whose protections do not fit a budget is skipped there
            fits = [spec for spec in specs if (index == 0 or not spec.is_full)
                    and _fits(spec, budget, shortest, model.config.num_hidden_layers, unavailable)]
            if not fits:
                continue
            part = evaluate(
                model, tokenizer, fits, experiment.task, budgets=[budget], task_options=options,
                batch_size=experiment.batch_size, devices=devices, threads=threads, progress=progress,
                model_name=model_name, compile=compile,
            )
            merged = part if merged is None else {
                **merged, "runs": merged["runs"] + part["runs"], "budgets": [*merged["budgets"], budget],
                "wall_seconds": merged["wall_seconds"] + part["wall_seconds"],
            }
        results[experiment.key] = merged
        log(f"[claims] {experiment.key}: {time.perf_counter() - started:.0f} s")
    return results, unavailable


def _shortest_prompt(tokenizer, task: str, options: dict) -> int | None:
    """The fewest tokens of any prompt of a generation task (``None`` for a stream: budgets are fractions
    of its document length, which every recipe fits)."""
    if task not in ("passkey", "lines"):
        return None
    from evictlayers.eval.suite import make_task

    task_options = {k: v for k, v in options.items() if k != "data" or options.get("haystack") == "prose"}
    rows = make_task(task, tokenizer, **task_options).rows()
    return min(len(tokenizer.encode(row["text"])) for row in rows)


def _fits(spec: PolicySpec, budget: float, shortest: int | None, num_layers: int, unavailable: dict) -> bool:
    """Whether ``spec`` can run at ``budget`` on a prompt of ``shortest`` tokens; records why not."""
    if spec.is_full or shortest is None:
        return True
    import torch

    try:
        policy = spec.policy.replace(budget=budget)
        for layer in range(num_layers):
            policy.resolve_budget(torch.tensor([shortest]), layer, num_layers)
    except (TypeError, ValueError) as error:
        unavailable[f"{spec.name}@{budget:.0%}"] = f"does not fit a {shortest}-token prompt: {error}"
        return False
    return True


# ---- judging -------------------------------------------------------------------------------------

PPL_CLOSE = 0.05  # "close to the full cache": perplexity at most 5% above it
PPL_COLLAPSE = 0.25  # "collapses": perplexity at least 25% above the full cache
ACC_CLOSE = 0.125  # accuracy within one prompt in eight of the full cache
INT4_PPL = 0.02  # "costs little": 4-bit adds at most 2% perplexity
AS_GOOD_PPL = 0.01  # "at least as well" on perplexity: at most 1% above


def _run(results: dict, key: str, policy: str, budget: float | None = 0.2) -> dict | None:
    result = results.get(key)
    if result is None:
        return None
    for run in result["runs"]:
        if run["policy"] == policy and (run["full_cache"] or run["budget"] == budget):
            return run
    return None


def _gap(run: dict, full: dict) -> float:
    return run["perplexity"] / full["perplexity"] - 1.0


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def early_evenness(run: dict, share: float = 0.8) -> float:
    """Evenness of the retained positions over the first ``share`` of the sequence, where recent
    windows (which every policy here has, of different sizes) do not reach at 20% budget."""
    counts = run["histogram"]
    return histogram_evenness(counts[: max(2, int(len(counts) * share))])


def early_centre(run: dict, share: float = 0.8) -> float:
    """Mean relative position of the kept slots in the first ``share`` of the sequence, rescaled to
    [0, 1] over that stretch: 0.5 for an even spread, below 0.5 for a bias toward early tokens."""
    counts = run["histogram"]
    k = max(2, int(len(counts) * share))
    head = counts[:k]
    total = sum(head)
    return sum((i + 0.5) / k * c for i, c in enumerate(head)) / total if total else float("nan")


def first_tenth_share(run: dict) -> float:
    counts = run["histogram"]
    head = counts[: max(1, len(counts) // 10)]
    return sum(head) / max(sum(counts), 1)


@dataclasses.dataclass
class Verdict:
    status: str  # holds / partly / does not hold / pending
    summary: str
    details: list[str]


def _pending(missing: list[str], unavailable: dict) -> Verdict:
    reasons = [f"`{name}`: {unavailable.get(name, 'not run')}" for name in missing]
    return Verdict("pending", "component not landed: " + ", ".join(f"`{m}`" for m in missing), reasons)


def _missing(results: dict, needs: dict[str, tuple[str, ...]]) -> list[str]:
    out = []
    for key, policies in needs.items():
        for policy in policies:
            if _run(results, key, policy) is None and policy not in out:
                out.append(policy)
    return out


def claim_h2o(results: dict, unavailable: dict) -> Verdict:
    missing = _missing(results, {"stream": ("full", "local", "h2o"), "passkey": ("full", "local", "h2o")})
    if missing:
        return _pending(missing, unavailable)
    full, h2o, local = (_run(results, "stream", p) for p in ("full", "h2o", "local"))
    h2o_gap, local_gap = _gap(h2o, full), _gap(local, full)
    pk = {p: _run(results, "passkey", p) for p in ("full", "h2o", "local")}
    pk_close = pk["h2o"]["score"] >= pk["full"]["score"] - ACC_CLOSE
    pk_collapse = pk["local"]["score"] <= pk["full"]["score"] - 3 * ACC_CLOSE
    details = [
        f"Streamed perplexity at 20%: full {full['perplexity']:.2f}, H2O {h2o['perplexity']:.2f} "
        f"({_pct(h2o_gap)}), local {local['perplexity']:.2f} ({_pct(local_gap)}); top-1 agreement with the full "
        f"cache: H2O {h2o['top1']:.3f}, local {local['top1']:.3f}.",
        f"Passkey at 20%: full {pk['full']['correct']}/{pk['full']['n']}, H2O {pk['h2o']['correct']}/{pk['h2o']['n']}, "
        f"local {pk['local']['correct']}/{pk['local']['n']}.",
    ]
    pk50 = {p: _run(results, "passkey", p, 0.5) for p in ("h2o", "local")}
    if all(pk50.values()):
        details.append(
            f"Passkey at 50%: H2O {pk50['h2o']['correct']}/{pk50['h2o']['n']}, local "
            f"{pk50['local']['correct']}/{pk50['local']['n']}."
        )
    h2 = _run(results, "stream", "h2_only")
    if h2 is not None:
        details.append(
            f"Table 9 ablation (streamed perplexity at 20%): local only {local['perplexity']:.2f}, heavy hitters "
            f"only {h2['perplexity']:.2f}, both (H2O) {h2o['perplexity']:.2f}: "
            + ("heavy hitters alone beat the local window, both together beat either, as in Table 9."
               if h2["perplexity"] < local["perplexity"] and h2o["perplexity"] <= min(h2["perplexity"], local["perplexity"])
               else "the ordering differs from Table 9 (there: both > heavy hitters only > local only).")
        )
    lm_close, lm_collapse = h2o_gap <= PPL_CLOSE, local_gap >= PPL_COLLAPSE
    numbers = (f"perplexity H2O {_pct(h2o_gap)}, local {_pct(local_gap)} vs full; passkey H2O "
               f"{pk['h2o']['correct']}/{pk['h2o']['n']}, local {pk['local']['correct']}/{pk['local']['n']}, full "
               f"{pk['full']['correct']}/{pk['full']['n']}")
    lm = lm_close and lm_collapse
    retrieval = pk_close and pk_collapse
    if lm and retrieval:
        return Verdict("holds", f"on both tasks ({numbers})", details)
    if lm:
        why = "H2O fails it too" if not pk_close else "the local window does not collapse"
        return Verdict("partly", f"holds for language modelling, not for passkey retrieval, where {why} ({numbers})",
                       details)
    if retrieval:
        return Verdict("partly", f"holds for passkey retrieval, not for language modelling ({numbers})", details)
    return Verdict("does not hold", f"on neither task by the criteria below ({numbers})", details)


def claim_scissorhands(results: dict, unavailable: dict) -> Verdict:
    missing = _missing(results, {"stream": ("full", "local", "scissorhands")})
    if missing:
        return _pending(missing, unavailable)
    full, sc, local = (_run(results, "stream", p) for p in ("full", "scissorhands", "local"))
    gap, local_gap = _gap(sc, full), _gap(local, full)
    details = [
        f"Streamed perplexity at 20% (5x compression): full {full['perplexity']:.2f}, Scissorhands "
        f"{sc['perplexity']:.2f} ({_pct(gap)}), local {local['perplexity']:.2f} ({_pct(local_gap)}); top-1 "
        f"agreement Scissorhands {sc['top1']:.3f}, local {local['top1']:.3f}. Scissorhands holds "
        f"{sc['kept_fraction']:.1%} of the full cache's KV slots at the end (it drops m = 0.5 B at once) in the "
        f"same {sc['kv_bytes'] / 2**20:.2f} MiB per sequence as the others.",
    ]
    h2o = _run(results, "stream", "h2o")
    if h2o is not None:
        details.append(f"For reference, H2O at the same budget: {h2o['perplexity']:.2f} ({_pct(_gap(h2o, full))}).")
    beats = sc["perplexity"] < local["perplexity"]
    if gap <= PPL_CLOSE and beats:
        return Verdict("holds", f"Scissorhands {_pct(gap)} from full, local {_pct(local_gap)}", details)
    if beats:
        return Verdict("partly", f"beats local ({_pct(local_gap)}) but is {_pct(gap)} from full (criterion: 5%)",
                       details)
    return Verdict("does not hold", "Scissorhands does not beat the local window", details)


def claim_ahakv(results: dict, unavailable: dict) -> Verdict:
    missing = _missing(results, {"stream": ("h2o", "ahakv"), "passkey": ("h2o", "ahakv")})
    if missing:
        return _pending(missing, unavailable)
    details, more_even, less_even, centres = [], [], [], []
    for key in ("stream", "passkey", "lines"):
        h2o, aha = _run(results, key, "h2o"), _run(results, key, "ahakv")
        if h2o is None or aha is None:
            continue
        e_h, e_a = early_evenness(h2o), early_evenness(aha)
        (more_even if e_a > e_h else less_even).append(key)
        centres.append(early_centre(h2o))
        details.append(
            f"{key} at 20%: evenness of retained positions over the first 80% of the sequence H2O {e_h:.2f}, "
            f"AhaKV {e_a:.2f}; their centre there (0.5 = even, lower = early) H2O {early_centre(h2o):.2f}, AhaKV "
            f"{early_centre(aha):.2f}; share of all kept slots in the first 10% of positions H2O "
            f"{first_tenth_share(h2o):.1%}, AhaKV {first_tenth_share(aha):.1%}."
        )
    full = _run(results, "stream", "full")
    s_h, s_a = _run(results, "stream", "h2o"), _run(results, "stream", "ahakv")
    worse = []
    if s_a["perplexity"] > s_h["perplexity"] * (1 + AS_GOOD_PPL):
        worse.append(f"streamed perplexity {s_a['perplexity']:.2f} vs {s_h['perplexity']:.2f}")
    comparisons = 1
    details.append(
        f"Streamed perplexity at 20%: H2O {s_h['perplexity']:.2f}, AhaKV {s_a['perplexity']:.2f} (full "
        f"{full['perplexity']:.2f}); top-1 agreement H2O {s_h['top1']:.3f}, AhaKV {s_a['top1']:.3f}."
    )
    for key in ("passkey", "lines"):
        for budget in (0.2, 0.5):
            p_h, p_a = _run(results, key, "h2o", budget), _run(results, key, "ahakv", budget)
            if p_h is None or p_a is None:
                continue
            comparisons += 1
            if p_a["score"] < p_h["score"]:
                worse.append(f"{key} {budget:.0%} {p_a['correct']}/{p_a['n']} vs {p_h['correct']}/{p_h['n']}")
            details.append(f"{key} at {budget:.0%}: H2O {p_h['correct']}/{p_h['n']}, AhaKV {p_a['correct']}/{p_a['n']}.")
    bias = (f"H2O's kept positions lean early on {sum(c < 0.45 for c in centres)} of {len(centres)} tasks (centre "
            f"{min(centres):.2f}-{max(centres):.2f}, 0.5 = even), the bias of AhaKV Fig. 2")
    spread = (f"AhaKV is more even on {', '.join(more_even) or 'no task'}"
              + (f", less even on {', '.join(less_even)}" if less_even else ""))
    score = (f"it scores at least as well on all {comparisons} comparisons" if not worse else
             f"it scores lower on {len(worse)} of {comparisons} comparisons ({'; '.join(worse)})")
    summary = f"{bias}; {spread}; {score}"
    if not less_even and not worse:
        return Verdict("holds", summary, details)
    if more_even or not worse:
        return Verdict("partly", summary, details)
    return Verdict("does not hold", summary, details)


def claim_clustergen(results: dict, unavailable: dict) -> Verdict:
    missing = _missing(results, {"lines": ("full", "h2o", "streaming_llm", "clustergen")})
    measured = []
    for budget in (0.2, 0.5):
        runs = {p: _run(results, "lines", p, budget) for p in ("full", "h2o", "streaming_llm")}
        if all(runs.values()):
            measured.append(
                f"Lines at {budget:.0%} (measured now): full {runs['full']['correct']}/{runs['full']['n']}, H2O "
                f"{runs['h2o']['correct']}/{runs['h2o']['n']}, StreamingLLM {runs['streaming_llm']['correct']}/"
                f"{runs['streaming_llm']['n']}."
            )
    if missing:
        verdict = _pending(missing, unavailable)
        verdict.details += measured
        return verdict
    wins, details = [], list(measured)
    for budget in (0.2, 0.5):
        runs = {p: _run(results, "lines", p, budget) for p in ("h2o", "streaming_llm", "clustergen")}
        if not all(runs.values()):
            continue
        best = max(runs["h2o"]["score"], runs["streaming_llm"]["score"])
        wins.append(runs["clustergen"]["score"] > best)
        details.append(
            f"Lines at {budget:.0%}: ClusterSketch {runs['clustergen']['correct']}/{runs['clustergen']['n']} "
            f"({runs['clustergen']['kv_bytes'] / 2**20:.2f} MiB/seq) vs H2O {runs['h2o']['kv_bytes'] / 2**20:.2f} MiB/seq."
        )
    if wins and all(wins):
        return Verdict("holds", "ClusterSketch beats H2O and StreamingLLM at every budget", details)
    if any(wins):
        return Verdict("partly", "ClusterSketch wins at some budgets", details)
    return Verdict("does not hold", "ClusterSketch does not beat H2O and StreamingLLM", details)


def claim_int4(results: dict, unavailable: dict) -> Verdict:
    pairs = [("h2o", "h2o_int4"), ("scissorhands", "scissorhands_int4")]
    present = [(b, q) for b, q in pairs if _run(results, "stream", q) is not None and _run(results, "stream", b)]
    if not present:
        return _pending([q for _, q in pairs], unavailable)
    details, ok = [], []
    for base, quant in present:
        b, q = _run(results, "stream", base), _run(results, "stream", quant)
        rel = q["perplexity"] / b["perplexity"] - 1
        ok.append(rel <= INT4_PPL)
        details.append(
            f"{base} vs {quant}, streamed perplexity at 20%: {b['perplexity']:.2f} vs {q['perplexity']:.2f} "
            f"({_pct(rel)}); KV {b['kv_bytes'] / 2**20:.2f} vs {q['kv_bytes'] / 2**20:.2f} MiB/seq."
        )
        pb, pq = _run(results, "passkey", base), _run(results, "passkey", quant)
        if pb is not None and pq is not None:
            ok.append(pq["score"] >= pb["score"] - ACC_CLOSE)
            details.append(f"passkey at 20%: {pb['correct']}/{pb['n']} vs {pq['correct']}/{pq['n']}.")
    missing = [q for b, q in pairs if (b, q) not in present]
    if missing:
        details.append("not yet measured: " + ", ".join(f"`{m}` ({unavailable.get(m, 'not run')})" for m in missing))
    if all(ok):
        return Verdict("holds" if not missing else "partly", "4-bit costs little where measured", details)
    return Verdict("does not hold", "4-bit costs more than 2% perplexity or a passkey prompt", details)


@dataclasses.dataclass(frozen=True)
class Claim:
    number: int
    title: str
    sources: str
    paper: str
    judge: Callable[[dict, dict], Verdict]


CLAIMS: tuple[Claim, ...] = (
    Claim(1, "H2O at 20% is close to the full cache while the local window collapses", "H2O Fig. 4, Table 9",
          "OPT/LLaMA 6.7B-175B, 5-shot tasks: H2O at 20% matches the full cache, Local loses up to 37 points; "
          "Table 9 (OPT-13B PiQA): full 77.37, local only 54.62, heavy hitters only 76.12, both 77.26.",
          claim_h2o),
    Claim(2, "Scissorhands keeps perplexity close to the full cache at 5x compression and beats the local window",
          "Scissorhands Table 3",
          "OPT-13B on C4: full 8.80 / 9.10 / 9.30, Scissorhands 8.80 / 9.10 / 9.30, local window 81.83 / 29.38 / "
          "15.59 (sequences of 256-512 / 512-1024 / 1024-2048 tokens).",
          claim_scissorhands),
    Claim(3, "AhaKV spreads retained positions more evenly than H2O and scores at least as well",
          "AhaKV Sec. 3.1, Fig. 2, Table 1",
          "LLaMA2-7B, 3,600 tokens: H2O evicts nearly everything after position 1,500; LongBench averages "
          "(LLaMA3-8B) full 41.94, H2O 38.93, AhaKV 41.63.",
          claim_ahakv),
    Claim(4, "ClusterSketch beats H2O and StreamingLLM on line retrieval at equal memory", "ClusterGen Table 2",
          "longchat-7B, LongEval lines, 5k tokens at 35% memory: exact 0.98, Sink 0.56, H2O 0.66, ClusterGen 0.86.",
          claim_clustergen),
    Claim(5, "Adding 4-bit QuantizedKV to H2O / Scissorhands costs little", "H2O Table 6, Scissorhands Table 4",
          "OPT-30B: H2O 84.00 / 43.00 / 78.45, H2O + 4-bit 84.00 / 43.20 / 78.80 (COPA / OpenBookQA / PiQA); "
          "OPT-13B Hellaswag: Scissorhands 0.720, + 4-bit 0.720.",
          claim_int4),
)

# ---- the report ----------------------------------------------------------------------------------


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _best_sentence(results: dict) -> str:
    """Which evicting policy is best at language modelling and which at retrieval, from the numbers."""
    stream = [r for r in results.get("stream", {}).get("runs", []) if not r["full_cache"]]
    retrieval: dict[str, int] = {}
    for key in ("passkey", "lines"):
        for run in results.get(key, {}).get("runs", []):
            if not run["full_cache"]:
                retrieval[run["policy"]] = retrieval.get(run["policy"], 0) + run["correct"]
    common = [r for r in stream if r["policy"] in retrieval]
    if not common:
        return ""
    lm = min(common, key=lambda r: r["perplexity"])["policy"]
    top = max(retrieval[r["policy"]] for r in common)
    best = [r["policy"] for r in common if retrieval[r["policy"]] == top]
    verb = "is also" if lm in best else "is not"
    return (f"Among the policies run on every task, the best language model at 20% is `{lm}`; the most retrieval "
            f"answers (passkey + lines, all budgets) come from {', '.join(f'`{b}`' for b in best)} ({top}): the best "
            f"language model {verb} the best retriever here.")


def _both_table(results: dict) -> str:
    """One row per policy: language modelling and retrieval side by side at 20%."""
    names: list[str] = []
    for result in results.values():
        for run in result["runs"]:
            if run["policy"] not in names:
                names.append(run["policy"])
    lines = ["| policy | streamed perplexity | top-1 agreement | KL (nats) | passkey 20% | passkey 50% | "
             "lines 20% | lines 50% |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        s = _run(results, "stream", name)
        cells = [name]
        cells += [f"{s['perplexity']:.2f}", f"{s['top1']:.3f}", f"{max(s['kl'], 0.0):.3f}"] if s else ["-"] * 3
        for key in ("passkey", "lines"):
            for budget in (0.2, 0.5):
                r = _run(results, key, name, budget)
                cells.append(f"{r['correct']}/{r['n']}" if r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _about(result: dict) -> str:
    """What an experiment measured, from its actual settings."""
    settings, runs = result["settings"], result["runs"]
    budgets = ", ".join(f"{b:.0%}" for b in result["budgets"] or [] if isinstance(b, float))
    if result["task"] in ("perplexity", "agreement"):
        n = settings["doc_tokens"] - 1
        tokens = sorted({round(r["budget_tokens"]) for r in runs if r["budget_tokens"] is not None})
        return (f"{result['n_examples']} windows of {settings['doc_tokens']} tokens (round-robin over "
                f"{', '.join(settings['sources'])}, starting {settings['start']:.0%} into each book), streamed "
                f"{settings['chunk']} token(s) per forward with eviction after every step, scored against the "
                f"unmodified model's one-pass distributions; budgets {budgets} of the {n} streamed tokens "
                f"({', '.join(map(str, tokens))} tokens per head; per-layer allocations such as Scissorhands' ramp "
                "average to the same)")
    prompt = runs[0]["prompt_tokens"]
    if result["task"] == "passkey":
        depths = ", ".join(f"{d:.2f}" for d in settings["depths"])
        return (f"{result['n_examples']} passkey prompts of ~{prompt:.0f} tokens, key at depths {depths}; greedy, "
                f"{settings['max_new_tokens']} new tokens, correct when the first number is the key; budgets "
                f"{budgets} of each prompt")
    return (f"{result['n_examples']} LongEval-style records of {settings['n_lines']} lines (~{prompt:.0f} tokens), "
            f"asking for lines spread evenly from the first to the last; greedy, {settings['max_new_tokens']} new "
            f"tokens, correct when the first number is the line's value; budgets {budgets} of each prompt")


def render(results: dict, unavailable: dict, verdicts: list[tuple[Claim, Verdict]], meta: dict,
           plots: dict[str, str], needles: Sequence[dict] = ()) -> str:
    """The report; ``needles`` are per-head needle dumps (``evictlayers needles``) for the retrieval section."""
    out = [
        "# Results: the papers' claims on the embedded model",
        "",
        f"Generated by `bash scripts/results.sh` (`evictlayers claims`) on {meta['date']} in "
        f"{meta['minutes']:.1f} minutes ({meta['cpu']}; {meta['devices']} process(es), "
        f"{meta['threads'] or 'default'} thread(s) each){' -- QUICK MODE: tiny sizes, not evidence' if meta['quick'] else ''}.",
        f"Model: {meta['model']} (float32, greedy decoding). Every measured number below comes from "
        "this run; the papers' numbers are quoted for comparison.",
        "",
        "## Verdicts",
        "",
        f"| # | claim | paper | verdict on {meta['model_short']} |",
        "|---|---|---|---|",
    ]
    for claim, verdict in verdicts:
        out.append(f"| {claim.number} | {claim.title} | {claim.sources} | **{verdict.status}**: {verdict.summary} |")
    out += [
        "",
        "Criteria (fixed before the run, in `evictlayers/eval/claims.py`): *close to the full cache* = streamed "
        f"perplexity at most {PPL_CLOSE:.0%} above it, or passkey accuracy within one prompt in eight; "
        f"*collapses* = perplexity at least {PPL_COLLAPSE:.0%} above the full cache, or passkey three prompts in "
        f"eight below it; *at least as well* = perplexity at most {AS_GOOD_PPL:.0%} above, accuracy not lower; *costs little* (4-bit) = at most {INT4_PPL:.0%} more perplexity. *Evenness* is the "
        "normalised entropy of the histogram of retained original positions (20 bins; 1 = uniform), taken over the "
        "first 80% of the sequence so that the recent windows (different sizes per policy) do not decide it.",
        "",
        "## Setup",
        "",
    ]
    for experiment in EXPERIMENTS:
        if experiment.key not in results:
            continue
        result = results[experiment.key]
        settings = ", ".join(f"{k}={v}" for k, v in result["settings"].items())
        out.append(f"- **{experiment.key}** ({result['task']} task, {result['n_examples']} examples, "
                   f"{result['wall_seconds'] / 60:.1f} min): {_about(result)}. Settings: {settings}.")
    out += [
        "- Budgets are per KV head and layer, physically held: every policy at the same budget holds the same KV "
        "bytes (the *KV MiB / seq* column). Recipes come from `recipes/`; `h2_only` (H2O Table 9's heavy hitters "
        "without the recent window) is defined in `evictlayers/eval/claims.py`.",
        "- Data: PG-19 sample books in `../shared/data/pg19-sample` (Project Gutenberg header and licence "
        "stripped; read at run time, not stored here); passkey and lines prompts are generated from seed 0.",
        "",
    ]
    if unavailable:
        out += ["Not run (a pending component, or protections that do not fit the budget of the shortest prompt):", ""]
        out += [f"- `{name}`: {reason}" for name, reason in unavailable.items()]
        out.append("")
    for claim, verdict in verdicts:
        out += [f"## Claim {claim.number}: {claim.title}", "", f"*{claim.sources}.* Paper: {claim.paper}", "",
                f"**Verdict: {verdict.status}** -- {verdict.summary}.", ""]
        out += [f"- {line}" for line in verdict.details]
        out.append("")
    out += ["## Language modelling and retrieval side by side", "",
            "Perplexity, agreement and KL from the stream at 20%; passkey and lines are correct answers out of the "
            "prompts. " + _best_sentence(results), "",
            _both_table(results), ""]
    out += retrieval_section(results, needles)
    if meta.get("updates") or any("measured" in r for r in results.values()):
        out += ["## When each run was measured", "",
                f"The first run ({meta['date']}) measured everything not listed below. Later partial re-runs "
                "(`evictlayers claims --only ... --recipes ...`) replaced these runs:", ""]
        for update in meta.get("updates", []):
            out.append(f"- {update['date']} ({update['minutes']:.0f} min): experiments {', '.join(update['experiments'])}, "
                       f"recipes {update['recipes'] if isinstance(update['recipes'], str) else ', '.join(update['recipes'])}")
        out.append("")
    out += ["## All numbers", ""]
    for key, result in results.items():
        out += [f"### {key} ({result['task']})", "", markdown_table(result), ""]
        if result["task"] == "lines":
            out.append("Answers that are the value of *some* line of the record (right or wrong line): "
                       + ", ".join(f"{r['label']} {r['in_record']:.0%}" for r in result["runs"]) + ".")
            out.append("")
        if result["task"] in ("passkey", "lines"):
            out.append("Accuracy by depth of the asked item (0 = start of the prompt, 1 = end):")
            out.append("")
            depths = list(result["runs"][0]["by_depth"])
            out.append("| policy | budget | " + " | ".join(depths) + " |")
            out.append("|---|---|" + "---|" * len(depths))
            for run in result["runs"]:
                budget = "full" if run["full_cache"] else f"{run['budget']:.0%}"
                out.append(f"| {run['policy']} | {budget} | "
                           + " | ".join(f"{run['by_depth'][d]:.2f}" for d in depths) + " |")
            out.append("")
        if result["task"] == "agreement":
            docs = list(result["runs"][0]["per_document"])
            out.append("Perplexity per document:")
            out.append("")
            out.append("| policy | " + " | ".join(docs) + " |")
            out.append("|---|" + "---|" * len(docs))
            for run in result["runs"]:
                out.append(f"| {run['label']} | " + " | ".join(f"{run['per_document'][d]:.2f}" for d in docs) + " |")
            out.append("")
    out += ["## Plots", ""]
    for caption, path in plots.items():
        out += [f"![{caption}]({path})", "", f"*{caption}*", ""]
    out += [
        "## Reading these numbers",
        "",
        "- A 135M-parameter model is not the 7B-175B models of the papers: its retrieval is weak even with the "
        "full cache (lines), and prompts of ~700-1,000 tokens are short next to LongBench's. Where a verdict "
        "disagrees with a paper, that is what this model shows at these sizes, not a statement about the paper's "
        "models.",
        f"- Sample sizes are small (8 passkey prompts, 16 line prompts, {results['stream']['n_examples'] if 'stream' in results else 0}"
        " documents): one prompt is 12.5 or 6.25 points. The per-example answers are in the JSON files.",
        "- Throughput (tokens/s) is measured on a shared 2-core CPU during this run and only comparable within a "
        "table.",
        "",
    ]
    return "\n".join(out)


def _saved(artifacts: Path) -> tuple[dict, dict, dict]:
    """``(meta, unavailable, results by key)`` of an earlier run in ``artifacts``."""
    run_file = artifacts / "run.json"
    if not run_file.is_file():
        raise FileNotFoundError(f"{run_file} not found: --render-only and --only need the artifacts of an earlier run")
    saved = json.loads(run_file.read_text())
    results = {e.key: json.loads((artifacts / f"{e.key}.json").read_text()) for e in EXPERIMENTS
               if (artifacts / f"{e.key}.json").is_file()}
    return saved["meta"], saved["unavailable"], results


def _merge(old: dict | None, new: dict, date: str) -> dict:
    """``new`` runs replace ``old`` runs of the same label; the rest of ``old`` stays (with its settings,
    which must match). The merged result records which labels were measured when (``measured``)."""
    if old is None:
        return {**new, "measured": [{"date": date, "labels": [r["label"] for r in new["runs"]]}]}
    if old["settings"] != new["settings"]:
        raise ValueError(f"cannot merge runs of {new['task']} with different settings: {old['settings']} vs {new['settings']}")
    labels = {r["label"] for r in new["runs"]}
    runs = [r for r in old["runs"] if r["label"] not in labels] + new["runs"]
    measured = old.get("measured", [{"date": "earlier", "labels": [r["label"] for r in old["runs"]]}])
    budgets = sorted({*(old["budgets"] or []), *(new["budgets"] or [])})
    return {**old, "runs": runs, "budgets": budgets,
            "measured": [*measured, {"date": date, "labels": sorted(labels)}]}


def main(doc: str | os.PathLike = "docs/results.md", artifacts: str | os.PathLike | None = None, data=None,
         model_name: str = "default", devices: int = 1, threads: int | None = None, quick: bool = False,
         progress: bool = True, model=None, tokenizer=None, render_only: bool = False, compile: bool = False,
         only: Sequence[str] | None = None, recipes: Sequence[str] | None = None) -> str:
    """Run the experiments and write the report to ``doc`` (JSON and plots under ``artifacts``).

    ``render_only`` rebuilds the report, verdicts and plots from the JSON files of an earlier run in
    ``artifacts`` without evaluating anything. ``only`` (experiment keys) and ``recipes`` (names) re-run
    part of an earlier run: the new runs replace the saved ones of the same label, everything else is
    kept, and the report says which runs were measured when.
    """
    started = time.perf_counter()
    doc = Path(doc)
    artifacts = Path(artifacts) if artifacts is not None else doc.with_suffix("")
    artifacts.mkdir(parents=True, exist_ok=True)
    doc.parent.mkdir(parents=True, exist_ok=True)
    keys = [e.key for e in EXPERIMENTS]
    unknown = sorted(set(only or ()) - set(keys))
    if unknown:
        raise ValueError(f"unknown experiment(s) {unknown}; the experiments are {', '.join(keys)}")
    partial = only is not None or recipes is not None
    if render_only:
        meta, unavailable, results = _saved(artifacts)
    else:
        if model is None:
            from evictlayers.models import load

            model, tokenizer = load(model_name)
        if partial:
            meta, unavailable, results = _saved(artifacts)
        new, new_unavailable = run_experiments(model, tokenizer, data=data, devices=devices, threads=threads,
                                               quick=quick, progress=progress, model_name=model_name,
                                               compile=compile, only=only, recipes=recipes)
        date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        if partial:
            for key, result in new.items():
                results[key] = _merge(results.get(key), result, date)
            unavailable = {**unavailable, **new_unavailable}
            for name in [n for n in unavailable if any(r["policy"] == n for res in results.values() for r in res["runs"])]:
                unavailable.pop(name)
            meta["updates"] = [*meta.get("updates", []), {
                "date": date, "minutes": (time.perf_counter() - started) / 60,
                "experiments": sorted(new), "recipes": sorted(recipes) if recipes else "all",
            }]
            for key in new:
                (artifacts / f"{key}.json").write_text(json.dumps(results[key], indent=1, default=str))
            (artifacts / "run.json").write_text(json.dumps({"meta": meta, "unavailable": unavailable}, indent=1))
    if not render_only and not partial:
        results, unavailable = new, new_unavailable
        meta = {
            "date": date,
            "minutes": (time.perf_counter() - started) / 60,
            "cpu": _cpu(),
            "devices": devices,
            "threads": threads,
            "compile": compile,
            "quick": quick,
            "model_short": "SmolLM2-135M" if model_name == "default" else model_name,
            "model": "SmolLM2-135M-Instruct, the embedded GGUF (`evictlayers.models.load_default`)"
            if model_name == "default" else model_name,
        }
        for key, result in results.items():
            (artifacts / f"{key}.json").write_text(json.dumps(result, indent=1, default=str))
        (artifacts / "run.json").write_text(json.dumps({"meta": meta, "unavailable": unavailable}, indent=1))
    verdicts = [(claim, claim.judge(results, unavailable)) for claim in CLAIMS]
    rel = os.path.relpath(artifacts, doc.parent)
    plots = {}
    for key, result in results.items():
        if len(result["budgets"] or []) > 1:
            path = plot_score_vs_budget(result, artifacts / f"{key}_score_vs_budget.png",
                                        title=f"{key}: {result['score_name']} vs KV budget")
            if path is not None:
                plots[f"{key}: {result['score_name']} vs budget (full cache dashed), as H2O Fig. 4"] = f"{rel}/{path.name}"
        path = plot_positions(result, artifacts / f"{key}_positions.png", budget=0.2,
                              title=f"{key}: which original positions are kept at 20%")
        if path is not None:
            plots[f"{key}: retained original positions at 20%, all layers and heads (AhaKV Fig. 2c)"] = f"{rel}/{path.name}"
    # per-head needle dumps written beside the artifacts by scripts/results.sh (evictlayers needles)
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
