"""attention_with_mass against a plain per-query reference on odd shapes."""

import math

import pytest
import torch

from evictlayers.kernels import attention_with_mass


def reference(query, key, value, query_pos, key_pos, scaling, softcap=None, window=None, reduce="sum", gain=None):
    """One query, one head at a time, with explicit visibility rules. Returns (out, mass, rows) where
    rows are every query's scoring probabilities reduced over its GQA group."""
    batch, q_heads, q_len, _ = query.shape
    kv_heads, n_slots = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    out = torch.zeros(batch, q_heads, q_len, value.shape[-1], dtype=torch.float64)
    head_mass = torch.zeros(batch, q_heads, n_slots, dtype=torch.float64)
    head_rows = torch.zeros(batch, q_heads, q_len, n_slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kv = h // groups
            for i in range(q_len):
                qp = int(query_pos[b, i])
                visible = [
                    j for j in range(n_slots)
                    if qp >= 0 and 0 <= int(key_pos[b, kv, j]) <= qp
                    and (window is None or qp - int(key_pos[b, kv, j]) < window)
                ]
                if not visible:
                    continue
                logits = []
                for j in visible:
                    x = float(query[b, h, i].double() @ key[b, kv, j].double()) * scaling
                    logits.append(math.tanh(x / softcap) * softcap if softcap else x)
                for j, p in zip(visible, _softmax(logits)):
                    out[b, h, i] += p * value[b, kv, j].double()
                scores = _softmax([x * float(gain[b, i]) for x in logits]) if gain is not None else _softmax(logits)
                for j, p in zip(visible, scores):
                    head_mass[b, h, j] += p
                    head_rows[b, h, i, j] = p
    grouped = head_mass.view(batch, kv_heads, groups, n_slots)
    grouped_rows = head_rows.view(batch, kv_heads, groups, q_len, n_slots)
    combine = {"sum": lambda t: t.sum(2), "mean": lambda t: t.mean(2), "max": lambda t: t.amax(2)}[reduce]
    return out, combine(grouped), combine(grouped_rows)


def _softmax(logits):
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def _inputs(seed, batch=2, q_heads=6, kv_heads=3, q_len=7, n_slots=13, dim=5):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, q_len, dim, generator=g)
    key = torch.randn(batch, kv_heads, n_slots, dim, generator=g)
    value = torch.randn(batch, kv_heads, n_slots, 3, generator=g)
    # slots hold shuffled positions with holes; some queries are padding
    key_pos = torch.stack([torch.stack([torch.randperm(n_slots + 4, generator=g)[:n_slots] for _ in range(kv_heads)])
                           for _ in range(batch)]) - 2
    key_pos = key_pos.clamp(min=-1)
    query_pos = torch.arange(q_len).repeat(batch, 1) + 8
    query_pos[1, :2] = -1
    return query, key, value, query_pos, key_pos


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize(
    "softcap,window,chunk", [(None, None, 1 << 24), (5.0, None, 1 << 24), (None, 4, 1 << 24), (3.0, 6, 50)],
    ids=["plain", "softcap", "window", "softcap-window-chunked"],
)
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_matches_reference(reduce, softcap, window, chunk, with_gain):
    query, key, value, query_pos, key_pos = _inputs(seed=len(reduce) * 7 + (window or 0) + int(softcap or 0))
    gain = torch.rand(2, 7, generator=torch.Generator().manual_seed(9)) * 3 if with_gain else None
    if gain is not None:
        gain[0, 3] = 0.0  # gain 0: uniform over the visible slots
    out, mass, rows = attention_with_mass(
        query, key, value, query_pos, key_pos, scaling=0.4, softcap=softcap, sliding_window=window,
        gqa_reduce=reduce, score_gain=gain, keep_rows=4, max_chunk_elements=chunk,
    )
    ref_out, ref_mass, ref_rows = reference(query, key, value, query_pos, key_pos, 0.4, softcap, window, reduce, gain)
    assert not out.isnan().any() and not mass.isnan().any() and not rows.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.double(), ref_rows[:, :, -4:], rtol=1e-5, atol=1e-6)


def test_padding_queries_and_empty_slots_get_nothing():
    query, key, value, query_pos, key_pos = _inputs(seed=3)
    out, mass, _ = attention_with_mass(query, key, value, query_pos, key_pos, scaling=1.0)
    assert (out[1, :, :2] == 0).all()
    assert (mass[key_pos < 0] == 0).all()


def test_mass_of_each_query_sums_to_one_per_query_head():
    query, key, value, query_pos, key_pos = _inputs(seed=4)
    key_pos = torch.arange(13).expand(2, 3, 13).contiguous()  # every slot visible to every query
    query_pos = torch.full((2, 7), 20)
    _, mass, _ = attention_with_mass(query, key, value, query_pos, key_pos, scaling=1.0)
    torch.testing.assert_close(mass.sum(-1), torch.full((2, 3), 7.0 * 2))  # 7 queries x 2 heads per group


def test_rejects_bad_head_counts_and_reductions():
    query, key, value, query_pos, key_pos = _inputs(seed=5)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_with_mass(query[:, :5], key, value, query_pos, key_pos, scaling=1.0)
    with pytest.raises(ValueError, match="gqa_reduce='median'"):
        attention_with_mass(query, key, value, query_pos, key_pos, scaling=1.0, gqa_reduce="median")
