"""Claim 2, from Scissorhands (Liu et al. 2023, "Scissorhands: Exploiting the Persistence of Importance
Hypothesis"), Table 3: at 5x compression the perplexity stays close to the full cache's and beats the
local window's."""

from __future__ import annotations

from research.claims.verdicts.common import (
    PPL_CLOSE,
    Claim,
    Verdict,
    find_run,
    missing_policies,
    pending,
    perplexity_gap,
    signed_percent,
)


def claim_scissorhands(results: dict, unavailable: dict) -> Verdict:
    """Scissorhands Table 3: holds when Scissorhands' streamed perplexity at 20% is within
    :data:`PPL_CLOSE` of the full cache and below the local window's; partly when it only beats local."""
    missing = missing_policies(results, {"stream": ("full", "local", "scissorhands")})
    if missing:
        return pending(missing, unavailable)
    full, sc, local = (find_run(results, "stream", p) for p in ("full", "scissorhands", "local"))
    gap, local_gap = perplexity_gap(sc, full), perplexity_gap(local, full)
    details = [
        f"Streamed perplexity at 20% (5x compression): full {full['perplexity']:.2f}, Scissorhands "
        f"{sc['perplexity']:.2f} ({signed_percent(gap)}), local {local['perplexity']:.2f} "
        f"({signed_percent(local_gap)}); top-1 agreement Scissorhands {sc['top1']:.3f}, local {local['top1']:.3f}. "
        f"Scissorhands holds {sc['kept_fraction']:.1%} of the full cache's KV slots at the end (it drops m = 0.5 B "
        f"at once) in the same {sc['kv_bytes'] / 2**20:.2f} MiB per sequence as the others.",
    ]
    h2o = find_run(results, "stream", "h2o")
    if h2o is not None:
        details.append(f"For reference, H2O at the same budget: {h2o['perplexity']:.2f} "
                       f"({signed_percent(perplexity_gap(h2o, full))}).")
    beats = sc["perplexity"] < local["perplexity"]
    if gap <= PPL_CLOSE and beats:
        return Verdict("holds", f"Scissorhands {signed_percent(gap)} from full, local {signed_percent(local_gap)}",
                       details)
    if beats:
        return Verdict("partly", f"beats local ({signed_percent(local_gap)}) but is {signed_percent(gap)} from full "
                       "(criterion: 5%)", details)
    return Verdict("does not hold", "Scissorhands does not beat the local window", details)


CLAIM = Claim(
    2, "Scissorhands keeps perplexity close to the full cache at 5x compression and beats the local window",
    "Scissorhands Table 3",
    "OPT-13B on C4: full 8.80 / 9.10 / 9.30, Scissorhands 8.80 / 9.10 / 9.30, local window 81.83 / 29.38 / "
    "15.59 (sequences of 256-512 / 512-1024 / 1024-2048 tokens).",
    claim_scissorhands,
)
