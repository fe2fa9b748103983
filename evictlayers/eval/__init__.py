"""Evaluation of a recipe on your own model: tasks (passkey, lines, perplexity, agreement, RULER), metrics,
the Lightning eval loops, the tuning / held-out splits, and the reports (JSON, markdown tables, plots).

Importing this package must not import lightning or datasets; the loops that need them
(:mod:`evictlayers.eval.module`, :mod:`evictlayers.eval.runner`) import them when used. Entry points:
``evictlayers eval`` / ``generate`` (:mod:`evictlayers.cli`), or :func:`evictlayers.eval.runner.evaluate`
from Python.
"""

from evictlayers.eval.tasks import (
    LinesPrompt,
    PasskeyPrompt,
    default_data_dir,
    document_windows,
    lines_prompts,
    parse_record,
    passkey_grid,
    passkey_prompts,
    read_texts,
    score_lines,
    score_passkey,
    strip_gutenberg,
)

__all__ = [
    "LinesPrompt",
    "PasskeyPrompt",
    "default_data_dir",
    "document_windows",
    "lines_prompts",
    "parse_record",
    "passkey_grid",
    "passkey_prompts",
    "read_texts",
    "score_lines",
    "score_passkey",
    "strip_gutenberg",
]
