"""Running the experiments: each experiment's recipes at each of its budgets, merged into one result per
experiment (the shape :func:`evictlayers.eval.runner.evaluate` returns, with every budget's runs)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from evictlayers.eval.runner import PolicySpec, evaluate, inline_spec, recipes_dir, resolve_recipe
from evictlayers.eval.suite import make_task
from research.claims.experiments import EXPERIMENTS, INLINE_RECIPES, experiment_policies


def run_experiments(model, tokenizer, data=None, devices: int = 1, threads: int | None = None, quick: bool = False,
                    progress: bool = True, model_name: str = "default", log=print,
                    compile: bool = False, only: Sequence[str] | None = None,
                    recipes: Sequence[str] | None = None) -> tuple[dict, dict]:
    """Run the experiments (``only`` these keys, default all) with the recipes available (``recipes``:
    only these names); returns ``(results by key, unavailable)`` where ``unavailable`` maps a recipe
    name (or ``name@budget``) to the reason it was not run."""
    results, unavailable = {}, {}
    for experiment in EXPERIMENTS:
        if only is not None and experiment.key not in only:
            continue
        specs = []
        for name in experiment_policies(experiment):
            if recipes is not None and name not in recipes:
                continue
            spec = policy_spec(name)
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
        shortest = shortest_prompt(tokenizer, experiment.task, options)
        merged = None
        for index, budget in enumerate(experiment.budgets):
            # the full cache runs once; a recipe whose protections do not fit a budget is skipped there
            fits = [spec for spec in specs if (index == 0 or not spec.is_full)
                    and fits_budget(spec, budget, shortest, model.config.num_hidden_layers, unavailable)]
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


def policy_spec(name: str) -> PolicySpec | str:
    """The policy for ``name`` (an inline ablation or a recipe file), or why it is unavailable (a string)."""
    if name in INLINE_RECIPES:
        return inline_spec(name, INLINE_RECIPES[name])
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        return f"recipes/{name}.yaml does not exist yet"
    try:
        return resolve_recipe(name)
    except Exception as error:  # a recipe whose component is not registered yet, or a bad one
        return f"recipes/{name}.yaml does not load: {str(error).splitlines()[-1].strip()}"


def shortest_prompt(tokenizer, task: str, options: dict) -> int | None:
    """The fewest tokens of any prompt of a generation task (``None`` for a stream: budgets are fractions
    of its document length, which every recipe fits)."""
    if task not in ("passkey", "lines"):
        return None
    task_options = {k: v for k, v in options.items() if k != "data" or options.get("haystack") == "prose"}
    rows = make_task(task, tokenizer, **task_options).rows()
    return min(len(tokenizer.encode(row["text"])) for row in rows)


def fits_budget(spec: PolicySpec, budget: float, shortest: int | None, num_layers: int, unavailable: dict) -> bool:
    """Whether ``spec`` can run at ``budget`` on a prompt of ``shortest`` tokens; records why not in
    ``unavailable`` under ``name@budget``."""
    if spec.is_full or shortest is None:
        return True
    try:
        policy = spec.policy.replace(budget=budget)
        for layer in range(num_layers):
            policy.resolve_budget(torch.tensor([shortest]), layer, num_layers)
    except (TypeError, ValueError) as error:
        unavailable[f"{spec.name}@{budget:.0%}"] = f"does not fit a {shortest}-token prompt: {error}"
        return False
    return True
