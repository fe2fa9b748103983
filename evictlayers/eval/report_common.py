"""What the report modules (:mod:`evictlayers.eval.report`, :mod:`evictlayers.eval.ruler_report`) share:
a run's budget and prefill as table cells, and matplotlib's pyplot when it is installed."""

from __future__ import annotations

__all__ = ["budget_text", "chunked_prefill", "prefill_text", "pyplot"]


def budget_text(run: dict) -> str:
    """A run's budget as a table cell: ``full``, ``20%`` or ``512 tok``."""
    if run["full_cache"] or run["budget"] is None:
        return "full"
    budget = run["budget"]
    return f"{budget:.0%}" if isinstance(budget, float) else f"{budget} tok"


def chunked_prefill(result: dict) -> bool:
    """Whether a run of ``result`` fed its prompts in chunks (``--prefill-chunk``): its table then has a
    ``prefill`` column beside the budget."""
    return any(run.get("prefill_chunk") is not None for run in result["runs"])


def prefill_text(run: dict) -> str:
    """How a run fed its prompts, as a table cell: ``512-token chunks`` or ``one forward``."""
    chunk = run.get("prefill_chunk")
    return "one forward" if chunk is None else f"{chunk}-token chunks"


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
