"""Recipe YAML: the declarative twin of a ``Policy``.

A recipe maps straight onto constructors (torchtune style): every component is a mapping whose
``_component_`` key names the class and whose other keys are its constructor arguments::

    budget: 0.2            # int tokens per head, float fraction of the prompt, or null (full cache)
    min_budget: 32         # optional: the fewest tokens per head a float budget resolves to
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
        refine:            # optional: score refinements, applied in this order
          - _component_: PooledScores
            window: 5
    sliding_modules:       # optional: the sliding-window layers' own modules (Policy(sliding_modules=...))
      - _component_: RecentWindow

Loading validates the whole file and reports every problem at once, each with the file, the key path
and what was expected. ``dump_recipe`` writes a policy that ``load_recipe`` reads back equal. The mapping
between this data and the components is ``compose/recipe_mapping.py``'s; a ``HeavyHitterSelector``
written with the options from before ``refine`` (``pool: 5``, ``pool_reduce``, ``pool_side``,
``chunk: 5`` or ``chunk: sentence``, ``sentence_cap``, ``chunk_reduce``, ``scope: layer``,
``scope_reduce``) loads as the ``refine`` list they stand for, and dumps in the current form.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from evictlayers.compose.policy import Policy, policy_from_dict, policy_to_dict
from evictlayers.compose.recipe_mapping import RecipeError, upgrade_recipe

__all__ = [
    "RecipeError", "SHIPPED_RECIPES", "dump_recipe", "load_recipe", "policy_from_dict", "policy_to_dict",
    "shipped_recipes", "upgrade_recipe",
]

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
