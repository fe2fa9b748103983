"""Key-norm scoring (Devoto et al., 2024, arXiv:2406.11430): keep the keys with the lowest L2 norm."""

from __future__ import annotations

import torch

from evictlayers.scoring.accumulator import ScoreAccumulator
from evictlayers.scoring.key_diff import inserted_keys
from evictlayers.scoring.view import Observation, SlotView


class KeyNorm(ScoreAccumulator):
    """``s_j = -|k_j|_2``: the paper finds that keys of low norm draw high attention (Sec. 3, Fig. 1),
    so the highest-norm keys go first (as ``kvpress``'s KnormPress).

    A key's norm never changes while it is held, so it is computed once, when the key arrives
    (``Observation.inserted``), and kept per slot: ranking reads one float per slot and no key.

    A repeated token's keys differ only by their RoPE rotation, which keeps the norm: their scores tie
    in real arithmetic, so norms within a relative ``tie_tolerance`` count as equal and the oldest of
    them goes first (otherwise rounding, which differs between eager and compiled code, would decide).
    """

    state_specs = {"key_norm": ()}
    nonnegative = False  # minus a norm: a multiplicative prior would invert the ranking
    reads_mass = False  # keys only
    reads_keys = True  # the arriving key's norm
    tie_tolerance = 1e-4

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        keys, _ = inserted_keys(observation, view, "KeyNorm")
        index = observation.inserted
        rows = torch.arange(index.shape[0], device=index.device)[:, None, None].expand_as(index)
        heads = torch.arange(index.shape[1], device=index.device)[None, :, None].expand_as(index)
        # index_put_ writes in place under torch.compile (a functionalised scatter_ copies the buffer)
        state["key_norm"].index_put_((rows, heads, index), keys.norm(dim=-1))

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        return -state["key_norm"]
