"""What a selector is: a component that ranks the unprotected slots, so the policy keeps the best.

A selector keeps its per-slot state (``state_specs``, moving with its slot) and per-head state
(``head_state_specs``) in the slot store's tensors, folds each step into them (``update``) and scores
the held slots (``score``: higher is kept longer). Eviction itself is the slot store's, one rule for
every step (``compose/eviction.py``): each head keeps its ``budget`` best slots.
"""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.scoring import Observation, SlotView


class Selector(Component):
    """Base of ``HeavyHitterSelector`` and ``KCenterSelector``; defaults describe a selector that reads
    nothing but what ``update`` is given and keeps no per-head state."""

    share: float | None = None  # the fraction of the unprotected slots it fills beside other selectors

    @property
    def state_specs(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state: ``[B, H_kv, C, *shape]`` float32 each."""
        return {}

    @property
    def head_state_specs(self) -> dict[str, tuple[int | str, ...]]:
        """Per-head state: ``[B, H_kv, *shape]`` float32 each (``"head_dim"`` = the key width)."""
        return {}

    @property
    def rows_needed(self) -> int:
        """How many of a step's last query rows ``update`` reads individually."""
        return 0

    @property
    def reads_mass(self) -> bool:
        """Whether ``update`` reads the summed attention mass (a prefill computes it only then)."""
        return False

    @property
    def reads_keys(self) -> bool:
        """Whether a one-token step's ``update`` or ``score`` reads the slots' keys (``SlotView.keys``,
        ``Observation.keys``): a quantised cache is dequantised for them only then."""
        return False

    @property
    def reads_values(self) -> bool:
        """Whether a one-token step's ``update`` or ``score`` reads the slots' values (``Observation.values``)."""
        return False

    @property
    def reads_queries(self) -> bool:
        """Whether ``update`` reads the step's queries and the layer's rotary table (``Observation.queries``,
        ``Observation.rotary``): the slot store then needs the model's rotary table."""
        return False

    @property
    def rotary_rows(self) -> int:
        """How many rows (positions ``0..n-1``) of the layer's rotary table ``update`` reads at least."""
        return 0

    @property
    def reads_sentences(self) -> bool:
        """Whether ``update`` reads ``Observation.sentence_start`` (the store then tracks where sentences start)."""
        return False

    @property
    def reads_candidates(self) -> bool:
        """Whether ``update`` reads ``view.candidates`` (the policy then fills ``view.protected``)."""
        return False

    @property
    def observes_probes(self) -> bool:
        """Whether ``update`` knows a probe step (``Observation.probe``) from one that inserts tokens: a probe
        is refused for a policy with a selector that does not."""
        return False

    @property
    def requires_probes(self) -> bool:
        """Whether the scores mean nothing until probes have run (a budgeted cache must then defer eviction)."""
        return False

    @property
    def needs_gqa_reduce(self) -> str | None:
        """The GQA reduction (``Policy(gqa_reduce=...)``) the scores are defined with, ``None`` for any."""
        return None

    @property
    def tie_tolerance(self) -> float:
        """Relative gap under which two scores count as tied (the oldest slot goes first); 0 = exact."""
        return 0.0

    def score_gain(self, query_pos: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, Q]`` factor on the logits of the scoring softmax, or ``None`` for the model's own."""
        return None

    def update(self, state: dict[str, torch.Tensor], observation: Observation, view: SlotView) -> None:
        """Fold one step (``observation``) into the state, in place."""
        raise NotImplementedError

    def score(self, state: dict[str, torch.Tensor], view: SlotView) -> torch.Tensor:
        """``[B, H_kv, N]`` float32 ranking score (higher = keep) of each held slot."""
        raise NotImplementedError

    def forget(self, state: dict[str, torch.Tensor], keys: torch.Tensor, gone: torch.Tensor) -> None:
        """Slots leave (``keys`` ``[B, H_kv, n, D]`` where ``gone`` ``[B, H_kv, n]``): per-head state that sums
        over the held slots drops them."""

    def prepare(self, state: dict[str, torch.Tensor], view: SlotView, count: torch.Tensor) -> None:
        """After a multi-token step, before the slot store keeps each head's best ``budget``: the state the
        selection reads, where it is not what ``update`` left (``count`` ``[B]``: slots this selector fills)."""

    def settle(self, state: dict[str, torch.Tensor], view: SlotView) -> None:
        """After that selection, on the kept slots: the state the decode steps maintain from then on."""
