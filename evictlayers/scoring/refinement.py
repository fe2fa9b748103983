"""The ScoreRefinement interface: a step between a selector's per-slot score and its ranking."""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.scoring.view import Observation, SlotView


class ScoreRefinement(Component):
    """Replaces each held slot's score with one read off other slots' scores (its neighbours, its chunk,
    the layer's other heads) before the selector ranks; the scorer's state itself stays unrefined.

    ``HeavyHitterSelector(..., refine=[...])`` applies its refinements in list order, each to the previous
    one's output. ``state_specs`` names per-slot state a refinement keeps (as ``ScoreAccumulator``'s:
    ``[B, H_kv, C, *shape]`` float32, moving with its slot), written by ``update`` when tokens arrive.
    """

    state_specs: dict[str, tuple[int, ...]] = {}
    reads_sentences: bool = False  # whether ``update`` reads ``Observation.sentence_start``
    # whether every KV head of a layer gets the same refined score, so that all keep the same tokens
    aligns_heads: bool = False

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        """Fold this step into the refinement's own state, in place (nothing for a stateless one)."""

    def refine(self, score: torch.Tensor, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``score`` ``[B, H_kv, N]`` float32 of the held slots -> the refined ``[B, H_kv, N]`` float32
        (higher = keep; an empty slot's value is never read)."""
        raise NotImplementedError
