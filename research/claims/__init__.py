"""The papers' claims, reproduced on the embedded model; writes ``research/reports/results.md``.

``python -m research.claims`` (what ``research/scripts/results.sh`` runs) evaluates every available recipe in the
experiments of :mod:`~research.claims.experiments` (a streamed perplexity/agreement run on PG-19
books, passkey and LongEval-style lines, and the retrieval section's runs of every shipped recipe) and
judges each claim of :data:`~research.claims.verdicts.CLAIMS` from the numbers, one module per
paper under :mod:`~research.claims.verdicts`, with the criteria written in the report. A claim
whose recipes are missing (its component has not landed) is reported as *pending* and nothing is run for
it; adding the recipe file is all it takes to run it.

Modules: ``experiments`` (what runs, as data), ``run`` (running them), ``verdicts`` (judging),
``render`` (the markdown), ``saved`` (the artifacts and partial re-runs), ``command`` (:func:`main`),
``__main__`` (the command line).
"""

from research.claims.command import main
from research.claims.experiments import EXPERIMENTS, INLINE_RECIPES
from research.claims.render import render
from research.claims.run import run_experiments
from research.claims.verdicts import CLAIMS

__all__ = ["CLAIMS", "EXPERIMENTS", "INLINE_RECIPES", "main", "render", "run_experiments"]
