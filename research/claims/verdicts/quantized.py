"""Claim 5, from H2O (Zhang et al., 2023) Table 6 and Scissorhands (Liu et al., 2023) Table 4: storing the
kept keys and values in 4 bits (``QuantizedKV``) costs an eviction policy little."""

from __future__ import annotations

from research.claims.verdicts.common import ACC_CLOSE, Claim, Verdict, find_run, pending, signed_percent

INT4_PPL = 0.02  # "costs little": 4-bit adds at most 2% perplexity
PAIRS = (("h2o", "h2o_int4"), ("scissorhands", "scissorhands_int4"))  # (policy, the same policy in 4 bits)


def claim_int4(results: dict, unavailable: dict) -> Verdict:
    """H2O Table 6, Scissorhands Table 4: holds when every 4-bit recipe of :data:`PAIRS` is at most
    :data:`INT4_PPL` above its dense twin's streamed perplexity at 20% and within :data:`ACC_CLOSE` of its
    passkey accuracy; partly when that is so but one of the pairs was not measured."""
    present = [(b, q) for b, q in PAIRS
               if find_run(results, "stream", q) is not None and find_run(results, "stream", b)]
    if not present:
        return pending([q for _, q in PAIRS], unavailable)
    details, ok = [], []
    for base, quant in present:
        b, q = find_run(results, "stream", base), find_run(results, "stream", quant)
        rel = q["perplexity"] / b["perplexity"] - 1
        ok.append(rel <= INT4_PPL)
        details.append(
            f"{base} vs {quant}, streamed perplexity at 20%: {b['perplexity']:.2f} vs {q['perplexity']:.2f} "
            f"({signed_percent(rel)}); KV {b['kv_bytes'] / 2**20:.2f} vs {q['kv_bytes'] / 2**20:.2f} MiB/seq."
        )
        pb, pq = find_run(results, "passkey", base), find_run(results, "passkey", quant)
        if pb is not None and pq is not None:
            ok.append(pq["score"] >= pb["score"] - ACC_CLOSE)
            details.append(f"passkey at 20%: {pb['correct']}/{pb['n']} vs {pq['correct']}/{pq['n']}.")
    missing = [q for b, q in PAIRS if (b, q) not in present]
    if missing:
        details.append("not yet measured: " + ", ".join(f"`{m}` ({unavailable.get(m, 'not run')})" for m in missing))
    if all(ok):
        return Verdict("holds" if not missing else "partly", "4-bit costs little where measured", details)
    return Verdict("does not hold", "4-bit costs more than 2% perplexity or a passkey prompt", details)


CLAIM = Claim(
    5, "Adding 4-bit QuantizedKV to H2O / Scissorhands costs little", "H2O Table 6, Scissorhands Table 4",
    "OPT-30B: H2O 84.00 / 43.00 / 78.45, H2O + 4-bit 84.00 / 43.20 / 78.80 (COPA / OpenBookQA / PiQA); "
    "OPT-13B Hellaswag: Scissorhands 0.720, + 4-bit 0.720.",
    claim_int4,
)
