"""Decode attention over KV slots on CPU, C++ kernels (``slots_cpu.cpp``): its two matmuls over dense slots,
``evictlayers::slot_logits`` and ``evictlayers::slot_values``, and the softmax between them with the mass,
``evictlayers::slot_softmax``. Their PyTorch counterparts are ``naive.py``'s ``matmul_logits``, ``matmul_values``
(the same products through ``torch.matmul``, in the cache dtype) and ``softmax_mass``, which serve wherever
these cannot.

- ``slot_logits(query [B, H, G, D] f32, keys [B, H, C, D]) -> [B, H, G, C]`` f32: ``query @ keys^T``;
- ``slot_values(probs [B, H, G, C] f32, values [B, H, C, Dv]) -> [B, H, G, Dv]`` f32: ``probs @ values``;
- ``softmax_mass`` (``slot_softmax``): ``naive.py``'s ``softmax_mass`` (the masked softmax of the scaled logits,
  the LSE, and the mass reduced over each GQA group) in one pass per (batch, KV head) over its rows in L1;
- ``first_free_slot``: where the decode step's new token goes (``kernels/slot_search.py`` has its reference and
  says why).

``keys`` and ``values`` are float32, bfloat16 or float16, with any strides whose last dimension is contiguous;
the products accumulate in float32.

Why kernels. A decode step's attention is ``G`` query rows (a GQA group) against ``C`` slots per KV head:
``torch.matmul`` hands that to BLAS as ``B * H`` matrix products of ``G`` rows, a shape BLAS runs far below
its rate. From the ``avx2`` instruction-set level up (``kernels/cpu_extension.py``) these loops read each slot
once for up to 4 query rows (logits; tiles of 8 slots reduced to one vector per row by a tree of ``hadd``) or keep
the output in registers across a tile of about 16 KB of slots (values); from ``avx512`` up they run 16 floats wide
for head dims that are a multiple of 16 (logits: head dims 64 and 128, tiles of 16 slots with each row's query
held in registers). Other head dims (not a multiple of 8), and the ``scalar`` level, run scalar loops with the
same arithmetic. ``python -m benchmarks --only cpu_kernel`` times the two products against ``torch.matmul`` and
against a plain read of the slots; ``python -m benchmarks --only decode`` times the decode they serve. The
softmax: inductor's code for ``slot_softmax`` compared the int64 slot positions against the query's anew in every
pass over every query row (four passes, ``G`` rows); the op builds each head's visibility once as a row of
``0 / -inf`` and keeps a row's passes in L1.

The C++ file registers itself as the ops' CPU kernels, so a call, eager or from the compiled decode step
(the ops are opaque there, with the shapes of ``register_fake`` below), goes from the dispatcher straight to
C++. It is compiled by ``kernels/cpu_extension.py`` on first use (``available``), for the machine's
instruction-set level: ``evictlayers.apply`` asks for it on a CPU model. When it cannot be built, ``available`` is
false: ``decode/cpu.py`` runs ``naive.py``'s ``torch.matmul`` instead, and ``kernels/slot_search.py`` its PyTorch
search.
"""

from __future__ import annotations

from pathlib import Path

import torch

from evictlayers.kernels.common import no_mass
from evictlayers.kernels.cpu_extension import build

SOURCE = Path(__file__).with_name("slots_cpu.cpp")
SLOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Declared here, implemented by the compiled C++ file (TORCH_LIBRARY_IMPL), which is loaded by ``extension``.
_LIB = torch.library.Library("evictlayers", "FRAGMENT")
_LIB.define("slot_logits(Tensor query, Tensor keys) -> Tensor")
_LIB.define("slot_values(Tensor probs, Tensor values) -> Tensor")
_LIB.define(
    "slot_softmax(Tensor logits, Tensor query_pos, Tensor key_pos, float scale, float softcap, int window, "
    "Tensor? gain, int reduce, bool need_mass) -> (Tensor, Tensor, Tensor)"
)
_LIB.define("first_free_slot(Tensor pos) -> Tensor")
torch.library.register_fake("evictlayers::first_free_slot", lambda pos: pos.new_empty(pos.shape[:2]), lib=_LIB)
torch.library.register_fake(
    "evictlayers::slot_logits",
    lambda query, keys: query.new_empty((*keys.shape[:2], query.shape[2], keys.shape[2])),
    lib=_LIB,
)
torch.library.register_fake(
    "evictlayers::slot_values",
    lambda probs, values: probs.new_empty((*values.shape[:2], probs.shape[2], values.shape[3])),
    lib=_LIB,
)
torch.library.register_fake(
    "evictlayers::slot_softmax",
    lambda logits, query_pos, key_pos, scale, softcap, window, gain, reduce, need_mass: (
        torch.empty_like(logits), logits.new_empty(logits.shape[:3]),
        logits.new_empty((*logits.shape[:2], logits.shape[3] if need_mass else 0)),
    ),
    lib=_LIB,
)
slot_logits = torch.ops.evictlayers.slot_logits
slot_values = torch.ops.evictlayers.slot_values
REDUCE = {"sum": 0, "mean": 1, "max": 2}  # gqa_reduce as the op takes it


def softmax_mass(
    logits: torch.Tensor,
    scaling: float,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    softcap: float | None,
    sliding_window: int | None,
    score_gain: torch.Tensor | None,
    need_mass: bool,
    gqa_reduce: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``naive.py``'s ``softmax_mass`` (same arguments and results) by ``evictlayers::slot_softmax``."""
    probs, lse, mass = torch.ops.evictlayers.slot_softmax(
        logits, query_pos, key_pos, scaling, 0.0 if softcap is None else softcap,
        -1 if sliding_window is None else sliding_window, score_gain, REDUCE[gqa_reduce], need_mass,
    )
    return probs, lse, mass if need_mass else no_mass(*key_pos.shape, key_pos.device)


def extension():
    """The compiled module (its import registers the ops' CPU kernels), built on the first call; ``None``
    (after one warning) when it cannot be built."""
    return build(SOURCE, "CPU decode kernel",
                 "decode attention with mass on CPU runs torch.matmul instead (same results, slower)")


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the ops have their C++ kernels (building them on the first call). A constant to the compiled
    decode step: traced once, not re-checked per step."""
    return extension() is not None


def serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether these tensors go to the ops: CPU slots of a supported dtype with contiguous channels, nothing that
    needs a gradient (the ops have no backward), and the kernels built."""
    return (
        key.device.type == "cpu" and key.dtype in SLOT_DTYPES and value.dtype in SLOT_DTYPES
        and key.stride(-1) == 1 and value.stride(-1) == 1
        and not (query.requires_grad or key.requires_grad or value.requires_grad)
        and available()
    )

