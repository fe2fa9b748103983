"""The recipe mapping: a Policy's settings as plain data (mappings, lists, scalars) and back.

A recipe maps straight onto constructors (torchtune style): every component is a mapping whose
``_component_`` key names the class and whose other keys are its constructor arguments; a list of such
mappings is a list of components. This module turns that data into the Policy's constructor arguments
(reporting every problem at once) and a policy back into data, without importing ``Policy`` itself, so
``compose/policy.py`` (``Policy.replace``) and ``compose/recipes.py`` (the YAML files) both build on it.
"""

from __future__ import annotations

import inspect
from typing import Any

from evictlayers.compose.allocation import ByLayerKind, Induction, Pyramid, Ramp, Uniform
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
from evictlayers.modules.heavy_hitter_options import OPTION_DEFAULTS, refinement_arguments
from evictlayers.scoring import (
    Averaged,
    ChunkScores,
    ContextReconstruction,
    CrossLayer,
    Cumulative,
    ExpectedAttention,
    KeyDiff,
    KeyNorm,
    LayerScope,
    LowScoreCounter,
    PooledScores,
    RecentThenCumulative,
    SentenceScores,
    StepGainSoftmax,
    ValuePrior,
    Windowed,
)

COMPONENTS: dict[str, type[Component]] = {
    cls.__name__: cls
    for cls in (
        RecentWindow, SinkTokens, HeavyHitterSelector, Cumulative, Averaged, Uniform, Ramp, Pyramid, ByLayerKind,
        Induction, Windowed, LowScoreCounter, StepGainSoftmax, ValuePrior, DenseKV, QuantizedKV, ClusterSketch,
        RecentThenCumulative, KeyDiff, KeyNorm, KCenterSelector, CrossLayer, PooledScores, ChunkScores,
        SentenceScores, LayerScope, ExpectedAttention, ContextReconstruction,
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
POLICY_KEYS = (
    "budget", "modules", "drop", "allocation", "gqa_reduce", "storage", "positions", "sliding_modules", "min_budget",
)
# Policy's scalar keyword arguments; a recipe that leaves one out gets the constructor's default
POLICY_SETTINGS = ("drop", "gqa_reduce", "positions", "min_budget")


class RecipeError(ValueError):
    """A recipe that does not describe a valid Policy; ``problems`` lists every finding."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: {len(problems)} problem(s) in recipe:\n" + "\n".join(f"  - {p}" for p in problems))


def upgrade_selector(node: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """A ``HeavyHitterSelector`` mapping written with the options from before ``refine`` (``pool: 5``,
    ``chunk: sentence``, ``scope: layer``, ...) rewritten with the ``refine`` list they stand for, in the
    order the selector applied them (pooling, chunks, the layer's scope); any other mapping as it is.
    A problem (a bad old value, old options beside a ``refine`` key) is appended to ``problems``."""
    old = {key: node[key] for key in OPTION_DEFAULTS if key in node}
    if node.get("_component_") != "HeavyHitterSelector" or not old:
        return node
    upgraded = {key: value for key, value in node.items() if key not in old}
    if "refine" in node:
        problems.append(f"{where}: give either `refine` or the options it replaced ({', '.join(old)}), not both")
        return upgraded
    try:
        specs = refinement_arguments(old)
    except ValueError as error:
        problems.append(f"{where}: {error}")
        return upgraded
    refine, valid = [], True
    for option, cls, arguments in specs:
        try:  # built here too, so that a bad value is named by the option the file wrote
            cls(**arguments)
        except (TypeError, ValueError) as error:
            problems.append(f"{where}.{option}: {error}")
            valid = False
        refine.append({"_component_": cls.__name__, **arguments})
    if refine and valid:
        upgraded["refine"] = refine
    return upgraded


def upgrade_recipe(data: dict[str, Any], source: str = "<recipe>") -> dict[str, Any]:
    """``data`` (a parsed recipe) with every ``HeavyHitterSelector`` written in the current form
    (``upgrade_selector``), so that a file in either form compares to a dump.

    Raises:
        RecipeError: an old option's value is bad (every problem, under ``source``).
    """
    problems: list[str] = []
    out = dict(data)
    for key in ("modules", "sliding_modules"):
        if isinstance(data.get(key), list):
            out[key] = [upgrade_selector(node, f"{key}[{i}]", problems) if isinstance(node, dict) else node
                        for i, node in enumerate(data[key])]
    if problems:
        raise RecipeError(source, problems)
    return out


def build_component(node: Any, where: str, problems: list[str]) -> Any:
    """Build the component described by ``node``, appending every problem found to ``problems``; ``None``
    when there was one."""
    if not isinstance(node, dict) or "_component_" not in node:
        problems.append(f"{where}: expected a mapping with a `_component_` key naming one of {sorted(COMPONENTS)}")
        return None
    name = node["_component_"]
    cls = COMPONENTS.get(name)
    if cls is None:
        problems.append(f"{where}._component_: unknown component {name!r}; allowed: {', '.join(sorted(COMPONENTS))}")
        return None
    node = upgrade_selector(node, where, problems)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    allowed = [n for n, p in inspect.signature(cls).parameters.items() if n != "self" and p.kind not in variadic]
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
            value = build_component(value, f"{where}.{key}", problems)
            ok = ok and value is not None
        elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
            value = [build_component(item, f"{where}.{key}[{i}]", problems) for i, item in enumerate(value)]
            ok = ok and all(item is not None for item in value)
        kwargs[key] = value
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        problems.append(f"{where}: {error}")
        return None


def _component_list(node: Any, key: str, problems: list[str]) -> list:
    """The components of a list key (``modules``, ``sliding_modules``); a problem noted when it is no list."""
    if node is None:
        return []
    if not isinstance(node, list):
        problems.append(f"{key}: expected a list of components")
        return []
    return [build_component(item, f"{key}[{i}]", problems) for i, item in enumerate(node)]


def policy_arguments(data: Any, source: str = "<recipe>") -> tuple[list[Component], dict[str, Any]]:
    """``(modules, keyword arguments)`` of the Policy a parsed recipe describes.

    Raises:
        RecipeError: every problem found, each with its key path, under ``source``.
    """
    if not isinstance(data, dict):
        raise RecipeError(source, [f"top level: expected a mapping with keys {', '.join(POLICY_KEYS)}"])
    problems = [
        f"{key}: unknown key; allowed: {', '.join(POLICY_KEYS)}" for key in data if key not in POLICY_KEYS
    ]
    modules = _component_list(data.get("modules", []), "modules", problems)
    sliding_modules = (
        _component_list(data["sliding_modules"], "sliding_modules", problems)
        if data.get("sliding_modules") is not None else None
    )
    allocation, storage = (
        build_component(data[key], key, problems) if data.get(key) is not None else None
        for key in ("allocation", "storage")
    )
    if problems:
        raise RecipeError(source, problems)
    settings = {key: data[key] for key in POLICY_SETTINGS if key in data}
    return modules, {"budget": data.get("budget"), "allocation": allocation, "storage": storage,
                     "sliding_modules": sliding_modules, **settings}


def component_mapping(component: Component) -> dict[str, Any]:
    """The recipe mapping of ``component`` (inverse of ``build_component``)."""
    node: dict[str, Any] = {"_component_": type(component).__name__}
    for key, value in component.params().items():
        if isinstance(value, Component):
            value = component_mapping(value)
        elif isinstance(value, list) and any(isinstance(item, Component) for item in value):
            value = [component_mapping(item) for item in value]
        node[key] = value
    return node


def policy_mapping(policy: Any) -> dict[str, Any]:
    """The recipe mapping of ``policy`` (a ``Policy``; inverse of ``policy_arguments``)."""
    floor = inspect.signature(type(policy)).parameters["min_budget"].default
    return {
        "budget": policy.budget,
        # only when it differs from the default, so a recipe without it dumps as before
        **({} if policy.min_budget == floor else {"min_budget": policy.min_budget}),
        "drop": policy.drop,
        "allocation": component_mapping(policy.allocation),
        "gqa_reduce": policy.gqa_reduce,
        "storage": component_mapping(policy.storage),
        "positions": policy.positions,
        "modules": [component_mapping(m) for m in policy.modules_in_order],
        # only when given, so a recipe without it dumps as before
        **({} if policy.sliding is None else {
            "sliding_modules": [component_mapping(m) for m in policy.sliding.modules_in_order]}),
    }
