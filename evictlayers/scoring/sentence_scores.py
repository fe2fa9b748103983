"""Sentence chunks: ChunkKV's chunk scores (Liu et al., 2025, arXiv:2502.00299) over the text's own
sentences and lines, the semantic chunks of its motivation and of SentenceKV (Zhu et al., 2025,
arXiv:2504.00970), instead of fixed runs of positions."""

from __future__ import annotations

import torch

from evictlayers.scoring.chunk_scores import CHUNK_REDUCTIONS, reduce_by_group
from evictlayers.scoring.refinement import ScoreRefinement
from evictlayers.scoring.view import Observation, SlotView


class SentenceScores(ScoreRefinement):
    """Each held slot's score becomes the sum (``reduce="mean"``: the mean) of the scores of the held
    tokens of its sentence piece.

    A sentence ends at a token whose text holds a sentence end or a line break
    (``evictlayers.apply(..., tokenizer=)`` marks them); a sentence longer than ``cap`` tokens is cut into
    pieces of ``cap`` from its start, so unpunctuated text ranks in bounded chunks. With sentences of
    different lengths a sum ranks long sentences first; the mean ranks them by what each token is worth.

    Deviation (ours): SentenceKV keeps sentence-level key summaries for retrieval, not a per-token cache;
    here the sentence is only the unit ChunkKV's chunk score is summed over.
    """

    param_names = ("cap", "reduce")
    SENTENCE_START = "sentence_start"
    """Per-slot state: the position where the slot's sentence starts (float32, exact up to 2^24
    positions), written when the token arrives."""
    state_specs = {SENTENCE_START: ()}
    reads_sentences = True

    def __init__(self, cap: int = 32, reduce: str = "sum"):
        super().__init__()
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"SentenceScores(cap={cap!r}): the longest sentence chunk must be an int >= 1 (tokens)")
        if reduce not in CHUNK_REDUCTIONS:
            raise ValueError(f"SentenceScores(reduce={reduce!r}): expected one of {CHUNK_REDUCTIONS}")
        self.cap, self.reduce = cap, reduce

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        # the slot store gives every step's sentence starts to a policy that reads them (and says when it cannot)
        inserted = observation.inserted
        start = observation.sentence_start[:, None, :].expand(inserted.shape).to(torch.float32)
        state[self.SENTENCE_START].scatter_(2, inserted, start)

    def refine(self, score: torch.Tensor, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        start = state[self.SENTENCE_START].long()
        # sentences longer than the cap break into pieces of `cap` counted from their start
        piece = start + (view.pos - start).div(self.cap, rounding_mode="floor") * self.cap
        return reduce_by_group(score, view.pos, piece, self.reduce)
