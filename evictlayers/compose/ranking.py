"""How a policy ranks one layer's slots at a step: protections first, then the selectors' scores.

Functions of a ``Policy`` (the configuration) and the step's state; the slot store and the decode step
call them, and ``compose/eviction.py`` turns the ranking into the slots each head keeps.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from evictlayers.compose.policy import Policy
from evictlayers.scoring import Observation, SlotView


def protected(policy: Policy, view: SlotView) -> torch.Tensor:
    """``[B, H_kv, N]`` bool: the slots a protection (RecentWindow, SinkTokens) holds."""
    held = torch.zeros_like(view.valid)
    if view.budget is None:
        return held
    for protection, reserved in zip(policy.protections, policy.reservations(view.budget), strict=True):
        held |= protection.protect(view, reserved)
    return held


def selectable(policy: Policy, budget: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the slots of each row's ``budget`` that no protection reserves, the selectors' share."""
    reserved = policy.reservations(budget)
    return budget - (torch.stack(reserved).sum(0) if reserved else 0)


def _protected_view(policy: Policy, view: SlotView) -> SlotView:
    """``view`` with ``protected`` filled, for the selectors that read ``view.candidates``."""
    return dataclasses.replace(view, protected=protected(policy, view))


def observe(policy: Policy, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
    """Let the selectors fold this step's attention (and keys) into their state."""
    if policy.selectors is None:
        return
    if policy.selectors.reads_candidates:
        view = _protected_view(policy, view)
    policy.selectors.update(state, observation, view)


def forget(policy: Policy, state: dict[str, torch.Tensor], keys: torch.Tensor, gone: torch.Tensor) -> None:
    """Slots leave: ``keys`` ``[B, H_kv, n, D]`` where ``gone`` ``[B, H_kv, n]``; per-head state that sums
    over held slots (``KeyDiff``'s anchor) drops them. Callers skip it without head state."""
    if policy.selectors is not None:
        policy.selectors.forget(state, keys, gone)


def prepare(policy: Policy, state: dict[str, torch.Tensor], view: SlotView) -> None:
    """After a multi-token step, before each head keeps its best ``budget``: the state that selection
    reads where it is not what ``observe`` left (greedy k-center's picks)."""
    if policy.selectors is None or view.budget is None:
        return
    policy.selectors.prepare(state, _protected_view(policy, view), selectable(policy, view.budget))


def settle(policy: Policy, state: dict[str, torch.Tensor], view: SlotView) -> None:
    """After that selection, on the kept slots: the state the decode steps maintain from then on."""
    if policy.selectors is None or view.budget is None:
        return
    policy.selectors.settle(state, _protected_view(policy, view))


def tie_tolerance(policy: Policy) -> float:
    """Relative gap under which two priorities count as tied (the oldest slot goes first): 0 (exact) but
    for scores that tie exactly in real arithmetic (the last selector says so: k-center distances,
    ``KeyNorm`` under RoPE)."""
    return policy.selectors.tie_tolerance if policy.selectors is not None else 0.0


def priority(policy: Policy, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
    """``[B, H_kv, N]`` float: higher is kept longer; protected slots ``+inf``, stale (out of every later
    query's sliding window) and empty ``-inf``. Without a selector the newest tokens rank highest."""
    held = protected(policy, view)
    if policy.selectors is None:
        rank = view.pos.float()
    elif len(policy.selectors.members) == 1 or view.budget is None:
        rank = policy.selectors.rank(state, view, view.valid & ~held, None)
    else:
        rank = policy.selectors.rank(state, view, view.valid & ~held, selectable(policy, view.budget))
    rank = rank.masked_fill(held, math.inf)
    if view.window is not None:  # out of every later query's window: the first to go, protected or not
        rank = rank.masked_fill(view.stale, -math.inf)
    return rank.masked_fill(~view.valid, -math.inf)
