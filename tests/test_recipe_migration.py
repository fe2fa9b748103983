"""HeavyHitterSelector's options from before ``refine`` (``pool``, ``chunk``, ``scope`` and their
companions) still describe the same selector: a recipe written with them loads to the Policy written with
the refinement components, the keyword arguments build it with one ``DeprecationWarning``, the shipped
recipes' previous texts (tests/recipes_before_refine.yaml) load to what the files load to now, and every
recipe-search candidate, wherever it lives, loads."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

import evictlayers as el
from evictlayers.compose.recipes import RecipeError, policy_from_dict, policy_to_dict, upgrade_recipe

ROOT = Path(__file__).resolve().parents[1]
BEFORE = yaml.safe_load((Path(__file__).parent / "recipes_before_refine.yaml").read_text())
# the search's candidates, written with the old options; the folder they lived in and the one they move to
CANDIDATE_DIRS = (ROOT / "evictlayers" / "eval" / "candidates", ROOT / "research" / "candidates")
CANDIDATES = sorted(path for folder in CANDIDATE_DIRS for path in folder.rglob("*.yaml"))
OLD_KEYS = {"pool", "pool_reduce", "pool_side", "chunk", "sentence_cap", "chunk_reduce", "scope", "scope_reduce"}

# each old spelling and the refine list that says the same, in the order the selector applied the options
SPELLINGS = [
    ({"pool": 5}, lambda: [el.PooledScores(5)]),
    ({"pool": 8, "pool_side": "before", "pool_reduce": "max"}, lambda: [el.PooledScores(8, "max", "before")]),
    ({"chunk": 10}, lambda: [el.ChunkScores(10)]),
    ({"chunk": 5, "chunk_reduce": "mean"}, lambda: [el.ChunkScores(5, reduce="mean")]),
    ({"chunk": "sentence"}, lambda: [el.SentenceScores()]),
    ({"chunk": "sentence", "sentence_cap": 64, "chunk_reduce": "mean"}, lambda: [el.SentenceScores(64, "mean")]),
    ({"scope": "layer"}, lambda: [el.LayerScope()]),
    ({"scope": "layer", "scope_reduce": "max"}, lambda: [el.LayerScope("max")]),
    ({"scope": "layer", "chunk": 5, "pool": 7}, lambda: [el.PooledScores(7), el.ChunkScores(5), el.LayerScope()]),
    ({"pool": 1, "chunk": 1, "scope": "head"}, lambda: []),
]
SPELLING_IDS = [",".join(f"{k}={v}" for k, v in old.items()) for old, _ in SPELLINGS]


def _keys(node) -> set[str]:
    """Every mapping key anywhere in ``node``."""
    if isinstance(node, dict):
        return set(node) | {key for value in node.values() for key in _keys(value)}
    if isinstance(node, list):
        return {key for item in node for key in _keys(item)}
    return set()


def _recipe(**selector_options) -> dict:
    return {"budget": 0.2, "modules": [
        {"_component_": "SinkTokens", "count": 4},
        {"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "KeyDiff"}, **selector_options},
    ]}


@pytest.mark.parametrize("old,refine", SPELLINGS, ids=SPELLING_IDS)
def test_old_recipe_keys_load_to_the_refine_list_without_a_warning(old, refine):
    expected = el.Policy(el.SinkTokens(4), el.HeavyHitterSelector(el.KeyDiff(), refine=refine()), budget=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        loaded = policy_from_dict(_recipe(**old))
    assert loaded == expected
    assert loaded.reads_sentences == (old.get("chunk") == "sentence")  # the store tracks sentences for these
    dumped = policy_to_dict(loaded)
    assert not _keys(dumped) & OLD_KEYS  # a dump is written in the current form
    assert policy_from_dict(dumped) == expected
    upgraded = upgrade_recipe(_recipe(**old))
    assert not _keys(upgraded) & OLD_KEYS and policy_from_dict(upgraded) == expected


@pytest.mark.parametrize("old,refine", SPELLINGS, ids=SPELLING_IDS)
def test_old_keyword_arguments_warn_once_and_build_the_same_selector(old, refine):
    with pytest.warns(DeprecationWarning) as caught:
        selector = el.HeavyHitterSelector(el.KeyDiff(), **old)
    assert len(caught) == 1
    assert "is deprecated: write HeavyHitterSelector(..., refine=[" in str(caught[0].message)
    assert caught[0].filename == __file__  # it points at the caller
    assert selector == el.HeavyHitterSelector(el.KeyDiff(), refine=refine())


def test_old_options_beside_a_refine_list_are_refused():
    with pytest.raises(ValueError, match=r"HeavyHitterSelector\(chunk=5\) and refine=.*give the refine list only"):
        el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope()], chunk=5)
    recipe = _recipe(chunk=5, refine=[{"_component_": "LayerScope"}])
    with pytest.raises(RecipeError, match=r"modules\[1\]: give either `refine` or the options it replaced \(chunk\)"):
        policy_from_dict(recipe)


@pytest.mark.parametrize(
    "old,message",
    [
        ({"pool": 4}, r"modules\[1\]\.pool: PooledScores\(window=4\): with side='both' the width must be an odd int"),
        ({"pool": 0}, r"modules\[1\]: HeavyHitterSelector\(pool=0\): the pooling width must be an int >= 1"),
        ({"pool_side": "before"}, r"modules\[1\]: HeavyHitterSelector\(pool_side='before'\) .* it needs pool >= 2"),
        ({"pool": 5, "pool_reduce": "median"}, r"modules\[1\]\.pool: PooledScores\(reduce='median'\)"),
        ({"chunk": "paragraph"}, r"HeavyHitterSelector\(chunk='paragraph'\): .* or 'sentence'"),
        ({"chunk": 5, "sentence_cap": 8}, r"HeavyHitterSelector\(sentence_cap=8\) .* it needs chunk='sentence'"),
        ({"chunk_reduce": "mean"}, r"HeavyHitterSelector\(chunk_reduce='mean'\) .* it needs chunk >= 2"),
        ({"chunk": "sentence", "sentence_cap": 0}, r"modules\[1\]\.chunk: SentenceScores\(cap=0\)"),
        ({"scope": "row"}, r"HeavyHitterSelector\(scope='row'\): expected 'head' .* or 'layer'"),
        ({"scope_reduce": "max"}, r"HeavyHitterSelector\(scope_reduce='max'\) .* it needs scope='layer'"),
    ],
    ids=str,
)
def test_bad_old_values_name_the_option(old, message):
    with pytest.raises(RecipeError, match=message) as caught:
        policy_from_dict(_recipe(**old), source="old.yaml")
    assert len(caught.value.problems) == 1 and str(caught.value).startswith("old.yaml")
    with pytest.raises(ValueError, match=message.split(": ", 1)[-1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            el.HeavyHitterSelector(el.KeyDiff(), **old)


def test_an_unknown_keyword_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'pooling'"):
        el.HeavyHitterSelector(el.KeyDiff(), pooling=5)
    with pytest.raises(RecipeError, match=r"modules\[1\]\.pooling: unknown argument of HeavyHitterSelector; allowed: "
                                          r"accumulator, transform, prior, refine, share"):
        policy_from_dict(_recipe(pooling=5))


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_shipped_recipes_previous_text_loads_to_what_its_file_loads_to(name):
    assert name in el.compose.recipes.shipped_recipes()
    assert policy_from_dict(BEFORE[name], source=f"{name} (before refine)") == el.load_recipe(name)


@pytest.mark.parametrize("name", el.compose.recipes.shipped_recipes())
def test_shipped_recipes_are_written_in_the_current_form(name):
    text = yaml.safe_load((el.compose.recipes.SHIPPED_RECIPES / f"{name}.yaml").read_text())
    assert upgrade_recipe(text) == text
    assert not {key for module in text["modules"] if module["_component_"] == "HeavyHitterSelector"
                for key in module} & OLD_KEYS


def test_the_previous_texts_used_the_old_options():
    """The fixture holds what the migration is for: shipped recipes written with the old options."""
    assert {"snapkv", "tova", "tova_keydiff", "tova_keydiff_chunked", "tova_keydiff_induction"} <= {
        name for name, recipe in BEFORE.items() if _keys(recipe) & OLD_KEYS}


@pytest.mark.parametrize("path", CANDIDATES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_search_candidate_loads_through_the_migration(path, tmp_path):
    written = yaml.safe_load(path.read_text())
    policy = el.load_recipe(path)
    assert policy == policy_from_dict(upgrade_recipe(written))
    el.dump_recipe(policy, tmp_path / "again.yaml")
    assert not _keys(yaml.safe_load((tmp_path / "again.yaml").read_text())) & OLD_KEYS
    assert el.load_recipe(tmp_path / "again.yaml") == policy


def test_replace_keeps_the_refinements():
    policy = el.load_recipe("tova_keydiff_chunked")
    changed = policy.replace(budget=0.5)
    assert [m.refine for m in changed.selectors.members] == [m.refine for m in policy.selectors.members]
    assert changed.selectors.members[0].refine == [el.ChunkScores(5), el.LayerScope()]
