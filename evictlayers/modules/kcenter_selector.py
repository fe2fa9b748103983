"""Greedy k-center selection, ClusterGen's Sec. 4 ("token generation in sublinear time and memory with
clustering KV cache", shared/seeds/004): beside the most recent ``l`` tokens (a ``RecentWindow``), each
head keeps ``k`` centres chosen among the older keys by greedy farthest-point k-center (Dyer & Frieze
1985), the cache budget being ``l + k`` (Table 2).

At prefill the ``k`` centres are exactly greedy k-center's picks (``kcenter_select``); while decoding, a
head over budget evicts its most redundant older key (``KCenterSelector.update`` says how and where this
deviates from re-running greedy k-center at every step). Near-equal distances count as tied
(``core/ties.py``).
"""

from __future__ import annotations

import torch

from evictlayers.core.slots import LAST
from evictlayers.core.ties import TIE_TOLERANCE, first_near_max
from evictlayers.modules.selector import Selector
from evictlayers.scoring import Observation, SlotView

KCENTER_REFRESHES = 4  # exact gap recomputations per decode step (update's docstring)
KCENTER_STATE = "kcenter_gap"
_LONELY = torch.finfo(torch.float32).max  # the gap of a candidate with no other candidate


class KCenterSelector(Selector):
    """Keeps ``k`` centres among the unprotected slots by greedy k-center over their keys (ClusterGen Sec. 4).

    Args:
        centres: ``k``, the slots the selector keeps; ``None`` = the share of the budget the protections
            leave; an int fixes ``k``, so the policy's budget must be
            the int ``l + k`` (Table 2).

    Per-slot state ``kcenter_gap`` (float32, moves with its slot like every scorer state). After a
    multi-token step it holds the greedy k-center pick rank (``prepare``), which the policy's
    top-budget selection reads; once the kept slots are settled (``settle``) and while decoding
    (``update``) it holds each candidate's squared distance to its nearest other candidate. The
    policy evicts the lowest score among unprotected slots: the most redundant candidate.
    """

    param_names = ("centres",)

    def __init__(self, centres: int | None = None):
        super().__init__()
        if centres is not None and (isinstance(centres, bool) or not isinstance(centres, int) or centres < 1):
            raise ValueError(f"KCenterSelector(centres={centres!r}): centres must be an int >= 1 or None")
        self.centres = centres

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        return {KCENTER_STATE: ()}

    @property
    def reads_candidates(self) -> bool:
        return True

    @property
    def reads_keys(self) -> bool:
        return True  # gaps are distances between held keys

    @property
    def tie_tolerance(self) -> float:
        return TIE_TOLERANCE  # k-center distances tie exactly in real arithmetic (core/ties.py)

    def prepare(self, state: dict[str, torch.Tensor], view: SlotView, count: torch.Tensor) -> None:
        """Prefill (any multi-token step): greedy k-center (``kcenter_select``) over the candidate slots;
        the ``j``-th pick of ``k`` scores ``k - j``, other candidates 0. Greedy picks are a prefix-closed
        sequence, so a row whose share is ``k' < k`` keeps exactly the greedy ``k'``-center picks when
        the policy keeps its top ``budget`` slots. ``k`` is the most of ``count`` ``[B]``."""
        keys, candidates, k = view.keys, view.candidates, int(count.max())
        batch, heads, n_slots = candidates.shape
        score = torch.zeros(batch, heads, n_slots + 1, dtype=torch.float32, device=keys.device)
        if k > 0:
            picks = kcenter_select(keys, candidates, k)  # [B, H, k], -1 = none left
            rank = torch.arange(k, 0, -1, dtype=torch.float32, device=keys.device).expand_as(picks)
            score.scatter_(-1, torch.where(picks >= 0, picks, n_slots), rank)  # -1 lands in the spare column
        state[KCENTER_STATE] = score[..., :n_slots].contiguous()

    def settle(self, state: dict[str, torch.Tensor], view: SlotView) -> None:
        """After a multi-token step, on the kept slots: each candidate's exact squared distance to its
        nearest other candidate (blocks of rows against all slots, ``[B, H, 256, N]`` at a time)."""
        candidates = view.candidates
        x = view.keys.float()
        n_slots = x.shape[2]
        norms = x.square().sum(-1)  # [B, H, N]
        gap = torch.empty(x.shape[:3], dtype=torch.float32, device=x.device)
        slot = torch.arange(n_slots, device=x.device)
        for start in range(0, n_slots, 256):
            stop = min(n_slots, start + 256)
            block = norms[:, :, start:stop, None] + norms[:, :, None, :]
            block = (block - 2 * torch.einsum("bhid,bhjd->bhij", x[:, :, start:stop], x)).clamp(min=0)
            other = candidates[:, :, None, :] & (slot[start:stop, None] != slot[None, :])
            gap[:, :, start:stop] = block.masked_fill(~other, _LONELY).amin(-1)
        state[KCENTER_STATE] = torch.where(candidates, gap, 0.0)

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        """One decode step: fixed shapes, ``1 + KCENTER_REFRESHES`` rows of ``[B, H, N]``
        distances per head (no ``N x N`` matrix, no ``k`` sequential passes).

        The rule. Sec. 4 runs greedy k-center once, over the prompt's keys outside the recent window.
        Re-running it at every step would cost ``k`` sequential farthest-point passes (``k`` unrolled
        iterations in a compiled graph). Instead, when a head is over budget, the policy evicts the
        candidate (unprotected) slot whose nearest other candidate is closest: the most redundant key.
        Dropping that key leaves it within its gap of a kept one, so among single removals it adds the
        least to the covering radius of the candidates, the k-center objective; it is greedy k-center
        run backwards (a farthest-point traversal picks last the points closest to those already
        picked). The prefill keeps exactly greedy k-center's picks; afterwards, each step drops one key
        by this rule, which is not necessarily the set a fresh greedy run over all older keys would keep.

        The state ``kcenter_gap`` is each candidate's squared distance to its nearest other candidate.

        1. The newest candidate (the token that has just left the recent window, or the new token when
           nothing protects it) gets its exact gap; every other candidate's gap becomes the minimum of
           its gap and its distance to that token. Re-running this on a candidate already counted (a
           padding step) changes nothing.
        2. Evicting a token can only raise the others' true gaps, so stored gaps are lower bounds,
           exact except for candidates whose nearest candidate was evicted. ``KCENTER_REFRESHES`` times,
           the candidate eviction would take (the oldest among the near-smallest stored gaps) gets its
           gap recomputed exactly (a lazy priority queue of fixed depth). The victim is then the
           candidate with the exactly smallest gap unless more stale gaps than that lie below it
           (tests/test_cluster_policy.py measures how often on random keys).
        """
        keys, candidates = observation.keys.float(), view.candidates
        gap = state[KCENTER_STATE]
        slot = torch.arange(keys.shape[2], device=keys.device)
        has = candidates.any(-1)  # [B, H]

        def distances_from(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Squared distances ``[B, H, N]`` from slot ``index`` ``[B, H]``, and the others mask."""
            centre = keys.gather(2, index[..., None, None].expand(*index.shape, 1, keys.shape[-1]))
            return (keys - centre).square().sum(-1), candidates & (slot != index[..., None])

        newest = view.pos.masked_fill(~candidates, -1).argmax(-1)  # [B, H]
        dist, others = distances_from(newest)
        own = dist.masked_fill(~others, _LONELY).amin(-1)
        updated = torch.where(others, torch.minimum(gap, dist), gap)
        updated = torch.where(has[..., None] & (slot == newest[..., None]), own[..., None], updated)

        for _ in range(KCENTER_REFRESHES):
            # the candidate eviction would take: the oldest among the (near-)smallest gaps
            smallest = updated.masked_fill(~candidates, float("inf"))
            floor = smallest.amin(-1, keepdim=True)
            tied = candidates & (smallest <= floor + floor.abs() * TIE_TOLERANCE)
            lowest = view.pos.masked_fill(~tied, LAST).argmin(-1)
            dist, others = distances_from(lowest)
            own = dist.masked_fill(~others, _LONELY).amin(-1)
            updated = torch.where(has[..., None] & (slot == lowest[..., None]), own[..., None], updated)
        gap.copy_(torch.where(candidates, updated, 0.0))

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``[B, H, N]``: higher is kept longer (pick rank after a prefill selection, gap while decoding)."""
        return state[KCENTER_STATE]


def kcenter_select(keys: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy k-center (farthest-point; Gonzalez 1985, Dyer & Frieze 1985) over each head's candidate
    keys, the selector of ClusterGen Sec. 4.

    Args:
        keys: ``[B, H, N, D]`` slot keys.
        candidates: ``[B, H, N]`` bool, the slots the selector may pick (the protections, e.g. the
            recent window of Sec. 4, hold the others).
        k: centres to pick per head.

    Returns:
        ``[B, H, k]`` int64 slot indices in the order picked; ``-1`` once a head has no candidate left.

    Start (deterministic and independent of slot order): the candidate farthest from the candidates'
    mean. Each further pick is the candidate farthest from its nearest pick so far; ties, up to a
    relative ``TIE_TOLERANCE`` (deviation 4 of the module), go to the lowest slot index. ``k`` rounds of ``[B, H, N]`` distances: no ``N x N`` matrix, fixed shapes.
    The 2-approximation of the k-center radius holds from any start.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"kcenter_select(k={k!r}): k must be an int >= 1")
    if keys.dim() != 4 or tuple(candidates.shape) != tuple(keys.shape[:3]) or candidates.dtype != torch.bool:
        raise ValueError(
            f"kcenter_select: keys {tuple(keys.shape)} must be [B, H, N, D] and candidates a bool [B, H, N], "
            f"got candidates {tuple(candidates.shape)} {candidates.dtype}"
        )
    batch, heads, _, head_dim = keys.shape
    x = keys.float()
    weight = candidates.float()[..., None]
    mean = (x * weight).sum(2, keepdim=True) / weight.sum(2, keepdim=True).clamp(min=1)
    gap = (x - mean).square().sum(-1)  # the start's criterion  [B, H, N]
    nearest = torch.full_like(gap, float("inf"))  # squared distance to the nearest pick
    chosen = torch.zeros_like(candidates)
    picks = []
    for step in range(k):
        score = (gap if step == 0 else nearest).masked_fill(~candidates | chosen, float("-inf"))
        pick = first_near_max(score)  # lowest index among the (near-)maxima
        found = score.gather(-1, pick[..., None]).squeeze(-1) > float("-inf")
        picks.append(torch.where(found, pick, -1))
        chosen.scatter_(-1, pick[..., None], chosen.gather(-1, pick[..., None]) | found[..., None])
        centre = x.gather(2, pick[..., None, None].expand(batch, heads, 1, head_dim))
        nearest = torch.minimum(nearest, (x - centre).square().sum(-1))
    return torch.stack(picks, dim=-1)
