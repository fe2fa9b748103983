"""NVIDIA kvpress's presses on the prompts of ``evictlayers eval --task ruler --split held_out``: the prompts
exported from evictlayers (:mod:`.export_prompts`, main install), run under kvpress in its own venv
(:mod:`.run_presses`, ``.venv-kvpress``), scored with evictlayers' RULER scoring into a ``ruler.json``
(:mod:`.score`, main install). README.md here has the commands.

This package imports nothing at import time: :mod:`.run_presses` runs under kvpress's transformers (< 5.3),
where ``evictlayers`` itself does not import.
"""
