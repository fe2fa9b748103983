"""Claim 3, from AhaKV (Gu et al., "AhaKV"), Sec. 3.1, Fig. 2 and Table 1: H2O's accumulated scores bias
the kept tokens toward the start of the sequence; AhaKV spreads them more evenly and scores at least as
well."""

from __future__ import annotations

from evictlayers.eval.metrics import histogram_evenness
from research.claims.verdicts.common import Claim, Verdict, find_run, missing_policies, pending

AS_GOOD_PPL = 0.01  # "at least as well" on perplexity: at most 1% above


def early_evenness(run: dict, share: float = 0.8) -> float:
    """Evenness of the retained positions over the first ``share`` of the sequence, where recent
    windows (which every policy here has, of different sizes) do not reach at 20% budget.

    ``run["histogram"]``: kept slots per bin of original position (20 bins, all layers and heads);
    the evenness is its normalised entropy (1 = uniform)."""
    counts = run["histogram"]
    return histogram_evenness(counts[: max(2, int(len(counts) * share))])


def early_centre(run: dict, share: float = 0.8) -> float:
    """Mean relative position of the kept slots in the first ``share`` of the sequence, rescaled to
    [0, 1] over that stretch: 0.5 for an even spread, below 0.5 for a bias toward early tokens."""
    counts = run["histogram"]
    k = max(2, int(len(counts) * share))
    head = counts[:k]
    total = sum(head)
    return sum((i + 0.5) / k * c for i, c in enumerate(head)) / total if total else float("nan")


def first_tenth_share(run: dict) -> float:
    """The fraction of all kept slots whose original position lies in the first tenth of the sequence."""
    counts = run["histogram"]
    head = counts[: max(1, len(counts) // 10)]
    return sum(head) / max(sum(counts), 1)


def claim_ahakv(results: dict, unavailable: dict) -> Verdict:
    """AhaKV Fig. 2 and Table 1: holds when AhaKV's kept positions are more even than H2O's
    (:func:`early_evenness`) on every task and it scores at least as well on every comparison
    (streamed perplexity at most :data:`AS_GOOD_PPL` above H2O's, passkey and lines accuracy not lower
    at 20% and 50%); partly when it is more even somewhere or never worse."""
    missing = missing_policies(results, {"stream": ("h2o", "ahakv"), "passkey": ("h2o", "ahakv")})
    if missing:
        return pending(missing, unavailable)
    details, more_even, less_even, centres = [], [], [], []
    for key in ("stream", "passkey", "lines"):
        h2o, aha = find_run(results, key, "h2o"), find_run(results, key, "ahakv")
        if h2o is None or aha is None:
            continue
        e_h, e_a = early_evenness(h2o), early_evenness(aha)
        (more_even if e_a > e_h else less_even).append(key)
        centres.append(early_centre(h2o))
        details.append(
            f"{key} at 20%: evenness of retained positions over the first 80% of the sequence H2O {e_h:.2f}, "
            f"AhaKV {e_a:.2f}; their centre there (0.5 = even, lower = early) H2O {early_centre(h2o):.2f}, AhaKV "
            f"{early_centre(aha):.2f}; share of all kept slots in the first 10% of positions H2O "
            f"{first_tenth_share(h2o):.1%}, AhaKV {first_tenth_share(aha):.1%}."
        )
    full = find_run(results, "stream", "full")
    s_h, s_a = find_run(results, "stream", "h2o"), find_run(results, "stream", "ahakv")
    worse = []
    if s_a["perplexity"] > s_h["perplexity"] * (1 + AS_GOOD_PPL):
        worse.append(f"streamed perplexity {s_a['perplexity']:.2f} vs {s_h['perplexity']:.2f}")
    comparisons = 1
    details.append(
        f"Streamed perplexity at 20%: H2O {s_h['perplexity']:.2f}, AhaKV {s_a['perplexity']:.2f} (full "
        f"{full['perplexity']:.2f}); top-1 agreement H2O {s_h['top1']:.3f}, AhaKV {s_a['top1']:.3f}."
    )
    for key in ("passkey", "lines"):
        for budget in (0.2, 0.5):
            p_h, p_a = find_run(results, key, "h2o", budget), find_run(results, key, "ahakv", budget)
            if p_h is None or p_a is None:
                continue
            comparisons += 1
            if p_a["score"] < p_h["score"]:
                worse.append(f"{key} {budget:.0%} {p_a['correct']}/{p_a['n']} vs {p_h['correct']}/{p_h['n']}")
            details.append(f"{key} at {budget:.0%}: H2O {p_h['correct']}/{p_h['n']}, "
                           f"AhaKV {p_a['correct']}/{p_a['n']}.")
    bias = (f"H2O's kept positions lean early on {sum(c < 0.45 for c in centres)} of {len(centres)} tasks (centre "
            f"{min(centres):.2f}-{max(centres):.2f}, 0.5 = even), the bias of AhaKV Fig. 2")
    spread = (f"AhaKV is more even on {', '.join(more_even) or 'no task'}"
              + (f", less even on {', '.join(less_even)}" if less_even else ""))
    score = (f"it scores at least as well on all {comparisons} comparisons" if not worse else
             f"it scores lower on {len(worse)} of {comparisons} comparisons ({'; '.join(worse)})")
    summary = f"{bias}; {spread}; {score}"
    if not less_even and not worse:
        return Verdict("holds", summary, details)
    if more_even or not worse:
        return Verdict("partly", summary, details)
    return Verdict("does not hold", summary, details)


CLAIM = Claim(
    3, "AhaKV spreads retained positions more evenly than H2O and scores at least as well",
    "AhaKV Sec. 3.1, Fig. 2, Table 1",
    "LLaMA2-7B, 3,600 tokens: H2O evicts nearly everything after position 1,500; LongBench averages "
    "(LLaMA3-8B) full 41.94, H2O 38.93, AhaKV 41.63.",
    claim_ahakv,
)
