"""Pieces shared by the Triton kernels of both ops: launch options and small ``@triton.jit`` helpers.

Imported by ``prefill/triton.py`` and ``decode/triton.py`` only, on first use: triton reads
``TRITON_INTERPRET`` when a kernel is defined, so importing this with the package would fix the
interpreter choice too early.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# private, but the switch torch's own triton_op flips around its eager body: there is no public one
from torch._library.triton import set_wrap_triton_enabled

REDUCE_CODES = {"sum": 0, "mean": 1, "max": 2}  # the kernels' REDUCE constexpr


def interpreting() -> bool:
    """Whether Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast to float32 before ``tl.dot``, its ``input_precision``) for a cache dtype.

    float32 caches use exact ``ieee`` products: TF32 would move logits by ~1e-3 and could flip an
    eviction against the reference. The CPU interpreter gets ``tl.dot`` wrong for bfloat16, so there
    bfloat16 is upcast.
    """
    upcast = dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
    return upcast, "ieee" if upcast else "tf32"


def run_op(op, launch, *args):
    """Run a Triton custom op's launch code: through the op (``torch.library.triton_op``) while
    ``torch.compile`` traces it, so that inductor sees the kernels; eagerly as ``launch`` itself, with
    ``wrap_triton`` switched off as the op's own eager path switches it off.

    Called directly with ``wrap_triton`` on, each ``wrap_triton(kernel)[grid](...)`` goes through the
    higher-order op's dispatch (torch's ``set_wrap_triton_enabled`` puts its cost at ~1 ms): on an H200, eager
    dense decode calls that launched that way took 385-790 us at 4k-32k slots, and 129-189 us launched here
    (docs/benchmarks.md, "The Triton kernels on a GPU")."""
    if torch.compiler.is_compiling():
        return op(*args)
    with set_wrap_triton_enabled(False):
        return launch(*args)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host. Not ``triton.cdiv``: Triton's host helpers go through its constexpr-function
    wrapper, whose call cost several microseconds each, and a decode call made ten of them (host time is what
    bounds a GPU decode call at a few thousand slots)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The next power of two >= ``n`` (``n >= 1``) on the host, by bit operations (they also take the symbolic
    ints of a traced shape)."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def block_size(n: int, lo: int = 16) -> int:
    """Next power of two >= n, at least ``lo`` (``tl.dot`` needs every dim >= 16)."""
    return max(lo, next_power_of_2(n))


@triton.jit
def soft_cap(x, cap):
    """Gemma2's ``tanh(x / cap) * cap``, with tanh written through exp (saturates cleanly at +-1)."""
    cap = tl.cast(cap, tl.float32)  # see masked_logits
    return (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)) * cap


@triton.jit
def visible_slots(q_pos, k_pos, window, HAS_WINDOW: tl.constexpr):
    """Which slots a query sees: filled, not in its future, inside the sliding window; none for padding.

    ``q_pos`` and ``k_pos`` broadcast against each other (``[M, 1]`` and ``[1, N]``, or scalars).
    """
    seen = (k_pos >= 0) & (k_pos <= q_pos) & (q_pos >= 0)
    if HAS_WINDOW:
        seen = seen & (q_pos - k_pos < window)
    return seen


@triton.jit
def masked_logits(q, k, seen, scaling, softcap, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
    """``q @ k^T`` scaled (and soft-capped) in float32, ``-inf`` where not ``seen``. q: [M, D], k: [N, D]."""
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    # a float argument arrives as float64 where torch.compile passes it as a symbolic float: without the cast
    # the logits, and every running max and sum a loop carries from them, would change type in the loop
    x = tl.dot(q, tl.trans(k), input_precision=PRECISION) * tl.cast(scaling, tl.float32)
    if HAS_SOFTCAP:
        x = soft_cap(x, softcap)
    return tl.where(seen, x, float("-inf"))


@triton.jit
def online_update(m_i, l_i, x):
    """One block of the online softmax: new running max, rescale factor, ``exp(x - max)``, new sum.

    A row that has seen nothing keeps max ``-inf``; the max is then read as 0 so that no
    ``-inf - -inf`` NaN appears and its probabilities stay 0.
    """
    m_new = tl.maximum(m_i, tl.max(x, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(x - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)
