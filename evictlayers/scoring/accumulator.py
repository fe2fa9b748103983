"""The ScoreAccumulator interface: per-slot state updated from attention mass, read as a score."""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.scoring.view import Observation, SlotView


class ScoreAccumulator(Component):
    """Turns the attention mass each slot receives into an importance score (higher = keep).

    ``state_specs`` names the per-slot state tensors the accumulator needs and their trailing shape
    (``()`` for one float per slot); the slot store allocates them as ``[B, H_kv, C, *shape]`` float32,
    moves them with their slots and zeroes them when a slot is reused.
    ``head_state_specs`` does the same for state kept once per (row, KV head), not per slot
    (``[B, H_kv, *shape]``; a ``"head_dim"`` entry in the shape is the layer's key width): it does not
    move with slots, so an accumulator that sums over its slots keeps it true with ``forget``.
    """

    state_specs: dict[str, tuple[int, ...]] = {}
    head_state_specs: dict[str, tuple[int | str, ...]] = {}
    rows_needed: int = 0  # how many of a step's last query rows ``Observation.rows`` must hold
    # whether ``update`` reads ``Observation.mass`` (the summed probabilities): a prefill whose scorers
    # read none skips computing it (the CPU kernel's second pass over the logits)
    reads_mass: bool = True
    # whether a one-token step's ``update`` or ``score`` reads the slots' keys (``Observation.keys``,
    # ``SlotView.keys``) or values (``Observation.values``): a quantised cache is dequantised for them only
    # then (a dense cache always hands them over; a multi-token step always does)
    reads_keys: bool = False
    reads_values: bool = False
    # whether ``update`` reads the step's queries (``Observation.queries``, ``query_pos``, ``scaling``) and the
    # layer's rotary table (``Observation.rotary``, at least ``rotary_rows`` rows): the slot store then needs
    # the model's rotary table (``evictlayers.apply`` measures it) and hands them over; nothing is built for
    # other policies
    reads_queries: bool = False
    rotary_rows: int = 0
    nonnegative: bool = True  # scores are attention mass (>= 0), so a multiplicative prior may weight them
    # relative gap under which two scores count as tied (the oldest slot goes first): 0 = exact; a score
    # that ties exactly in real arithmetic (a rotation-invariant one) sets it so float noise cannot decide
    tie_tolerance: float = 0.0
    # whether ``update`` knows a probe step (``Observation.probe``: rows over the held slots of tokens that are
    # never stored) from a step that inserts tokens; a probe is refused for a policy with any scorer that does not
    observes_probes: bool = False
    # whether the scores mean nothing until probes have run (``ContextReconstruction``): a policy holding such a
    # scorer refuses a budgeted cache whose first step does not defer eviction (``SlotStore.defer``)
    requires_probes: bool = False
    # the GQA reduction (``Policy(gqa_reduce=...)``) the scorer is defined with, ``None`` for any
    needs_gqa_reduce: str | None = None

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        """Fold this step's attention into ``state`` in place."""
        raise NotImplementedError

    def forget(self, state: dict[str, torch.Tensor], keys: torch.Tensor, gone: torch.Tensor) -> None:
        """The slots whose keys are ``keys`` ``[B, H_kv, n, D]`` leave where ``gone`` ``[B, H_kv, n]``:
        update per-head state that sums over the held slots (a no-op for per-slot state)."""

    def prepare(self, state: dict[str, torch.Tensor], view: SlotView) -> None:
        """After a multi-token step, before the slot store keeps each head's best slots: state the
        selection reads that ``update`` could not fill (``CrossLayer``'s score from other layers)."""

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``[B, H_kv, N]`` float importance of each slot."""
        raise NotImplementedError
