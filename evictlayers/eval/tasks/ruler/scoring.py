"""RULER's scoring (``scripts/eval/synthetic/constants.py`` and ``scripts/eval/evaluate.py``).

A prediction is post-processed (stripped; control characters turned into newlines), then matched by
case-insensitive substring search against the references:

- ``string_match_all`` (every synthetic task): per sample, the fraction of its references found in
  the prediction; the task score is the mean over samples x 100, rounded to 2 decimals;
- ``string_match_part`` (RULER's QA tasks, kept for completeness): per sample, 1 if any reference is
  found; the same mean x 100.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["METRICS", "postprocess", "sample_score", "string_match_all", "string_match_part"]

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _found(reference: str, prediction: str) -> float:
    return 1.0 if reference.lower() in prediction.lower() else 0.0


def sample_score(prediction: str, references: Sequence[str], metric: str = "string_match_all") -> float:
    """One sample's score in [0, 1] (before RULER's x 100)."""
    if metric == "string_match_all":
        return sum(_found(r, prediction) for r in references) / len(references)
    if metric == "string_match_part":
        return max(_found(r, prediction) for r in references)
    raise ValueError(f"unknown RULER metric {metric!r}; expected one of {sorted(METRICS)}")


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean fraction of each sample's references found in its prediction, x 100, 2 decimals."""
    total = sum(sample_score(p, r, "string_match_all") for p, r in zip(predictions, references, strict=True))
    return round(total / len(predictions) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Share of samples with at least one reference found, x 100, 2 decimals."""
    total = sum(sample_score(p, r, "string_match_part") for p, r in zip(predictions, references, strict=True))
    return round(total / len(predictions) * 100, 2)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
