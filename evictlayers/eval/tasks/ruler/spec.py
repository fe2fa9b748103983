"""What each RULER synthetic task is: its family, its complexity settings and how much it generates.

The table follows RULER's task configuration (Hsieh et al. 2024, "RULER: What's the Real Context Size
of Your Long-Context Language Models?", ``scripts/synthetic.yaml`` and the per-family
``tokens_to_generate`` of ``scripts/data/synthetic/constants.py``). The names are RULER's.

Left out: RULER's two QA tasks (``qa_1`` on SQuAD, ``qa_2`` on HotpotQA) build their haystacks from
those datasets' paragraphs, which cannot be downloaded here; they are not generated, and the average
score is over the synthetic tasks only (RULER's average includes QA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["GROUPS", "LEFT_OUT", "TASKS", "TaskSpec", "group_of"]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One RULER task: ``family`` (``niah``, ``vt``, ``cwe``, ``fwe``), its settings, the tokens RULER
    lets the model generate (also reserved out of the context length), and the metric's name."""

    name: str
    family: str
    args: Mapping[str, object]
    tokens_to_generate: int
    metric: str = "string_match_all"

    @property
    def needs_books(self) -> bool:
        """Whether generating it reads the PG-19 books (essay haystacks, word keys, word lists)."""
        if self.family == "niah":
            return self.args["haystack"] == "essay" or self.args["key"] == "words"
        return self.family == "cwe"


def _niah(name: str, haystack: str, key: str = "words", value: str = "numbers", k: int = 1, v: int = 1,
          q: int = 1) -> TaskSpec:
    args = {"haystack": haystack, "key": key, "value": value, "num_keys": k, "num_values": v, "num_queries": q}
    return TaskSpec(name, "niah", args, 128)


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _niah("niah_single_1", "noise"),
        _niah("niah_single_2", "essay"),
        _niah("niah_single_3", "essay", value="uuids"),
        _niah("niah_multikey_1", "essay", k=4),
        _niah("niah_multikey_2", "needle"),
        _niah("niah_multikey_3", "needle", key="uuids", value="uuids"),
        _niah("niah_multivalue", "essay", v=4),
        _niah("niah_multiquery", "essay", q=4),
        TaskSpec("vt", "vt", {"num_chains": 1, "num_hops": 4}, 30),
        TaskSpec("cwe", "cwe", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}, 120),
        TaskSpec("fwe", "fwe", {"alpha": 2.0, "coded_wordlen": 6}, 50),
    )
}

LEFT_OUT = {"qa_1": "SQuAD paragraphs (not downloadable here)", "qa_2": "HotpotQA paragraphs (not downloadable here)"}

# RULER's categories (paper, Sec. 3): retrieval, multi-hop tracing, aggregation (QA left out)
GROUPS: dict[str, tuple[str, ...]] = {
    "retrieval": tuple(n for n in TASKS if n.startswith("niah")),
    "multi-hop tracing": ("vt",),
    "aggregation": ("cwe", "fwe"),
}


def group_of(task: str) -> str:
    return next(g for g, names in GROUPS.items() if task in names)
