"""Recipe YAML: the declarative twin of a ``Policy``.

A recipe maps straight onto constructors (torchtune style): every component is a mapping whose
``_component_`` key names the class and whose other keys are its constructor arguments::

    budget: 0.2            # int tokens per head, float fraction of the prompt, or null (full cache)
    drop: 1                # optional: tokens evicted at once (int) or a fraction of the budget (float)
    allocation:            # optional: Uniform (default), Ramp, Pyramid, ByLayerKind or Induction
      _component_: Ramp
      spread: 0.5
    gqa_reduce: sum        # optional
    positions: absolute    # optional: absolute (default) or rolling (re-positioned inside the cache)
    storage:               # optional: DenseKV (default) or QuantizedKV(bits, group, residual)
      _component_: QuantizedKV
      bits: 4
    modules:
      - _component_: RecentWindow
        size: 0.5
      - _component_: HeavyHitterSelector
        accumulator:
          _component_: Cumulative
    sliding_modules:       # optional: the sliding-window layers' own modules (Policy(sliding_modules=...))
      - _component_: RecentWindow

Loading validates the whole file and reports every problem at once, each with the file, the key path
and what was expected. ``dump_recipe`` writes a policy that ``load_recipe`` reads back equal.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import yaml

from evictlayers.compose.allocation import ByLayerKind, Induction, Pyramid, Ramp, Uniform
from evictlayers.compose.policy import Policy
from evictlayers.core import Component
from evictlayers.modules import (
    ClusterSketch,
    DenseKV,
    HeavyHitterSelector,
    KCenterSelector,
    QuantizedKV,
    RecentWindow,
    SinkTokens,
)
from evictlayers.scoring import (
    Averaged,
    CrossLayer,
    Cumulative,
    KeyDiff,
    KeyNorm,
    LowScoreCounter,
    RecentThenCumulative,
    StepGainSoftmax,
    ValuePrior,
    Windowed,
)

COMPONENTS: dict[str, type[Component]] = {
    cls.__name__: cls
    for cls in (
        RecentWindow, SinkTokens, HeavyHitterSelector, Cumulative, Averaged, Uniform, Ramp, Pyramid, ByLayerKind,
        Induction, Windowed, LowScoreCounter, StepGainSoftmax, ValuePrior, DenseKV, QuantizedKV, ClusterSketch,
        RecentThenCumulative, KeyDiff, KeyNorm, KCenterSelector, CrossLayer,
    )
}
# arguments a component no longer takes, with what replaced them (recipes written before keep failing clearly)
MOVED_ARGUMENTS = {
    ("ClusterSketch", "mode"): (
        "ClusterSketch is the stream sketch only (drop `mode: stream`); `mode: kcenter` is now "
        "`_component_: KCenterSelector` (with its `centres`)"
    ),
    ("ClusterSketch", "centres"): "k-center's centres belong to `_component_: KCenterSelector`",
}
POLICY_KEYS = ("budget", "modules", "drop", "allocation", "gqa_reduce", "storage", "positions", "sliding_modules")


class RecipeError(ValueError):
    """A recipe that does not describe a valid Policy; ``problems`` lists every finding."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: {len(problems)} problem(s) in recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def _build(node: Any, where: str, problems: list[str]) -> Any:
    """Build the component described by ``node``, appending every problem found to ``problems``."""
    if not isinstance(node, dict) or "_component_" not in node:
        problems.append(f"{where}: expected a mapping with a `_component_` key naming one of {sorted(COMPONENTS)}")
        return None
    name = node["_component_"]
    cls = COMPONENTS.get(name)
    if cls is None:
        problems.append(f"{where}._component_: unknown component {name!r}; allowed: {', '.join(sorted(COMPONENTS))}")
        return None
    allowed = [p for p in inspect.signature(cls).parameters if p != "self"]
    kwargs, ok = {}, True
    for key, value in node.items():
        if key == "_component_":
            continue
        if (name, key) in MOVED_ARGUMENTS:
            problems.append(f"{where}.{key}: {MOVED_ARGUMENTS[name, key]}")
            ok = False
            continue
        if key not in allowed:
            problems.append(f"{where}.{key}: unknown argument of {name}; allowed: {', '.join(allowed) or 'none'}")
            ok = False
            continue
        if isinstance(value, dict):
            value = _build(value, f"{where}.{key}", problems)
            ok = ok and value is not None
        kwargs[key] = value
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        problems.append(f"{where}: {error}")
        return None


def policy_from_dict(data: Any, source: str = "<recipe>") -> Policy:
    """Build a Policy from a parsed recipe; raises ``RecipeError`` listing every problem."""
    if not isinstance(data, dict):
        raise RecipeError(source, [f"top level: expected a mapping with keys {', '.join(POLICY_KEYS)}"])
    problems = [
        f"{key}: unknown key; allowed: {', '.join(POLICY_KEYS)}" for key in data if key not in POLICY_KEYS
    ]
    modules = _build_list(data.get("modules", []), "modules", problems)
    sliding_modules = (
        _build_list(data["sliding_modules"], "sliding_modules", problems) if data.get("sliding_modules") is not None
        else None
    )
    allocation = _build(data["allocation"], "allocation", problems) if data.get("allocation") is not None else None
    storage = _build(data["storage"], "storage", problems) if data.get("storage") is not None else None
    if problems:
        raise RecipeError(source, problems)
    try:
        return Policy(
            *modules,
            budget=data.get("budget"),
            drop=data.get("drop", 1),
            allocation=allocation,
            gqa_reduce=data.get("gqa_reduce", "sum"),
            storage=storage,
            positions=data.get("positions", "absolute"),
            sliding_modules=sliding_modules,
        )
    except (TypeError, ValueError) as error:
        raise RecipeError(source, [f"policy: {error}"]) from None


def _build_list(node: Any, key: str, problems: list[str]) -> list:
    """The components of a list key (``modules``, ``sliding_modules``); a problem noted when it is no list."""
    if node is None:
        return []
    if not isinstance(node, list):
        problems.append(f"{key}: expected a list of components")
        return []
    return [_build(item, f"{key}[{i}]", problems) for i, item in enumerate(node)]


def _component_dict(component: Component) -> dict[str, Any]:
    node: dict[str, Any] = {"_component_": type(component).__name__}
    for key, value in component.params().items():
        node[key] = _component_dict(value) if isinstance(value, Component) else value
    return node


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """The recipe mapping of ``policy`` (inverse of ``policy_from_dict``)."""
    return {
        "budget": policy.budget,
        "drop": policy.drop,
        "allocation": _component_dict(policy.allocation),
        "gqa_reduce": policy.gqa_reduce,
        "storage": _component_dict(policy.storage),
        "positions": policy.positions,
        "modules": [_component_dict(m) for m in policy.modules_in_order],
        # only when given, so a recipe without it dumps as before
        **({} if policy.sliding is None else {
            "sliding_modules": [_component_dict(m) for m in policy.sliding.modules_in_order]}),
    }


SHIPPED_RECIPES = Path(__file__).resolve().parent.parent / "recipes"  # package data: inside the wheel


def shipped_recipes() -> list[str]:
    """Names of the recipes that ship with evictlayers (``evictlayers/recipes/*.yaml``)."""
    return sorted(p.stem for p in SHIPPED_RECIPES.glob("*.yaml"))


def load_recipe(recipe: str | Path) -> Policy:
    """Read a recipe into a Policy: a YAML file path, or the name of a shipped recipe (``"h2o"``)."""
    path = Path(recipe)
    is_name = isinstance(recipe, str) and not recipe.endswith((".yaml", ".yml")) and "/" not in recipe
    if is_name and not path.is_file():
        path = SHIPPED_RECIPES / f"{recipe}.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"recipe {recipe} does not exist: give a YAML file path or a shipped recipe name "
            f"({', '.join(shipped_recipes())})"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RecipeError(str(path), [f"not valid YAML: {error}"]) from None
    return policy_from_dict(data, source=str(path))


def dump_recipe(policy: Policy, path: str | Path | None = None) -> str:
    """The YAML text of ``policy``; also written to ``path`` when given."""
    text = yaml.safe_dump(policy_to_dict(policy), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text
