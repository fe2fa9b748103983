"""Pick the backend of each attention op for the tensors at hand.

``decode_attention``, ``quantized_decode_attention`` and ``prefill_attention`` take exactly the
arguments every backend of their op takes (``decode/naive.py``, ``quantized_decode/naive.py`` and
``prefill/naive.py`` document them) and hand them, unchanged, to one. ``quantized_ring_attention`` is
``quantized_decode_attention`` over ``QuantizedSlots``' layout (a dense ring overlaying code slots): it
builds that op's arguments and folds the ring's mass back into its slots, except where the CPU backend's
one-op int4 step does both itself. The backends:

- ``auto`` (default): on CUDA tensors when Triton is installed, the Triton decode kernels and the fused
  prefill (``prefill/fused.py``: PyTorch's flash attention for the output and LSE, then a Triton mass pass,
  for a causal prompt in slot order; the Triton prefill kernel for any other inputs); on CPU the CPU
  backends (they compile into the fixed-shape decode graph): the decode through the fused flash op when
  no mass is wanted, the blockwise quantised decode, the one-pass prefill; the naive references on any
  other device;
- ``triton``: always the Triton kernels, the prefill's included (CPU tensors only under
  ``TRITON_INTERPRET=1``, the interpreter);
- ``reference``: always the naive references.

Every backend honours every option, so the choice never changes what is computed, only how; what
cannot run at all (Triton without CUDA or the interpreter, Triton not installed) is refused with the
way out in the message.

The choice comes from the environment variable ``EVICTLAYERS_KERNELS``, read once at import (call
``reload_kernel_choice()`` after changing it) so that the decode step traced by
``torch.compile(fullgraph=True)`` only sees a module constant.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from evictlayers.kernels.common import AttentionMass, DecodeAttention
from evictlayers.kernels.decode.cpu import decode_attention_with_mass_cpu
from evictlayers.kernels.decode.naive import decode_attention_with_mass
from evictlayers.kernels.prefill.cpu import attention_with_mass_cpu
from evictlayers.kernels.prefill.naive import attention_with_mass
from evictlayers.kernels.quantization import PackedKV
from evictlayers.kernels.quantized_decode.cpu import (
    int4_decode_attention,
    quantized_decode_attention_with_mass_cpu,
    whole_step_serves,
)
from evictlayers.kernels.quantized_decode.naive import quantized_decode_attention_with_mass

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
    """Whether the Triton kernels serve these tensors (raises when ``triton`` is forced but cannot run)."""
    choice = kernel_choice()
    if choice != "triton":
        return choice == "auto" and tensor.is_cuda and HAS_TRITON
    if not HAS_TRITON:
        raise RuntimeError(
            f"{ENV_VAR}=triton but triton is not installed; install it or set {ENV_VAR} to auto or reference"
        )
    if not tensor.is_cuda and not (tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(
            f"{ENV_VAR}=triton needs CUDA tensors, or TRITON_INTERPRET=1 (the Triton CPU interpreter, set before "
            f"triton is imported) for cpu tensors; got {tensor.device.type} tensors: set {ENV_VAR} to auto or "
            "reference"
        )
    return True


def prefill_backend(tensor: torch.Tensor) -> str:
    """``"fused"``, ``"triton"``, ``"cpu"`` or ``"naive"``: the prefill backend that serves tensors like
    ``tensor``; ``"fused"`` hands the inputs it does not serve to the Triton kernel (``prefill/fused.py``)."""
    backend = decode_backend(tensor)
    return "fused" if backend == "triton" and kernel_choice() == "auto" else backend


def decode_backend(tensor: torch.Tensor) -> str:
    """``"triton"``, ``"cpu"`` or ``"naive"``: the decode backend (of either decode op) that serves tensors
    like ``tensor``."""
    if _use_triton(tensor):
        return "triton"
    return "cpu" if kernel_choice() == "auto" and tensor.device.type == "cpu" else "naive"


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
    need_mass: bool = True,
    all_visible: bool = False,
) -> DecodeAttention:
    """Decode attention with mass and LSE on the chosen backend; ``decode/naive.py`` documents the arguments.

    ``need_mass=False`` (the caller reads the output and LSE only): every backend skips the mass and
    returns it as zeros. ``all_visible=True``: the caller promises that every slot holds a token the
    query may see (``decode/cpu.py`` then builds no mask); the other backends mask as always, which gives
    the same result while the promise holds."""
    backend = decode_backend(query)
    options = dict(
        scaling=scaling, softcap=softcap, sliding_window=sliding_window, gqa_reduce=gqa_reduce,
        score_gain=score_gain, need_mass=need_mass,
    )
    if backend == "cpu":
        return decode_attention_with_mass_cpu(query, key, value, query_pos, key_pos, all_visible=all_visible, **options)
    if backend == "triton":
        from evictlayers.kernels.decode.triton import decode_attention_with_mass_triton as kernel
    else:
        kernel = decode_attention_with_mass
    return kernel(query, key, value, query_pos, key_pos, **options)


def quantized_decode_attention(
    query: torch.Tensor,
    packed: PackedKV,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    residual_pos: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    gqa_reduce: str = "sum",
    score_gain: torch.Tensor | None = None,
    need_mass: bool = True,
) -> DecodeAttention:
    """Decode attention over code slots plus a dense residual, on the chosen backend; ``quantized_decode/naive.py``
    documents the arguments (the mass covers the code slots, then the residual slots)."""
    backend = decode_backend(query)
    if backend == "triton":
        from evictlayers.kernels.quantized_decode.triton import quantized_decode_attention_with_mass_triton as kernel
    else:
        kernel = quantized_decode_attention_with_mass_cpu if backend == "cpu" else quantized_decode_attention_with_mass
    return kernel(
        query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos, scaling=scaling,
        softcap=softcap, sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain,
        need_mass=need_mass,
    )


def quantized_ring_attention(
    query: torch.Tensor,
    packed: PackedKV,
    ring_keys: torch.Tensor,
    ring_values: torch.Tensor,
    query_pos: torch.Tensor,
    slot_pos: torch.Tensor,
    ring_slot: torch.Tensor,
    **options,
) -> DecodeAttention:
    """``quantized_decode_attention`` over code slots of which some are held dense in a ring: ``slot_pos`` ``[B,
    H_kv, C]`` the slots' positions, ``ring_keys``/``ring_values`` ``[B, H_kv, R, D]`` the ring, ``ring_slot`` ``[B,
    H_kv, R]`` int64 the slot each entry's token is in (``-1``: none), whose code row is then stale and not read.
    The mass ``[B, H_kv, C]`` has each entry's mass at its slot; ``options`` are the decode's keywords."""
    live = ring_slot >= 0
    target = ring_slot.clamp(min=0)
    ring_pos = torch.where(live, slot_pos.gather(2, target), -1)
    if decode_backend(query) == "cpu" and whole_step_serves(query, packed, ring_keys, ring_values):
        return int4_decode_attention(query, packed, ring_keys, ring_values, query_pos, slot_pos, ring_pos, ring_slot,
                                     **options)
    dense = torch.zeros_like(slot_pos).scatter_add_(2, target, live.long()) > 0
    attention = quantized_decode_attention(
        query, packed, ring_keys, ring_values, query_pos, slot_pos.masked_fill(dense, -1), ring_pos, **options
    )
    capacity = slot_pos.shape[-1]
    codes_mass, ring_mass = attention.mass[..., :capacity], attention.mass[..., capacity:]
    if options.get("need_mass", True):
        codes_mass = codes_mass.scatter_add(2, target, torch.where(live, ring_mass, 0.0))
    return attention._replace(mass=codes_mass)


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
    """Prefill attention with mass on the chosen backend; ``prefill/naive.py`` documents the arguments.

    ``need_mass=False`` (the caller reads the output and kept rows only): every backend skips the
    summed mass and returns it as zeros. ``lse_out`` is filled by every backend."""
    backend = prefill_backend(query)
    if backend == "fused":
        from evictlayers.kernels.prefill.fused import attention_with_mass_fused as kernel
    elif backend == "triton":
        from evictlayers.kernels.prefill.triton import attention_with_mass_triton as kernel
    else:
        kernel = attention_with_mass_cpu if backend == "cpu" else attention_with_mass
    return kernel(
        query, key, value, query_pos, key_pos, scaling=scaling, softcap=softcap,
        sliding_window=sliding_window, gqa_reduce=gqa_reduce, score_gain=score_gain,
        keep_rows=keep_rows, max_chunk_elements=max_chunk_elements, lse_out=lse_out, need_mass=need_mass,
    )
