"""The experiments behind research/reports/results.md, as data: which task, which recipes, which budgets, which sizes.

Each :class:`Experiment` is run by :func:`research.claims.run.run_experiments` and saved as
``<key>.json``; the verdicts read the runs back by experiment key, policy name and budget.
"""

from __future__ import annotations

import dataclasses

from evictlayers.eval.runner import available_recipes

# Recipes that are ablations rather than shipped policies: H2O Table 9's "w. H2" (heavy hitters only)
INLINE_RECIPES: dict[str, dict] = {
    "h2_only": {
        "budget": 0.2,
        "modules": [{"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Cumulative"}}],
    },
}

SHIPPED = ()  # an experiment whose ``policies`` is SHIPPED runs every recipe in the recipes directory
RETRIEVAL_BUDGETS = (0.1, 0.2, 0.5)
RETRIEVAL_PROMPT_TOKENS = 1000


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One task run with several recipes at several budgets.

    ``key`` names the saved results (``<key>.json``); ``task`` is a task of :func:`evictlayers.eval.suite.make_task`;
    ``policies`` are recipe names (or :data:`SHIPPED`); ``budgets`` are fractions of each prompt, the full
    cache running once whatever the budgets; ``options`` are the task's sizes, ``quick_options`` the tiny
    sizes of ``--quick``.
    """

    key: str
    task: str
    policies: tuple[str, ...]
    budgets: tuple[float, ...]
    options: dict
    quick_options: dict
    batch_size: int


EXPERIMENTS: tuple[Experiment, ...] = (
    # the seed papers' recipes, then those added after them (language modelling beside retrieval)
    Experiment(
        key="stream",
        task="agreement",
        policies=("full", "local", "streaming_llm", "h2o", "h2_only", "h2o_averaged", "scissorhands", "ahakv",
                  "h2o_int4", "scissorhands_int4", "keydiff", "knorm", "snapkv", "tova", "tova_keydiff"),
        budgets=(0.2,),
        options={"n_docs": 4, "doc_tokens": 1025, "chunk": 1},
        quick_options={"n_docs": 2, "doc_tokens": 257, "chunk": 1},
        batch_size=4,
    ),
    Experiment(
        key="passkey",
        task="passkey",
        policies=("full", "local", "streaming_llm", "h2o", "h2o_averaged", "scissorhands", "ahakv",
                  "h2o_int4", "scissorhands_int4"),
        budgets=(0.2, 0.5),
        options={"lengths": [700], "depths": 8},
        quick_options={"lengths": [300], "depths": 2},
        batch_size=8,
    ),
    Experiment(
        key="lines",
        task="lines",
        policies=("full", "local", "streaming_llm", "h2o", "scissorhands", "ahakv", "clustergen"),
        budgets=(0.2, 0.5),
        options={"n_prompts": 16, "n_lines": 10},
        quick_options={"n_prompts": 2, "n_lines": 3},
        batch_size=8,
    ),
    # the retrieval section: every shipped recipe, two haystacks and lines, three budgets
    Experiment(
        key="retrieval_filler",
        task="passkey",
        policies=SHIPPED,
        budgets=RETRIEVAL_BUDGETS,
        options={"lengths": [RETRIEVAL_PROMPT_TOKENS], "depths": 8},
        quick_options={"lengths": [300], "depths": 2},
        batch_size=8,
    ),
    Experiment(
        key="retrieval_prose",
        task="passkey",
        policies=SHIPPED,
        budgets=RETRIEVAL_BUDGETS,
        options={"lengths": [RETRIEVAL_PROMPT_TOKENS], "depths": 8, "haystack": "prose", "chat": True},
        quick_options={"lengths": [300], "depths": 2, "haystack": "prose", "chat": True},
        batch_size=8,
    ),
    Experiment(
        key="retrieval_lines",
        task="lines",
        policies=SHIPPED,
        budgets=RETRIEVAL_BUDGETS,
        options={"n_prompts": 16, "n_lines": 10},
        quick_options={"n_prompts": 2, "n_lines": 3},
        batch_size=8,
    ),
)


def experiment_policies(experiment: Experiment) -> tuple[str, ...]:
    """The recipe names an experiment runs (``SHIPPED``: every recipe found, ``full`` first)."""
    if experiment.policies is SHIPPED:
        return tuple(sorted(available_recipes(), key=lambda name: name != "full"))
    return experiment.policies
