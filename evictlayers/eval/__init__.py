"""Evaluation: tasks, metrics, Lightning eval loops, reports and the papers' claims.

Importing this package must not import lightning or datasets; the loops that need them
(:mod:`evictlayers.eval.module`, :mod:`evictlayers.eval.runner`, :mod:`evictlayers.eval.claims`)
import them when used. Entry points: ``evictlayers eval`` / ``generate`` / ``claims``
(:mod:`evictlayers.cli`), or :func:`evictlayers.eval.runner.evaluate` from Python.
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
