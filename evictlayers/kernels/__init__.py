"""Attention ops that also report how much probability each key received, and KV quantisation.

Each op is a folder of backends sharing one signature: ``prefill/`` (naive, cpu, triton), ``decode/``
(naive, triton) and ``quantized_decode/`` (naive, cpu, triton: attention over packed codes plus a dense
residual); ``dispatch.py`` picks the backend. ``common.py`` holds the result types and input checks,
``triton_common.py`` the Triton helpers the ops share; ``quantization.py`` packs and unpacks codes.

The CPU backends' C++ kernels (``*_cpu.cpp``, sharing ``cpu_kernels.h``) are compiled on first use for the CPU's
instruction-set level by ``cpu_extension.py``; ``python -m evictlayers.kernels build`` compiles them ahead and
``python -m evictlayers.kernels info`` says what is built (``__main__.py``).
"""

from evictlayers.kernels.attention_sinks import apply_attention_sinks
from evictlayers.kernels.common import GQA_REDUCTIONS, AttentionMass, DecodeAttention
from evictlayers.kernels.decode.naive import decode_attention_with_mass
from evictlayers.kernels.dispatch import (
    decode_attention,
    prefill_attention,
    quantized_decode_attention,
    quantized_ring_attention,
)
from evictlayers.kernels.prefill.naive import attention_with_mass

# the Triton modules are imported by the dispatcher on first use only: triton reads TRITON_INTERPRET
# when a kernel is defined, so importing them here would fix the interpreter choice too early
__all__ = [
    "GQA_REDUCTIONS", "AttentionMass", "DecodeAttention", "apply_attention_sinks", "attention_with_mass",
    "decode_attention", "decode_attention_with_mass", "prefill_attention", "quantized_decode_attention",
    "quantized_ring_attention",
]
