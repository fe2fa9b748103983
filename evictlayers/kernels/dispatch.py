"""Pick the attention-with-mass kernel for the tensors at hand.

``decode_attention`` and ``prefill_attention`` take exactly the references' arguments
(``decode_attention_with_mass`` and ``attention_with_mass``) and route them:

- ``auto`` (default): Triton on CUDA tensors when Triton is installed; on CPU the reference decode
  (it compiles into the fixed-shape decode graph) and the flash-attention CPU prefill; the references
  on any other device;
- ``triton``: always the Triton kernels (CPU tensors only under ``TRITON_INTERPRET=1``, the interpreter);
- ``reference``: always the pure-PyTorch references.

The choice comes from the environment variable ``EVICTLAYERS_KERNELS``, read once at import (call
``reload_kernel_choice()`` after changing it) so that the decode step traced by
``torch.compile(fullgraph=True)`` only sees a module constant.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from evictlayers.kernels.attention_mass import AttentionMass, attention_with_mass
from evictlayers.kernels.decode_attention import DecodeAttention, decode_attention_with_mass
from evictlayers.kernels.prefill_cpu import attention_with_mass_cpu

ENV_VAR = "EVICTLAYERS_KERNELS"
CHOICES = ("auto", "triton", "reference")
HAS_TRITON = importlib.util.find_spec("triton") is not None

_requested = "auto"


def reload_kernel_choice() -> str:
    """Re-read ``EVICTLAYERS_KERNELS`` (validated on the next call of a dispatcher); returns it."""
    global _requested
    _requested = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    return _requested


reload_kernel_choice()


def kernel_choice() -> str:
    """The validated choice: one of ``CHOICES``."""
    if _requested not in CHOICES:
        raise ValueError(f"{ENV_VAR}={_requested!r} is not one of {CHOICES}")
    return _requested


def _use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel serves these tensors (raises when ``triton`` is forced but cannot run)."""
    choice = kernel_choice()
    if choice != "triton":
        return choice == "auto" and tensor.is_cuda and HAS_TRITON
    if not HAS_TRITON:
        raise RuntimeError(
            f"{ENV_VAR}=triton but triton is not installed; install it or set {ENV_VAR} to auto or reference"
        )
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{ENV_VAR}=triton needs CUDA tensors, or TRITON_INTERPRET=1 (the Triton CPU interpreter, set before "
            f"triton is imported) for {tensor.device.type} tensors; otherwise set {ENV_VAR} to auto or reference"
        )
    return True


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
) -> DecodeAttention:
    """``decode_attention_with_mass`` on the chosen kernel; see it for the arguments and shapes."""
    kernel = decode_attention_with_mass
    if _use_triton(query):
        from evictlayers.kernels.triton_decode import decode_attention_with_mass_triton as kernel
    return kernel(
        query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap,
        sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain,
    )


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    keep_rows: int = 0,
    max_chunk_elements: int = 1 << 24,
    lse_out: torch.Tensor | None = None,
    need_mass: bool = True,
) -> AttentionMass:
    """``attention_with_mass`` on the chosen kernel; see it for the arguments and shapes.

    ``need_mass=False``: the caller reads no summed mass (its rows and output only), which comes back
    as zeros; the CPU kernel then skips recomputing probabilities outside the kept rows (the output of
    a policy with no attention scorer costs one flash pass), the other kernels compute and drop it.

    ``lse_out`` (each query's log-sum-exp, wanted when a ``ClusterSketch`` is merged into a chunked
    prefill) is filled by the reference only, so asking for it selects the reference."""
    if lse_out is not None:
        attention = attention_with_mass(
            query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap,
            sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain,
            keep_rows=keep_rows, max_chunk_elements=max_chunk_elements, lse_out=lse_out,
        )
    else:
        if _use_triton(query):
            from evictlayers.kernels.triton_prefill import attention_with_mass_triton as kernel
        elif kernel_choice() == "auto" and query.device.type == "cpu":
            kernel = functools.partial(attention_with_mass_cpu, mass=need_mass)
        else:
            kernel = attention_with_mass
        attention = kernel(
            query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap,
            sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain,
            keep_rows=keep_rows, max_chunk_elements=max_chunk_elements,
        )
    if not need_mass:
        attention = attention._replace(mass=torch.zeros_like(attention.mass))
    return attention
