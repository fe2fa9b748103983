"""Attention ops that also report how much probability each key received.

Each op has a plain PyTorch reference here; accelerated kernels must keep the same signature.
"""

from evictlayers.kernels.attention_mass import GQA_REDUCTIONS, AttentionMass, attention_with_mass
from evictlayers.kernels.attention_sinks import apply_attention_sinks
from evictlayers.kernels.decode_attention import DecodeAttention, decode_attention_with_mass
from evictlayers.kernels.dispatch import decode_attention, prefill_attention

# the Triton modules are imported by the dispatcher on first use only: triton reads TRITON_INTERPRET
# when a kernel is defined, so importing them here would fix the interpreter choice too early
__all__ = [
    "GQA_REDUCTIONS", "AttentionMass", "DecodeAttention", "apply_attention_sinks", "attention_with_mass", "decode_attention",
    "decode_attention_with_mass", "prefill_attention",
]
