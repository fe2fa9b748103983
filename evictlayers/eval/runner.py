"""From recipe names and budgets to a results dictionary: what ``evictlayers eval`` runs.

``evaluate(model, tokenizer, recipes, task, budgets)`` loads each recipe, re-budgets it for every
budget, and evaluates all of them in one ``Trainer.test`` (:mod:`evictlayers.eval.module`). A recipe
without modules is the full cache: it runs once, whatever the budgets.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from evictlayers import Policy, load_recipe
from evictlayers.compose.recipes import SHIPPED_RECIPES, policy_from_dict

__all__ = [
    "RECIPES_ENV",
    "PolicySpec",
    "budget_label",
    "evaluate",
    "expand_budgets",
    "parse_budget",
    "recipes_dir",
    "resolve_recipe",
]

RECIPES_ENV = "EVICTLAYERS_RECIPES"
DEFAULT_BATCH = {"passkey": 8, "lines": 8, "perplexity": 4, "agreement": 4, "ruler": 4}


def recipes_dir() -> Path:
    """``$EVICTLAYERS_RECIPES`` if set, else the recipes shipped in the package (``evictlayers/recipes/``)."""
    if os.environ.get(RECIPES_ENV):
        return Path(os.environ[RECIPES_ENV]).expanduser()
    return SHIPPED_RECIPES


@dataclasses.dataclass
class PolicySpec:
    """A named policy and where it came from (a recipe file, or ``<inline>``)."""

    name: str
    source: str
    policy: Policy

    @property
    def is_full(self) -> bool:
        return not self.policy.modules_in_order and self.policy.budget is None


def available_recipes() -> list[str]:
    directory = recipes_dir()
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def resolve_recipe(recipe: str | os.PathLike) -> PolicySpec:
    """A recipe name (``h2o`` -> ``evictlayers/recipes/h2o.yaml``) or a path to a YAML file, loaded.

    Raises:
        FileNotFoundError: no such recipe; the message lists the available names and the directory.
        RecipeError: the file does not describe a valid policy (file, key and what was expected).
    """
    text = os.fspath(recipe)
    looks_like_path = text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text
    path = Path(text).expanduser() if looks_like_path else recipes_dir() / f"{text}.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"recipe {text!r} not found ({path} does not exist); give a recipe name from {recipes_dir()} "
            f"({', '.join(available_recipes()) or 'none there'}) or the path of a recipe YAML file"
        )
    return PolicySpec(name=path.stem if looks_like_path else text, source=str(path), policy=load_recipe(path))


def inline_spec(name: str, recipe: Mapping) -> PolicySpec:
    """A policy from a recipe mapping (the YAML structure as a dict)."""
    return PolicySpec(name=name, source="<inline>", policy=policy_from_dict(dict(recipe), source=f"<inline {name}>"))


_INT = re.compile(r"^\d+$")


def parse_budget(text: str | int | float | None) -> int | float | None:
    """A budget from the command line: ``128`` (tokens per head), ``0.2`` or ``20%`` (fraction of the
    prompt, in (0, 1]), or ``full``/``none`` (no eviction).

    Raises:
        ValueError: anything else, saying what is allowed.
    """
    allowed = (
        "allowed: an integer number of tokens per head (e.g. 128), a fraction of the prompt in (0, 1] "
        "(e.g. 0.2 or 20%), or 'full'"
    )
    if text is None:
        return None
    if isinstance(text, bool):
        raise ValueError(f"bad budget {text!r}; {allowed}")
    if isinstance(text, (int, float)):
        value: int | float = text
    else:
        raw = text.strip().lower()
        if raw in ("full", "none"):
            return None
        try:
            if _INT.match(raw):
                value = int(raw)
            elif raw.endswith("%"):
                value = float(raw[:-1]) / 100.0
            else:
                value = float(raw)
        except ValueError:
            raise ValueError(f"bad budget {text!r}: not a number; {allowed}") from None
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"bad budget {text!r}: a token budget must be >= 1; {allowed}")
        return value
    if not 0.0 < value <= 1.0 or value != value:
        raise ValueError(f"bad budget {text!r}: a fractional budget must be in (0, 1]; {allowed}")
    return float(value)


def budget_label(budget: int | float | None) -> str:
    return "full" if budget is None else (str(budget) if isinstance(budget, int) else f"{budget:g}")


def expand_budgets(
    specs: Sequence[PolicySpec], budgets: Sequence[int | float | None] | None
) -> list[tuple[str, PolicySpec, int | float | None, Policy]]:
    """``[(label, spec, budget, policy)]``: each recipe at each budget (its own budget if none are
    given); a full-cache recipe once. Labels are ``name@budget`` (``name`` for the full cache).

    Raises:
        ValueError: a recipe cannot take a budget (e.g. its protected slots do not fit), naming both.
    """
    runs = []
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"recipe name(s) given more than once: {duplicates}")
    for spec in specs:
        if spec.is_full:
            runs.append((spec.name, spec, None, spec.policy))
            continue
        for budget in budgets if budgets else [spec.policy.budget]:
            try:
                policy = spec.policy.replace(budget=budget)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"recipe {spec.name!r} ({spec.source}) cannot run at budget {budget_label(budget)}: {error}"
                ) from None
            runs.append((f"{spec.name}@{budget_label(budget)}", spec, budget, policy))
    return runs


def evaluate(
    model,
    tokenizer,
    specs: Sequence[PolicySpec],
    task: str,
    budgets: Sequence[int | float | None] | None = None,
    task_options: Mapping | None = None,
    batch_size: int | None = None,
    devices: int = 1,
    threads: int | None = None,
    progress: bool = True,
    seed: int = 0,
    model_name: str = "",
    keep_examples: bool = True,
    compile: bool = False,
) -> dict:
    """Evaluate every recipe x budget on ``task``; returns the results dictionary (see ``report``).
    ``compile=True`` runs every policy's decode step compiled (``evictlayers.apply(..., compile=True)``)."""
    from evictlayers.eval.module import PolicyEvaluator, run_test
    from evictlayers.eval.suite import make_task

    if not specs:
        raise ValueError("no recipes to evaluate")
    evaluation = make_task(task, tokenizer, **dict(task_options or {}))
    evaluation.check_model(model)
    evaluation.compile = compile
    runs = expand_budgets(specs, budgets)
    batch_size = batch_size or DEFAULT_BATCH.get(task, 1)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    evaluator = PolicyEvaluator(model, evaluation, {label: policy for label, _, _, policy in runs}, threads=threads)
    started = time.perf_counter()
    summaries, records = run_test(evaluator, batch_size=batch_size, devices=devices, progress=progress, seed=seed)
    wall = time.perf_counter() - started
    results = []
    for label, spec, budget, _ in runs:
        examples = [{k: v for k, v in r.items() if k != "histogram"} for r in records[label]]
        results.append(
            {
                "label": label,
                "policy": spec.name,
                "recipe": spec.source,
                "budget": budget,
                "full_cache": spec.is_full,
                **summaries[label],
                **({"examples": examples} if keep_examples else {}),
            }
        )
    return {
        "task": evaluation.name,
        "score_name": evaluation.score_name,
        "higher_is_better": evaluation.higher_is_better,
        "model": model_name,
        "settings": evaluation.settings(),
        "n_examples": len(evaluation.rows()),
        "budgets": list(budgets) if budgets else None,
        "batch_size": batch_size,
        "devices": devices,
        "threads": threads,
        "compile": compile,
        "seed": seed,
        "wall_seconds": wall,
        "runs": results,
    }
