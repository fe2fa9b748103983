"""The default K/V storage: keys and values held as they come, in the model dtype.

A storage owns *how* a layer's slots hold their keys and values; the slot store owns *where* a token
lives (docs/architecture.md, "Storage"). Every storage builds slot objects with
the same interface (``write``, ``attend``, ``dense``, ``append``, ``gather``, ``grow``,
``index_select_batch``, ``nbytes``, ``free_dense``: whether ``dense`` costs nothing, and ``compiles_on_cuda``:
whether its decode step may run under ``torch.compile`` on a GPU), so the store,
its compiled decode step and eviction never look inside: ``QuantizedKV`` is the other one.
"""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.core.slots import along_slots, batch_head_index
from evictlayers.kernels import DecodeAttention, decode_attention


class DenseKV(Component):
    """Keys and values in the model dtype, ``[B, H_kv, C, D]`` each (what ``Policy`` uses by default)."""

    def from_dense(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, *, layer: int | None = None):
        """Slots holding ``keys`` ``[B, H, N, D]`` and ``values`` ``[B, H, N, Dv]`` as they are."""
        return DenseSlots(keys, values)


class DenseSlots:
    """One layer's keys and values, ``[B, H, C, D]`` and ``[B, H, C, Dv]``, addressed by slot."""

    free_dense = True  # dense() is the tensors held, no copy
    compiles_on_cuda = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def write(self, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pos: torch.Tensor) -> None:
        """Store one token per head in place: ``slot`` ``[B, H]``, ``key`` ``[B, H, D]``, ``value`` ``[B, H, Dv]``.

        ``index_put_`` rather than ``scatter_``: under ``torch.compile`` inductor writes the buffers in
        place, where a functionalised ``scatter_`` copied the whole cache every step."""
        rows, cols = batch_head_index(slot)
        self.keys.index_put_((rows, cols, slot), key)
        self.values.index_put_((rows, cols, slot), value)

    def attend(self, query: torch.Tensor, pos: torch.Tensor, query_pos: torch.Tensor, **options) -> DecodeAttention:
        """Decode attention over the slots (``kernels.decode_attention``): ``query`` ``[B, H_q, D]``, ``pos``
        ``[B, H, C]``, ``query_pos`` ``[B]``, ``options`` the decode kernels' keywords."""
        return decode_attention(query, self.keys, self.values, query_pos, pos, **options)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` themselves: no copy."""
        return self.keys, self.values

    def gather(self, index: torch.Tensor) -> DenseSlots:
        """Slots ``index`` ``[B, H, K]`` of each head, as new storage of ``K`` slots."""
        return DenseSlots(*(t.gather(2, along_slots(index, t)) for t in self.dense()))

    def append(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> DenseSlots:
        """New storage with ``Q`` more slots holding ``keys`` ``[B, H, Q, D]`` / ``values`` (a multi-token
        step after the first); ``pos`` ``[B, H, Q]`` is unused here."""
        return DenseSlots(torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2))

    def grow(self, extra: int) -> None:
        """``extra`` more (zeroed) slots at the end, between steps (a full cache running out of room)."""
        self.keys, self.values = (torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2) for t in self.dense())

    def index_select_batch(self, index: torch.Tensor) -> None:
        """Reorder (or repeat) sequences in place: row ``i`` becomes row ``index[i]`` (beam search)."""
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

