"""Learned attention sinks: the sink-free output scaled by sigmoid(lse - sink) equals attention whose
softmax carries the sink as an extra logit column that is then dropped (GPT-OSS's eager attention)."""

from __future__ import annotations

import pytest
import torch

from evictlayers.kernels.attention_sinks import apply_attention_sinks


def _reference(query, key, value, sinks, scaling):
    """softmax([logits, sink]) with the sink's column dropped before P @ V."""
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key) * scaling
    sink = sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ value


@pytest.mark.parametrize("batch, heads, queries, keys, dim", [(1, 1, 1, 1, 4), (2, 3, 5, 7, 6), (3, 4, 1, 13, 8)])
def test_sinks_match_the_extra_logit_column(batch, heads, queries, keys, dim):
    g = torch.Generator().manual_seed(batch * 100 + keys)
    query, key = torch.randn(batch, heads, queries, dim, generator=g), torch.randn(batch, heads, keys, dim, generator=g)
    value = torch.randn(batch, heads, keys, dim + 1, generator=g)
    sinks = torch.randn(heads, generator=g) * 3
    scaling = dim**-0.5
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key) * scaling
    out = torch.softmax(logits, dim=-1) @ value
    lse = torch.logsumexp(logits, dim=-1)
    got = apply_attention_sinks(out, lse, sinks)
    torch.testing.assert_close(got, _reference(query, key, value, sinks, scaling), rtol=1e-5, atol=1e-6)
    # the one-query decode layout: [B, H, D] with lse [B, H]
    got_decode = apply_attention_sinks(out[:, :, 0], lse[:, :, 0], sinks)
    torch.testing.assert_close(got_decode, _reference(query, key, value, sinks, scaling)[:, :, 0], rtol=1e-5, atol=1e-6)


def test_a_padding_query_stays_zero():
    out = torch.zeros(1, 2, 3, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    assert torch.equal(apply_attention_sinks(out, lse, torch.zeros(2)), out)
