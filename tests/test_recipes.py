"""Recipes: every shipped file loads, round-trips, and bad files fail with every problem named."""

from pathlib import Path

import pytest

import evictlayers as el

RECIPES = sorted((Path(el.__file__).parent / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    assert {p.stem for p in RECIPES} >= {"full", "local", "streaming_llm", "h2o"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_round_trips(path, tmp_path):
    policy = el.load_recipe(path)
    assert isinstance(policy, el.Policy)
    el.dump_recipe(policy, tmp_path / "again.yaml")
    assert el.load_recipe(tmp_path / "again.yaml") == policy


def test_h2o_recipe_is_the_papers_split():
    expected = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.2)
    assert el.load_recipe("h2o") == expected == el.load_recipe(Path(el.__file__).parent / "recipes" / "h2o.yaml")


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
