"""The papers' claims and how each is judged from the saved results: one module per paper, each with its
claim (title, the paper's numbers), its criteria and its judge; :data:`CLAIMS` lists them in report order."""

from research.claims.verdicts import ahakv, clustergen, h2o, quantized, scissorhands
from research.claims.verdicts.common import Claim, Verdict

CLAIMS: tuple[Claim, ...] = (h2o.CLAIM, scissorhands.CLAIM, ahakv.CLAIM, clustergen.CLAIM, quantized.CLAIM)

__all__ = ["CLAIMS", "Claim", "Verdict"]
