"""Evaluation: tasks, metrics and (later) Lightning eval loops.

Importing this package must not import lightning or datasets; loops that need them import them lazily.
"""

from evictlayers.eval.tasks import PasskeyPrompt, passkey_grid, passkey_prompts, score_passkey

__all__ = ["PasskeyPrompt", "passkey_grid", "passkey_prompts", "score_passkey"]
