"""What every verdict shares: the :class:`Claim` and :class:`Verdict` records, the closeness criteria used
by more than one paper's claim, and finding a run in the saved results.

A result (one experiment) is ``{"task", "runs", "budgets", "settings", ...}``; a run is one policy at one
budget: ``{"policy", "budget", "full_cache", "perplexity", "top1", "score", "correct", "n", "kv_bytes",
"histogram", ...}``, the full cache's single run standing for every budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

PPL_CLOSE = 0.05  # "close to the full cache": perplexity at most 5% above it
ACC_CLOSE = 0.125  # accuracy within one prompt in eight of the full cache


@dataclasses.dataclass
class Verdict:
    """How a claim fared: ``status`` is one of holds / partly / does not hold / pending; ``summary`` is
    the one-line reason with the numbers, ``details`` the measured numbers behind it, one sentence each."""

    status: str
    summary: str
    details: list[str]


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim: ``sources`` names the paper's figures and tables, ``paper`` quotes their numbers,
    ``judge(results, unavailable)`` gives the :class:`Verdict` on this run's results."""

    number: int
    title: str
    sources: str
    paper: str
    judge: Callable[[dict, dict], Verdict]


def find_run(results: dict, key: str, policy: str, budget: float | None = 0.2) -> dict | None:
    """The run of ``policy`` at ``budget`` in experiment ``key`` (the full cache matches any budget)."""
    result = results.get(key)
    if result is None:
        return None
    for run in result["runs"]:
        if run["policy"] == policy and (run["full_cache"] or run["budget"] == budget):
            return run
    return None


def perplexity_gap(run: dict, full: dict) -> float:
    """How much higher ``run``'s perplexity is than the full cache's, as a fraction (0.05 = 5% above)."""
    return run["perplexity"] / full["perplexity"] - 1.0


def signed_percent(x: float) -> str:
    return f"{x:+.1%}"


def pending(missing: list[str], unavailable: dict) -> Verdict:
    """The verdict of a claim whose recipes ``missing`` were not run, with why (from ``unavailable``)."""
    reasons = [f"`{name}`: {unavailable.get(name, 'not run')}" for name in missing]
    return Verdict("pending", "component not landed: " + ", ".join(f"`{m}`" for m in missing), reasons)


def missing_policies(results: dict, needs: dict[str, tuple[str, ...]]) -> list[str]:
    """The policies of ``needs`` (experiment key -> policy names) without a run at 20%, each named once."""
    out = []
    for key, policies in needs.items():
        for policy in policies:
            if find_run(results, key, policy) is None and policy not in out:
                out.append(policy)
    return out
