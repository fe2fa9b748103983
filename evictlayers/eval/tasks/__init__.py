"""Evaluation tasks: prompt builders and scorers (no lightning/datasets imports at module import)."""

from evictlayers.eval.tasks.passkey import PasskeyPrompt, passkey_grid, passkey_prompts, score_passkey

__all__ = ["PasskeyPrompt", "passkey_grid", "passkey_prompts", "score_passkey"]
