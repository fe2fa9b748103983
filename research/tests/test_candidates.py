"""The recipe search's candidates (research/candidates/): every file loads and survives a dump and a
reload, and the shipped retrieval recipes are the candidates the tuning split chose, as the reports
(research/reports/retrieval.md, retrieval-8.md) name them by file."""

from __future__ import annotations

from pathlib import Path

import pytest

import evictlayers as el

CANDIDATES_DIR = Path(__file__).resolve().parents[1] / "candidates"
CANDIDATES = sorted(CANDIDATES_DIR.rglob("*.yaml"))


def test_the_candidates_are_there():
    """An empty directory would leave the round trip below with nothing to check."""
    assert CANDIDATES and any(p.parent.name == "gemma-3-270m" for p in CANDIDATES), CANDIDATES_DIR


@pytest.mark.parametrize("path", CANDIDATES, ids=lambda p: str(p.relative_to(CANDIDATES_DIR).with_suffix("")))
def test_every_candidate_loads_and_round_trips(path, tmp_path):
    policy = el.load_recipe(path)
    assert isinstance(policy, el.Policy)
    el.dump_recipe(policy, tmp_path / "again.yaml")
    assert el.load_recipe(tmp_path / "again.yaml") == policy


def test_the_shipped_retrieval_recipe_is_the_candidate_the_tuning_split_chose():
    """research/reports/retrieval.md reports the search candidate by its file name; the shipped recipe must be it."""
    assert el.load_recipe("tova_keydiff_chunked") == el.load_recipe(
        CANDIDATES_DIR / "tova_keydiff_chunk5_by_kind25_sliding_h2o.yaml")
    assert el.load_recipe("tova_keydiff_induction") == el.load_recipe(
        CANDIDATES_DIR / "tova_keydiff_chunk5_induction50.yaml")
