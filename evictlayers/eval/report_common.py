"""What the report modules (:mod:`evictlayers.eval.report`, :mod:`evictlayers.eval.ruler_report`) share:
a run's budget as a table cell, and matplotlib's pyplot when it is installed."""

from __future__ import annotations

__all__ = ["budget_text", "pyplot"]


def budget_text(run: dict) -> str:
    """A run's budget as a table cell: ``full``, ``20%`` or ``512 tok``."""
    if run["full_cache"] or run["budget"] is None:
        return "full"
    budget = run["budget"]
    return f"{budget:.0%}" if isinstance(budget, float) else f"{budget} tok"


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` without matplotlib (``pip install
    evictlayers[eval]``): the plots are then skipped, the rest of a report is written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
