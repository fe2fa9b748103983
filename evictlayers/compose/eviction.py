"""The one eviction rule: each head keeps its best ``budget`` slots, whichever step evicts
(docs/architecture.md, "What one step does", step 4).

A multi-token step (prefill, chunked prefill) and the one-token decode step both end here: the held
slots are ranked (``compose/ranking.py``: protections ``+inf``, then the selectors' scores) and a head
holding more than its budget gives up its lowest-ranked slots, equal priorities oldest first. A decode
step drops ``1`` (H2O Algorithm 1 lines 12-13) or Scissorhands' drop amount ``m`` (Algorithm 2) once a
head exceeds its budget; a multi-token step drops whatever exceeds it. Either way the victims leave
through ``release_evicted`` (absorbed by the sketch, forgotten by per-head state, slots freed). Fixed
shapes throughout (the width is a host int), so the decode step compiles into one graph.
"""

from __future__ import annotations

import torch

from evictlayers.compose import ranking
from evictlayers.compose.policy import Policy
from evictlayers.compose.sketching import absorb_evicted
from evictlayers.core.slots import LAST, along_slots
from evictlayers.modules import SketchState
from evictlayers.modules.cluster_sketch import CoinTable


def lowest_slots(priority: torch.Tensor, pos: torch.Tensor, width: int, tolerance: float = 0.0) -> torch.Tensor:
    """``[B, H, width]`` int64: each head's ``width`` lowest-priority held slots, lowest first; equal
    priorities go oldest first (so when the drop exceeds the unprotected slots, protected ones, all
    ``+inf``, leave in age order). Free slots (``pos < 0``) come after every held one.

    Args:
        priority: ``[B, H, N]`` float, higher is kept longer.
        pos: ``[B, H, N]`` int64 original positions, ``-1`` = free.
        width: host int, how many to return.
        tolerance: with ``width == 1``, priorities within this relative gap of the lowest count as tied
            (selectors whose scores tie exactly in real arithmetic; ``Selector.tie_tolerance``).
    """
    held = pos >= 0
    priority = priority.masked_fill(~held, torch.inf)
    age = pos.masked_fill(~held, LAST)
    if width == 1:  # one argmin instead of two sorts: the common decode step
        lowest = priority.amin(-1, keepdim=True)
        tied = priority == lowest
        if tolerance:  # (an infinite lowest, a stale slot, is tied only with itself)
            tied |= priority <= lowest + lowest.abs() * tolerance
        return torch.where(tied, age, LAST).argmin(-1, keepdim=True)
    by_age = age.argsort(-1)
    order = priority.gather(-1, by_age).argsort(dim=-1, stable=True)[..., :width]
    return by_age.gather(-1, order)


def choose_evicted(
    priority: torch.Tensor, pos: torch.Tensor, drop: torch.Tensor, width: int, tolerance: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(victims [B, H, width]`` slot indices, ``chosen [B, H, width]`` bool: really evicted``)``: each
    head's ``drop`` ``[B, H]`` lowest-ranked held slots (``lowest_slots``), ``width >= drop.max()``."""
    victims = lowest_slots(priority, pos, width, tolerance)
    chosen = torch.arange(width, device=pos.device) < drop[..., None]
    return victims, chosen


def release_evicted(
    policy: Policy, pos: torch.Tensor, state: dict[str, torch.Tensor], victims: torch.Tensor, chosen: torch.Tensor,
    keys: torch.Tensor | None, sketch: SketchState | None = None,
    sketch_kv: tuple[torch.Tensor, torch.Tensor] | None = None, coins: CoinTable | None = None,
) -> None:
    """The chosen victims (``choose_evicted``) leave, whichever step chose them: the sketch, if any,
    absorbs them while their keys and values are still in their slots, per-head state forgets their keys,
    and their slots are freed in ``pos`` in place.

    Args:
        keys: ``[B, H, N, D]`` the slots' keys as the scorers saw them (what per-head state forgets);
            read only when the policy has per-head state.
        sketch_kv: the slots' ``(keys, values)`` as stored, for the sketch; read only with ``sketch``.
        coins: the sketch's coin table for this step (``absorb_evicted``).
    """
    if sketch is not None:
        absorb_evicted(policy.sketch, sketch, *sketch_kv, pos, victims, chosen, coins)
    if policy.head_state_specs:
        ranking.forget(policy, state, keys.gather(2, along_slots(victims, keys)), chosen)
    pos.scatter_(2, victims, torch.where(chosen, -1, pos.gather(2, victims)))


def decode_drop(held: torch.Tensor, budget: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` int64 tokens a decode step evicts: ``amount`` ``[B]`` (the policy's drop amount) from each
    head holding more than its row's ``budget`` ``[B]``, none elsewhere; ``held`` ``[B, H]``."""
    return torch.where(held > budget[:, None], amount[:, None], 0)


def excess(held: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` int64 tokens a multi-token step evicts: whatever each head holds beyond its budget."""
    return (held - budget[:, None]).clamp(min=0)
