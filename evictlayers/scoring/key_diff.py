"""KeyDiff (Park et al., 2025, arXiv:2504.15364): keep the keys least like the head's average key."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from evictlayers.core.slots import along_slots
from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.view import Observation, SlotView


def inserted_keys(observation: Observation, view: SlotView, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, H, n, D]`` float32 keys of the step's new slots, ``[B, H, n]`` bool: the slot holds a token``)``."""
    if observation.keys is None or observation.inserted is None:
        raise ValueError(f"{owner} scores keys: its Observation needs `keys` and `inserted` (the slot store gives both)")
    index = observation.inserted
    keys = observation.keys.gather(2, along_slots(index, observation.keys))
    return keys.float(), view.pos.gather(2, index) >= 0


def slot_keys(view: SlotView, owner: str) -> torch.Tensor:
    """``[B, H, N, D]`` float32 keys of the slots, or a clear error when the view has none."""
    if view.keys is None:
        raise ValueError(f"{owner} scores keys: its SlotView needs `keys` (the slot store gives them)")
    return view.keys.float()


class KeyDiff(ScoreAccumulator):
    """``s_j = -cos(k_j, a)``, ``a = sum_{i held} k_i / |k_i|``: a key close to the head's mean direction
    is one of many alike and goes first (KeyDiff Eq. 4-5, the anchor is the mean of the normalised keys
    in the cache; Algorithm 1 evicts the most similar keys, block by block).

    No attention is needed, so the score does not inherit attention's bias toward early tokens and finds
    the odd one out of a repetitive context (a needle among repeated filler). The anchor is per-head
    state kept incrementally: each arriving key is added once (``Observation.inserted``) and each leaving
    key subtracted (``forget``), so a decode step reads the held keys once (for the cosines) and never
    recomputes the mean over all slots. Deviation: the paper re-derives the anchor from the cache for
    each block of the prompt; here a multi-token step adds the whole step's keys before ranking (what the
    anchor is for ``kvpress``'s KeyDiffPress too: the mean over the cache plus the new tokens).
    Under ``QuantizedKV`` a key is added at full precision and subtracted as stored; the difference is
    the quantisation error of one key, far below the anchor's scale.
    """

    head_state_specs = {"anchor": ("head_dim",)}
    nonnegative = False  # a negative cosine: a multiplicative prior would invert the ranking
    reads_mass = False  # keys only
    reads_keys = True

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        keys, held = inserted_keys(observation, view, "KeyDiff")
        state["anchor"] += (F.normalize(keys, dim=-1) * held[..., None]).sum(2)

    def forget(self, state: dict[str, torch.Tensor], keys: torch.Tensor, gone: torch.Tensor) -> None:
        state["anchor"] -= (F.normalize(keys.float(), dim=-1) * gone[..., None]).sum(2)

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        keys = slot_keys(view, "KeyDiff")
        anchor = state["anchor"]  # [B, H, D]
        dots = torch.einsum("bhnd,bhd->bhn", keys, anchor)
        norms = keys.norm(dim=-1) * anchor.norm(dim=-1)[..., None]
        return -dots / norms.clamp(min=1e-12)
