"""Attention ops that also report how much probability each key received.

Each op has a plain PyTorch reference here; accelerated kernels must keep the same signature.
"""

from evictlayers.kernels.attention_mass import GQA_REDUCTIONS, AttentionMass, attention_with_mass
from evictlayers.kernels.decode_attention import DecodeAttention, decode_attention_with_mass

__all__ = ["GQA_REDUCTIONS", "AttentionMass", "DecodeAttention", "attention_with_mass", "decode_attention_with_mass"]
