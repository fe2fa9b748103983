"""Learned attention sinks (GPT-OSS and its kin): one extra logit per query head in the softmax.

The model's attention is ``softmax([logits, sink])`` with the sink's column dropped before ``P @ V``,
so every probability is the sink-free softmax times ``S / (S + exp(sink))`` with ``S`` the sum of the
exponentiated logits: the output is the sink-free output scaled by ``sigmoid(lse - sink)``, where
``lse`` is the log-sum-exp of the query's logits. The attention kernels already return that ``lse``,
so the sink costs one elementwise scale.
"""

from __future__ import annotations

import torch


def apply_attention_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` with the sinks' share of each query's probability removed.

    Args:
        out: ``[B, H_q, ..., D_v]`` attention output over the visible keys (softmax without the sink).
        lse: ``[B, H_q, ...]`` float32 log-sum-exp of the same logits (``-inf`` for a padding query,
            whose output stays zero).
        sinks: ``[H_q]`` the sink logit of each query head.
    """
    shape = (1, -1) + (1,) * (lse.dim() - 2)
    kept = torch.sigmoid(lse - sinks.detach().float().view(shape))
    return (out.float() * kept[..., None]).to(out.dtype)
