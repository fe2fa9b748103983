"""Evaluation tasks: prompt builders, documents and scorers (no lightning/datasets imports at module import)."""

from evictlayers.eval.tasks.documents import default_data_dir, document_windows, read_texts, strip_gutenberg
from evictlayers.eval.tasks.lines import LinesPrompt, lines_prompts, parse_record, score_lines
from evictlayers.eval.tasks.passkey import PasskeyPrompt, passkey_grid, passkey_prompts, score_passkey

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
