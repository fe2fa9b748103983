"""Recipes: every shipped file loads, round-trips, and bad files fail with every problem named.

The round trip is judged against the YAML text itself: the mapping ``dump_recipe`` writes for a loaded
recipe must be the mapping ``yaml.safe_load`` reads from the shipped file, up to what the recipe format
(``evictlayers/compose/recipes.py``) documents as equivalent: an optional key or constructor argument
left out means its default, and ``LowScoreCounter``'s ``"1/t"`` threshold ignores spaces.
"""

import inspect
from pathlib import Path

import pytest
import yaml

import evictlayers as el

RECIPES_DIR = Path(el.__file__).parent / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))

# the optional top-level keys and what leaving them out means (compose/recipes.py docstring, Policy's
# signature); `budget` and `modules` are always written
POLICY_DEFAULTS = {
    "min_budget": 32,
    "drop": 1,
    "allocation": {"_component_": "Uniform"},
    "gqa_reduce": "sum",
    "storage": {"_component_": "DenseKV"},
    "positions": "absolute",
}


def _normalised_component(node: dict) -> dict:
    """``node`` with every constructor argument it leaves out set to the constructor's default
    ("every component is a mapping whose ``_component_`` key names the class and whose other keys are
    its constructor arguments"), nested components likewise."""
    cls = getattr(el, node["_component_"])
    out = {"_component_": node["_component_"]}
    for name, parameter in inspect.signature(cls).parameters.items():
        if name in node:
            value = node[name]
        elif parameter.default is not inspect.Parameter.empty:
            value = parameter.default
        else:
            continue  # a required argument the node lacks: left missing, so the comparison fails
        if isinstance(value, dict):
            value = _normalised_component(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(item, dict) for item in value):
            value = [_normalised_component(item) for item in value]  # a list of components (refine), or []
        if cls is el.LowScoreCounter and name == "threshold" and isinstance(value, str):
            value = value.replace(" ", "")  # LowScoreCounter: "1 / t" and "1/t" are the same threshold
        out[name] = value
    unknown = set(node) - set(out)
    assert not unknown, f"{node['_component_']} has keys that are no constructor arguments: {sorted(unknown)}"
    return out


def _normalised(recipe: dict) -> dict:
    out = {**POLICY_DEFAULTS, **recipe}
    for key in ("allocation", "storage"):
        out[key] = _normalised_component(out[key])
    out["modules"] = [_normalised_component(m) for m in out.get("modules") or []]
    if out.get("sliding_modules") is not None:
        out["sliding_modules"] = [_normalised_component(m) for m in out["sliding_modules"]]
    return out


def _typed(value):
    """``value`` with every scalar tagged by its type, so that 32 and 32.0, or 1 and True, differ."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    return (type(value).__name__, value)


def test_recipes_are_shipped():
    assert {p.stem for p in RECIPES} >= {"full", "local", "streaming_llm", "h2o"}
    assert el.compose.recipes.shipped_recipes() == [p.stem for p in RECIPES]


def test_normalisation_fills_only_documented_defaults():
    """The comparison below is only as good as this helper: it must not hide a real difference."""
    assert _normalised({"budget": 0.2, "modules": [{"_component_": "RecentWindow"}]}) == {
        "budget": 0.2, "min_budget": 32, "drop": 1, "allocation": {"_component_": "Uniform"}, "gqa_reduce": "sum",
        "storage": {"_component_": "DenseKV"}, "positions": "absolute",
        "modules": [{"_component_": "RecentWindow", "size": None}],
    }
    selector = {"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Windowed"},
                "refine": [{"_component_": "PooledScores", "window": 5}, {"_component_": "LayerScope"}]}
    assert _normalised_component(selector) == {
        "_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Windowed", "rows": 32, "reduce": "sum"},
        "transform": None, "prior": None, "share": None, "refine": [
            {"_component_": "PooledScores", "window": 5, "reduce": "mean", "side": "both"},
            {"_component_": "LayerScope", "reduce": "mean"}],
    }
    assert _normalised_component({"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "KeyDiff"}})[
        "refine"] == []
    assert _typed({"size": 32}) != _typed({"size": 32.0})
    with pytest.raises(AssertionError, match="no constructor arguments"):
        _normalised_component({"_component_": "RecentWindow", "window": 3})


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_recipe_dumps_what_its_yaml_file_says(path, tmp_path):
    """Load a shipped file, dump it, and compare the dumped YAML with the file's own
    YAML; then read the dump back and dump again: still the file's mapping."""
    written = _typed(_normalised(yaml.safe_load(path.read_text())))
    policy = el.load_recipe(path)
    assert isinstance(policy, el.Policy)
    dumped = yaml.safe_load(el.dump_recipe(policy, tmp_path / "again.yaml"))
    assert _typed(_normalised(dumped)) == written
    again = yaml.safe_load(el.dump_recipe(el.load_recipe(tmp_path / "again.yaml")))
    assert _typed(_normalised(again)) == written
    by_name = yaml.safe_load(el.dump_recipe(el.load_recipe(path.stem)))  # the shipped name finds the file
    assert _typed(_normalised(by_name)) == written


def test_h2o_recipe_is_the_papers_split():
    """H2O Appendix A at 20%: half the budget the most recent tokens, half heavy hitters by cumulative
    attention; nothing else set."""
    papers = {"budget": 0.2, "modules": [
        {"_component_": "RecentWindow", "size": 0.5},
        {"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Cumulative"}},
    ]}
    dumped = yaml.safe_load(el.dump_recipe(el.load_recipe("h2o")))
    assert _typed(_normalised(dumped)) == _typed(_normalised(papers))
    hand_built = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.2)
    assert _typed(_normalised(yaml.safe_load(el.dump_recipe(hand_built)))) == _typed(_normalised(papers))


def test_bad_recipe_reports_every_problem_with_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "budget: 0.2\nwindow: 3\nmodules:\n"
        "  - _component_: RecentWindo\n"
        "  - _component_: HeavyHitterSelector\n    accumulator:\n      _component_: Cumulative\n      decay: 0.9\n"
        "  - _component_: SinkTokens\n    count: 0\n"
    )
    with pytest.raises(el.RecipeError) as error:
        el.load_recipe(path)
    text = str(error.value)
    assert str(path) in text
    assert "window: unknown key; allowed: budget, modules, drop, allocation, gqa_reduce" in text
    assert "modules[0]._component_: unknown component 'RecentWindo'; allowed:" in text and "RecentWindow" in text
    assert "modules[1].accumulator.decay: unknown argument of Cumulative" in text
    assert "modules[2]: SinkTokens(count=0): count must be an int >= 1" in text
    assert len(error.value.problems) == 4


def test_bad_budget_in_recipe_is_reported(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("budget: 1.5\nmodules: []\n")
    with pytest.raises(el.RecipeError, match=r"b.yaml.*\n.*policy: Policy\(budget=1.5\): a float budget"):
        el.load_recipe(path)


def test_missing_recipe_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml does not exist"):
        el.load_recipe("nope.yaml")
