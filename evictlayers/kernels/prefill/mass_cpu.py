"""Causal prefill attention with every slot's column mass in one pass over the logits, on CPU: ``prefill_mass``,
a C++ kernel (``mass_cpu.cpp``) with its PyTorch reference beside it.

Why a kernel. Attention mass needs each query row's softmax complete before its probabilities are summed.
``cpu.py``'s blocks get that by giving each block of rows every slot it sees at once, so at 8k-16k tokens a
block that fits the cache is a few rows thin, its matmuls run well below BLAS's rate, and the softmax, the
column sums and ``P @ V`` each read the block again, where the fused flash op (which computes no mass) makes one
pass. ``python -m benchmarks --only prefill`` times the prefill with this kernel against SDPA's.

What it computes. Per query head and block of ``BLOCK_ROWS`` (128) rows, the slots are taken in tiles of
512 as flash attention does (Dao et al., FlashAttention, Algorithm 1): the tile's logits by BLAS, each row's running max
``m`` and sum ``l``, and ``P~ @ V`` accumulated by BLAS with the running rescale. Each tile's ``P~ = exp(logits
- m(t))`` stays in a ``[rows, span]`` scratch with the max ``m(t)`` it was taken against; once the block's rows
are complete their log-sum-exp is final, and one pass over the scratch gives each slot its mass (H2O,
Algorithm 1, lines 8-9: the column sums of the probabilities),

    mass[j] += sum_i exp(m_i(t_j) - lse_i) * P~[i, j].

The logits are computed once; the scratch (``rows x N`` floats per thread, fewer rows when that would
exceed ``max_chunk_elements`` in all) is the only extra memory, never ``N x N``. Each thread sums the
mass of its blocks into its own buffer, added at the end.

With a score gain (AhaKV's SG-softmax, a factor ``g_i >= 0`` per query row) the mass is that of
``softmax(g_i * logits)``: its running max is ``g_i`` times the model's, so the scratch keeps ``exp(g_i *
(logits - m(t)))`` with one more running sum, and the model's probabilities for ``P @ V`` go to a tile of
their own.

What it serves (``serves``): no softcap, a gain (if any) >= 0, on queries that are the last ``Q`` of ``N``
slots holding consecutive positions (a whole prompt on an empty cache, or a chunk after in-order slots),
with or without a sliding window. ``cpu.py`` sends those rows here and keeps its blocks
for everything else, and for every row when the kernel cannot be built (``kernels/cpu_extension.py`` builds it
for the machine's instruction-set level: its own loops are ATen's vectors, 8 floats wide from ``avx2`` up and
scalar below; its matmuls are BLAS's whatever the level).
It calls BLAS's ``sgemm_`` as linked into PyTorch (MKL on x86 wheels).
"""

from __future__ import annotations

from pathlib import Path

import torch

from evictlayers.kernels.common import in_order
from evictlayers.kernels.cpu_extension import build

SOURCE = Path(__file__).with_name("mass_cpu.cpp")
# query rows per block, at most: each thread's scratch is rows x N floats. Fewer rows make thinner matmuls, more a
# scratch that leaves the cache; of 32, 64, 128 and 256, timed beside the fused flash op on one thread at SmolLM2's
# shape and 8k tokens (python -m benchmarks --only prefill), 128 came closest to it
BLOCK_ROWS = 128


def extension():
    """The compiled module (``prefill_mass``), built on the first call; ``None`` (after one warning) when it
    cannot be built."""
    return build(SOURCE, "CPU prefill-with-mass kernel",
                 "prefill with attention mass on CPU runs the PyTorch blocks instead (same results, slower)")


def block_rows(n_slots: int, max_chunk_elements: int) -> int:
    """Query rows per block: ``BLOCK_ROWS``, or fewer so that every thread's ``rows x n_slots`` scratch stays
    within ``max_chunk_elements`` floats in all (0: not even one row fits)."""
    return min(BLOCK_ROWS, max_chunk_elements // (n_slots * torch.get_num_threads()))


def serves(query_pos: torch.Tensor, key_pos: torch.Tensor, *, softcap: float | None,
           score_gain: torch.Tensor | None, max_chunk_elements: int) -> bool:
    """Whether ``prefill_mass`` computes this call's mass: CPU, no softcap, a score gain (if any) >= 0, in-order
    slots, a block of at least one row within ``max_chunk_elements``, and the kernel built."""
    return (key_pos.device.type == "cpu" and softcap is None
            and (score_gain is None or bool((score_gain >= 0).all()))
            and block_rows(key_pos.shape[2], max_chunk_elements) > 0 and in_order(query_pos, key_pos)
            and extension() is not None)


def prefill_mass(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, gain: torch.Tensor | None,
                 scaling: float, window: int | None, need_mass: bool, rows: int, out: torch.Tensor, lse: torch.Tensor,
                 mass: torch.Tensor) -> None:
    """Fill ``out`` ``[R, G, Q, D_v]`` and ``lse`` ``[R, G, Q]``, and add each query head's column mass to
    ``mass`` ``[R, G, N]`` (left as it is with ``need_mass=False``), for query ``[R, G, Q, D]`` against key
    ``[R, N, D]`` and value ``[R, N, D_v]``, all float32 with a contiguous last dim (views of larger buffers
    are fine). Query ``i`` sees slot ``j`` iff ``j <= i + N - Q`` and, with a ``window``, ``j > i + N - Q -
    window``. The mass is that of the model's softmax, or with ``gain`` (``[R, Q]``, >= 0) of
    ``softmax(gain * logits)`` (the output and LSE stay the model's). ``rows``: query rows per block
    (``block_rows``). Needs the extension (``serves``)."""
    gain = torch.empty(0) if gain is None else gain
    extension().prefill_mass(query, key, value, gain, scaling, window or 0, need_mass, rows, out, lse, mass)


def prefill_mass_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scaling: float,
                           window: int | None, gain: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The formula ``prefill_mass`` computes, densely (``[R, G, Q, N]`` logits; for tests): ``(out, lse, mass)``
    with mass ``[R, G, N]``, the scoring probabilities summed over each query head's rows."""
    q_len, n_slots = query.shape[2], key.shape[1]
    logits = torch.einsum("rgqd,rnd->rgqn", query.double(), key.double()) * scaling
    row = torch.arange(q_len)[:, None] + n_slots - q_len
    slot = torch.arange(n_slots)[None, :]
    visible = (slot <= row) & ((slot > row - window) if window else True)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = logits.logsumexp(-1)
    probs = (logits - lse[..., None]).exp()
    out = torch.einsum("rgqn,rnd->rgqd", probs, value.double())
    if gain is not None:
        gained = (logits.masked_fill(~visible, 0.0) * gain.double()[:, None, :, None]).masked_fill(~visible, -torch.inf)
        probs = gained.softmax(-1)
    return out.float(), lse.float(), probs.sum(2).float()
