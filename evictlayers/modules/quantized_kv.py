"""Quantised K/V storage for the slot store: packed int4/int8 codes per slot plus a dense residual.

Layout after KIVI (Liu et al., 2024): asymmetric group-wise codes, values grouped per token (``group``
channels share a scale and zero point), the newest ``residual`` tokens kept dense. H2O (Table 6) and
Scissorhands (Table 4) report that 4-bit storage composes with eviction; this is that storage, shaped
for the slot store (docs/architecture.md, "Storage"): slots are unordered, each
KV head frees its own, and the next token overwrites a freed slot in place.

Keys: a deliberate deviation from KIVI. KIVI groups keys per channel across ``group`` tokens, so a
token's codes depend on the other tokens of its group. In a slot store those share a block of slots
that is freed one slot at a time, and writing into a block means dequantising it, inserting and
re-quantising: every re-quantisation re-rounds the surviving tokens on a new grid, and the error of a
long-lived token grows like a random walk with its lifetime. Measured (tests/test_quantization.py,
``test_block_requantisation_drifts``): inserting 3000 random int4 keys into a 32-slot block, even with
float32 scales, the worst token's error exceeds the one-shot bound after every insertion, typically 7x
and up to 15x, and the longest-lived tokens, the heavy hitters an eviction policy keeps, drift most.
So keys are quantised per token, in groups of ``group`` channels, and never re-quantised: a token's
error is fixed when it is written, ``<= scale / 2`` of its own groups, however many insertions follow. KIVI's reason for per-channel keys (a few outlier channels with much larger
magnitude would set the scale of every per-token group they sit in) is kept by a static per-channel
normalisation: at prefill each ``(b, h)`` key channel is divided by a power of two at least its
largest magnitude in the prompt (exact in floating point, so no rounding is added; only for a prompt of
at least ``NORMALISER_MIN_TOKENS`` tokens per head, since a stream's first token is no sample), quantised per
token, and multiplied back on dequantisation; an attention kernel can fold it into the query instead.
On keys with two 20x outlier channels this brings int4 error on the other channels from 4x KIVI's
per-channel error (plain per-token groups) to within 10% of it
(``test_channel_normalisation_tames_outlier_channels``).

Residual (KIVI's full-precision window): each token is held once, dense or as codes, never both. The
newest ``residual`` real tokens per head are dense, in a small ring that overlays their slots
(``ring_slot``); their slots' code rows are reserved and ignored meanwhile. When a new token takes the
ring's oldest entry, that entry's token ages out: it is quantised, once, into its own slot's code row, so
aging moves no slot (the slot store's positions and scorer state never follow a token from dense to
codes) and no token is ever re-quantised. A slot freed while its token is in the ring is dropped from the
ring when the slot is written next. Deviation from KIVI: KIVI's residual is a separate region of
``residual`` tokens beside the codes; here every slot has a code row, so the ring's tokens also reserve
``residual`` code rows per head (``nbytes`` counts them), which is what lets aging happen in place.

Attention (``attend``) reads the codes and the ring as they are held: ``kernels/quantized_decode``
unpacks the codes block by block (CPU) or in registers (Triton), with no dense copy of the cache.
"""

from __future__ import annotations

import torch

from evictlayers.core import Component
from evictlayers.core.slots import along_slots, batch_head_index
from evictlayers.kernels import DecodeAttention, quantized_ring_attention
from evictlayers.kernels.quantization import BITS, PackedKV, quantize_groups
from evictlayers.kernels.quantized_decode import int4_cpu

NORMALISER_MIN_TOKENS = 64  # prompt tokens a head needs before its key channels are normalised


class QuantizedKV(Component):
    """Storage config: ``bits`` (4 or 8) per element, ``group`` channels per scale/zero point, and the
    ``residual`` newest tokens per head kept dense in the model dtype.

    Builds :class:`QuantizedSlots` with :meth:`allocate` (empty) or :meth:`from_dense` (at prefill).
    """

    param_names = ("bits", "group", "residual")

    def __init__(self, bits: int = 4, group: int = 32, residual: int = 32):
        super().__init__()
        if type(bits) is not int or bits not in BITS:
            raise ValueError(f"QuantizedKV(bits={bits!r}): bits must be one of {BITS}")
        for name, value, least in (("group", group, 1), ("residual", residual, 0)):
            if type(value) is not int:
                raise TypeError(f"QuantizedKV({name}={value!r}): {name} must be an int")
            if value < least:
                raise ValueError(f"QuantizedKV({name}={value}): {name} must be >= {least}")
        self.bits, self.group, self.residual = bits, group, residual

    def check_dims(self, head_dim: int, value_dim: int, layer: int | None = None) -> None:
        """Raise ``ValueError`` unless ``group`` divides both head dims (and int4 codes pack in pairs)."""
        where = "" if layer is None else f" in layer {layer}"
        for name, dim in (("head dim", head_dim), ("value head dim", value_dim)):
            if dim % self.group:
                raise ValueError(
                    f"QuantizedKV(group={self.group}) does not divide the {name} {dim}{where}: "
                    f"choose a group that divides {dim}"
                )
            if self.bits == 4 and dim % 2:
                raise ValueError(f"QuantizedKV(bits=4) packs two codes per byte: the {name} {dim}{where} is odd")

    def allocate(
        self, batch: int, heads: int, capacity: int, head_dim: int, value_dim: int,
        dtype: torch.dtype, device: torch.device | str, *, layer: int | None = None,
    ) -> QuantizedSlots:
        """Empty storage for ``capacity`` slots per ``(b, h)``; ``layer`` only names the layer in errors."""
        self.check_dims(head_dim, value_dim, layer)
        if int4_cpu.serves(self.bits, self.group) and torch.device(device).type == "cpu":
            # the int4 CPU kernel builds on first use (announced on stderr, once per machine and instruction-set
            # level): here, at prefill, rather than inside the first decode step, where a benchmark or the demo
            # would time it
            int4_cpu.extension()
        per_byte = 2 if self.bits == 4 else 1
        scale_dtype = _scale_dtype(dtype)
        ring = min(self.residual, capacity)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(batch, heads, *shape, dtype=dtype, device=device)

        return QuantizedSlots(
            self,
            dtype,
            key_codes=zeros(capacity, head_dim // per_byte, dtype=torch.uint8),
            key_scale=zeros(capacity, head_dim // self.group, dtype=scale_dtype),
            key_zero=zeros(capacity, head_dim // self.group, dtype=scale_dtype),
            key_channel_scale=torch.ones(batch, heads, 1, head_dim, device=device),
            value_codes=zeros(capacity, value_dim // per_byte, dtype=torch.uint8),
            value_scale=zeros(capacity, value_dim // self.group, dtype=scale_dtype),
            value_zero=zeros(capacity, value_dim // self.group, dtype=scale_dtype),
            ring_keys=zeros(ring, head_dim, dtype=dtype),
            ring_values=zeros(ring, value_dim, dtype=dtype),
            ring_slot=torch.full((batch, heads, ring), -1, dtype=torch.long, device=device),
            cursor=zeros(dtype=torch.long),
        )

    def from_dense(
        self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, *, layer: int | None = None
    ) -> QuantizedSlots:
        """Storage holding ``keys`` ``[B, H, N, D]`` / ``values`` ``[B, H, N, Dv]`` in ``N`` slots, with
        ``pos`` ``[B, H, N]`` (``-1`` = empty): each head's ``residual`` newest tokens by ``pos`` dense in
        the ring, the others as codes (every slot is quantised in one pass; a ring slot's code row is
        ignored until its token ages out, when it is written again from the same values). Sets the per-channel key normalisation from these keys when a
        head holds at least ``NORMALISER_MIN_TOKENS`` of them (otherwise none: a stream's first token)."""
        batch, heads, slots, head_dim = keys.shape
        storage = self.allocate(batch, heads, slots, head_dim, values.shape[-1], keys.dtype, keys.device, layer=layer)
        magnitude = keys.float().abs().masked_fill((pos < 0)[..., None], 0).amax(2, keepdim=True)
        # 2**e with magnitude = m * 2**e, m in [0.5, 1): a power of two, so dividing by it is exact;
        # an all-zero channel gets e = 0, a scale of 1
        scale = torch.ldexp(torch.ones_like(magnitude), torch.frexp(magnitude).exponent)
        # a few tokens say nothing about a channel's range: normalising by the first token of a stream
        # blew its near-zero channels up into the outliers of every later key's groups (measured: int4
        # streamed perplexity 31 -> 17,000 on the embedded model); below this many tokens, no normaliser
        enough = (pos >= 0).sum(-1)[..., None, None] >= NORMALISER_MIN_TOKENS
        storage.key_channel_scale = torch.where(enough, scale, torch.ones_like(scale))
        storage.key_codes, storage.key_scale, storage.key_zero = storage._quantize_keys(keys)
        storage.value_codes, storage.value_scale, storage.value_zero = storage._quantize(values)
        ring = storage.ring_slot.shape[-1]
        newest = pos.topk(ring, dim=-1).indices.flip(-1)  # oldest first, empty slots (pos -1) at the front
        storage.ring_slot = torch.where(pos.gather(2, newest) >= 0, newest, -1)
        storage.ring_keys = keys.gather(2, along_slots(newest, keys))
        storage.ring_values = values.gather(2, along_slots(newest, values))
        return storage


class QuantizedSlots:
    """One layer's quantised K/V, addressed by slot like the store's dense ``[B, H, C, D]`` tensors.

    Tensors (``P`` = ``D / 2`` for int4, ``D`` for int8; ``R = min(residual, C)``):

    - ``key_codes`` ``[B, H, C, P]`` uint8, ``key_scale``/``key_zero`` ``[B, H, C, D / group]``: keys divided
      by ``key_channel_scale`` ``[B, H, 1, D]`` (float32 powers of two), quantised per token;
    - ``value_codes`` ``[B, H, C, Pv]``, ``value_scale``/``value_zero`` ``[B, H, C, Dv / group]``;
    - ``ring_keys``/``ring_values`` ``[B, H, R, D]`` in the model dtype, ``ring_slot`` ``[B, H, R]`` int64:
      the slot whose token each entry holds dense (``-1`` = none; that slot's code row is not read),
      ``cursor`` ``[B, H]``: the ring entry written next, which is the oldest.

    Scales and zero points are 16-bit as in KIVI: float16 for float16 models, bfloat16 otherwise
    (float32's range, so no key or value can overflow them).
    Error of :meth:`dense` per element: exact for ring tokens; otherwise ``<= key_channel_scale *
    key_scale / 2`` for keys and ``<= value_scale / 2`` for values (kernels/quantization.py), plus the
    model dtype's rounding of the result.
    """

    free_dense = False  # dense() dequantises a copy: the decode step asks for it only when a scorer reads it
    # inductor's CUDA build of this step computed other logits than the same step run eagerly (on an H200, torch
    # 2.11: off from the first step; eager and the aot_eager backend matched the CPU), so the store refuses it
    compiles_on_cuda = False

    def __init__(self, config: QuantizedKV, dtype: torch.dtype, **tensors: torch.Tensor):
        self.config, self.dtype = config, dtype
        for name in _TENSORS:
            setattr(self, name, tensors[name])

    def write(self, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pos: torch.Tensor) -> None:
        """Store one token per head in place: ``slot``/``pos`` ``[B, H]`` int64, ``key`` ``[B, H, D]``,
        ``value`` ``[B, H, Dv]``. A real token (``pos >= 0``) enters the ring, and the token it displaces from
        the ring is quantised into that token's own slot; without a ring it is quantised into ``slot``. A
        padding token (``pos < 0``) leaves the ring as it is (its slot stays empty).

        ``index_put_`` rather than ``scatter_``, as in ``DenseSlots.write``: under ``torch.compile``
        inductor then writes the buffers in place instead of copying them every step."""
        rows, cols = batch_head_index(slot)
        if self.ring_slot.shape[-1] == 0:
            self._put_codes(rows, cols, slot, key, value)
            return
        real = pos >= 0
        # the slot's previous token is gone: its ring entry (if it was still dense) must not overlay the new one
        self.ring_slot.masked_fill_(self.ring_slot == slot[..., None], -1)
        entry = (rows, cols, self.cursor)
        oldest = self.ring_slot[entry]
        # KIVI's aging: the oldest dense token becomes codes in its own slot when a real token takes its entry;
        # otherwise the write goes to ``slot``, whose code row nobody reads (the new token is dense, or padding)
        aged = torch.where(real & (oldest >= 0), oldest, slot)
        self._put_codes(rows, cols, aged, self.ring_keys[entry], self.ring_values[entry])
        self.ring_slot.index_put_(entry, torch.where(real, slot, oldest))
        for ring, new in ((self.ring_keys, key), (self.ring_values, value)):
            ring.index_put_(entry, torch.where(real[..., None], new.to(ring.dtype), ring[entry]))
        self.cursor.copy_((self.cursor + real.long()) % self.ring_slot.shape[-1])

    def packed(self) -> PackedKV:
        """The code slots as the quantised decode kernels read them (``kernels/quantization.py``)."""
        return PackedKV(
            self.key_codes, self.key_scale, self.key_zero, self.key_channel_scale, self.value_codes,
            self.value_scale, self.value_zero, self.config.bits, self.config.group,
        )

    def attend(self, query: torch.Tensor, pos: torch.Tensor, query_pos: torch.Tensor, **options) -> DecodeAttention:
        """Decode attention over the slots as they are held (``kernels/quantized_decode``: the codes are
        unpacked block by block or in registers, never into a dense copy of the cache), with the mass
        ``[B, H, C]`` per slot: a ring token's mass goes to the slot it overlays.

        ``query`` ``[B, H_q, D]``, ``pos`` ``[B, H, C]`` the slots' positions, ``query_pos`` ``[B]``; ``options``
        are the decode kernels' keywords (``scaling``, ``softcap``, ``sliding_window``, ``gqa_reduce``,
        ``score_gain``, ``need_mass``)."""
        # a slot whose token is dense is attended through its ring entry, not its (stale) code row
        return quantized_ring_attention(
            query, self.packed(), self.ring_keys, self.ring_values, query_pos, pos, self.ring_slot, **options
        )

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [B, H, C, D], values [B, H, C, Dv])`` dequantised in the model dtype, ring tokens exact."""
        packed = self.packed()
        return (
            self._overlay(packed.keys(self.dtype), self.ring_keys),
            self._overlay(packed.values(self.dtype), self.ring_values),
        )

    def gather(self, index: torch.Tensor) -> QuantizedSlots:
        """New storage of ``K`` slots: slot ``j`` of head ``(b, h)`` is this storage's slot ``index[b, h, j]``
        (``index`` ``[B, H, K]`` int64; a repeated slot is dense at its first occurrence only). Every ring
        token is quantised into its slot first, so a token the smaller ring drops keeps its codes."""
        tensors = {name: getattr(self, name) for name in _TENSORS}
        tensors.update(self._ring_as_codes())
        for name in _SLOTS:
            tensors[name] = tensors[name].gather(2, along_slots(index, tensors[name]))
        match = self.ring_slot[..., :, None] == index[..., None, :]  # [B, H, R, K]
        moved = torch.where(match.any(-1), match.int().argmax(-1), -1)
        tensors.update(self._resized_ring(moved, min(self.config.residual, index.shape[-1])))
        return QuantizedSlots(self.config, self.dtype, **tensors)

    def append(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> QuantizedSlots:
        """This storage with ``Q`` more slots holding ``keys`` ``[B, H, Q, D]`` / ``values``, ``pos``
        ``[B, H, Q]`` (a multi-token step after the first). The tokens already held keep their codes:
        re-quantising them from their dequantised values would add error with every chunk."""
        start = self.key_codes.shape[2]
        self.grow(keys.shape[2])
        for i in range(keys.shape[2]):  # one write per token keeps the ring's newest-last order
            slot = torch.full_like(pos[:, :, i], start + i)
            self.write(slot, keys[:, :, i], values[:, :, i], pos[:, :, i])
        return self

    def grow(self, extra: int) -> None:
        """``extra`` more empty slots at the end, between steps (a full cache running out of room)."""
        for name in _SLOTS:
            tensor = getattr(self, name)
            setattr(self, name, torch.cat([tensor, tensor.new_zeros(*tensor.shape[:2], extra, tensor.shape[3])], 2))
        capacity = self.key_codes.shape[2]
        for name, tensor in self._resized_ring(self.ring_slot, min(self.config.residual, capacity)).items():
            setattr(self, name, tensor)

    def index_select_batch(self, index: torch.Tensor) -> None:
        """Reorder (or repeat) sequences in place: row ``i`` becomes row ``index[i]`` (beam search)."""
        for name in _TENSORS:
            setattr(self, name, getattr(self, name).index_select(0, index))

    def nbytes(self) -> int:
        """Bytes of every tensor held: codes, scales, zero points, channel scales, the dense ring and its index."""
        return sum(getattr(self, name).nbytes for name in _TENSORS)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token codes of ``x`` ``[B, H, N, D]`` in groups of ``group`` channels."""
        return quantize_groups(x, self.config.bits, self.config.group, -1, _scale_dtype(self.dtype))

    def _quantize_keys(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._quantize(self._normalised(keys))

    def _normalised(self, keys: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[B, H, N, D]`` in float32, divided by the per-channel normalisation (what is quantised)."""
        return keys.float() / self.key_channel_scale

    def _put_codes(self, rows, cols, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Quantise one token per head (``key`` ``[B, H, D]``, ``value`` ``[B, H, Dv]``) into ``slot`` ``[B, H]``."""
        key, value = self._normalised(key[:, :, None]), value[:, :, None].float()  # [B, H, 1, D], [B, H, 1, Dv]
        if key.shape[-1] == value.shape[-1]:
            # key and value as two rows of one call: a decode step's token is a few dozen elements, so the
            # quantisation's ~25 ops cost their calls, not their bytes
            codes_scale_zero = self._quantize(torch.cat([key, value], 2))  # row 0 the key's, row 1 the value's
            new = [part[:, :, token] for token in (0, 1) for part in codes_scale_zero]
        else:
            new = [part[:, :, 0] for part in (*self._quantize(key), *self._quantize(value))]
        for buffer, row in zip(
            (self.key_codes, self.key_scale, self.key_zero, self.value_codes, self.value_scale, self.value_zero), new
        ):
            buffer.index_put_((rows, cols, slot), row)

    def _ring_as_codes(self) -> dict[str, torch.Tensor]:
        """The slot tensors (``_SLOTS``) with every ring token quantised into its slot, out of place."""
        ring = self.ring_slot.shape[-1]
        codes = {name: getattr(self, name) for name in _SLOTS}
        if ring == 0:
            return codes
        quantized = (*self._quantize_keys(self.ring_keys), *self._quantize(self.ring_values))
        # entries pointing nowhere go to a scratch slot past the end, dropped afterwards
        capacity = self.key_codes.shape[2]
        target = self.ring_slot.masked_fill(self.ring_slot < 0, capacity)
        for (name, slots), new in zip(codes.items(), quantized):
            padded = torch.cat([slots, slots.new_zeros(*slots.shape[:2], 1, slots.shape[3])], 2)
            codes[name] = padded.scatter(2, along_slots(target, new), new)[:, :, :capacity]
        return codes

    def _resized_ring(self, ring_slot: torch.Tensor, size: int) -> dict[str, torch.Tensor]:
        """The ring with ``size`` entries, oldest first from entry 0 (cursor 0): the newest ``size`` of the
        current entries, after empty ones when it grows. ``ring_slot`` ``[B, H, R]``: each entry's slot."""
        held = ring_slot.shape[-1]
        fifo = (self.cursor[..., None] + torch.arange(held, device=ring_slot.device)) % held
        order = fifo[..., max(held - size, 0) :]
        pad = size - order.shape[-1]

        def resized(ring: torch.Tensor, fill: float) -> torch.Tensor:
            kept = ring.gather(2, order if ring.dim() == 3 else along_slots(order, ring))
            return torch.cat([kept.new_full((*kept.shape[:2], pad, *kept.shape[3:]), fill), kept], 2)

        return {
            "ring_slot": resized(ring_slot, -1),
            "ring_keys": resized(self.ring_keys, 0),
            "ring_values": resized(self.ring_values, 0),
            "cursor": torch.zeros_like(self.cursor),
        }

    def _overlay(self, slots: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """``slots`` ``[B, H, C, D]`` with each live ring entry written over its slot."""
        if ring.shape[2] == 0:
            return slots
        capacity = slots.shape[2]
        # entries pointing nowhere go to a scratch slot past the end, dropped afterwards
        target = self.ring_slot.masked_fill(self.ring_slot < 0, capacity)
        out = torch.cat([slots, slots.new_zeros(*slots.shape[:2], 1, slots.shape[3])], 2)
        return out.scatter(2, along_slots(target, ring), ring)[:, :, :capacity]


# every tensor of a QuantizedSlots, and those indexed by slot (moved by gather)
_TENSORS = (
    "key_codes", "key_scale", "key_zero", "key_channel_scale", "value_codes", "value_scale", "value_zero",
    "ring_keys", "ring_values", "ring_slot", "cursor",
)
_SLOTS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype == torch.float16 else torch.bfloat16
