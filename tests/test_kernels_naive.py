"""The naive (plain PyTorch) prefill and decode kernels against a per-query float64 loop, on odd shapes."""

import pytest
import torch

from evictlayers.kernels import attention_with_mass, decode_attention_with_mass
from kernel_inputs import loop_reference, nan_lse


def _inputs(seed, batch=2, q_heads=6, kv_heads=3, q_len=7, n_slots=13, dim=5, v_dim=3):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, q_len, dim, generator=g)
    key = torch.randn(batch, kv_heads, n_slots, dim, generator=g)
    value = torch.randn(batch, kv_heads, n_slots, v_dim, generator=g)
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
def test_prefill_matches_the_loop(reduce, softcap, window, chunk, with_gain):
    query, key, value, query_pos, key_pos = _inputs(seed=len(reduce) * 7 + (window or 0) + int(softcap or 0))
    gain = torch.rand(2, 7, generator=torch.Generator().manual_seed(9)) * 3 if with_gain else None
    if gain is not None:
        gain[0, 3] = 0.0  # gain 0: uniform over the visible slots
    lse = nan_lse(query)
    out, mass, rows = attention_with_mass(
        query, key, value, query_pos, key_pos, scaling=0.4, softcap=softcap, sliding_window=window,
        gqa_reduce=reduce, score_gain=gain, keep_rows=4, max_chunk_elements=chunk, lse_out=lse,
    )
    ref_out, ref_mass, ref_rows, ref_lse = loop_reference(
        query, key, value, query_pos, key_pos, 0.4, softcap, window, reduce, gain
    )
    assert not out.isnan().any() and not mass.isnan().any() and not rows.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass.double(), ref_mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.double(), ref_rows[:, :, -4:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)  # -inf for the padding queries


@pytest.mark.parametrize("keep_rows", [0, 3, 9], ids=lambda r: f"rows{r}")
def test_prefill_without_the_mass_keeps_output_rows_and_lse(keep_rows):
    query, key, value, query_pos, key_pos = _inputs(seed=8)
    gain = torch.rand(2, 7, generator=torch.Generator().manual_seed(2)) * 3
    kwargs = dict(scaling=0.4, sliding_window=5, score_gain=gain, keep_rows=keep_rows, max_chunk_elements=60)
    lse, want_lse = nan_lse(query), nan_lse(query)
    got = attention_with_mass(query, key, value, query_pos, key_pos, **kwargs, lse_out=lse, need_mass=False)
    want = attention_with_mass(query, key, value, query_pos, key_pos, **kwargs, lse_out=want_lse)
    assert (got.mass == 0).all() and got.mass.shape == want.mass.shape
    assert torch.equal(got.out, want.out) and torch.equal(got.rows, want.rows) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("softcap,window", [(None, None), (4.0, None), (None, 5), (3.0, 7)],
                         ids=["plain", "softcap", "window", "softcap-window"])
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_decode_matches_the_loop(reduce, softcap, window, with_gain):
    """Decode is prefill with one query per row: the loop's row of the last query, mass and lse."""
    query, key, value, query_pos, key_pos = _inputs(seed=len(reduce) + (window or 0), q_len=1, n_slots=19)
    query_pos = torch.tensor([[18], [-1]])  # row 1 is a padding query: zero output and mass, lse -inf
    gain = torch.tensor([[1.7], [0.5]]) if with_gain else None
    got = decode_attention_with_mass(
        query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.4, softcap=softcap, sliding_window=window,
        gqa_reduce=reduce, score_gain=gain[:, 0] if with_gain else None,
    )
    out, mass, _, lse = loop_reference(query, key, value, query_pos, key_pos, 0.4, softcap, window, reduce, gain)
    torch.testing.assert_close(got.out.double(), out[:, :, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.mass.double(), mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.lse.double(), lse[:, :, 0], rtol=1e-5, atol=1e-6)
    assert (got.out[1] == 0).all() and (got.lse[1] == float("-inf")).all()


def test_decode_without_the_mass_keeps_output_and_lse():
    """``need_mass=False``: the mass is zeros (one broadcast zero, no buffer), output and LSE unchanged."""
    query, key, value, query_pos, key_pos = _inputs(seed=6, q_len=1, n_slots=19)
    args = (query[:, :, 0], key, value, torch.tensor([18, -1]), key_pos)
    kwargs = dict(scaling=0.4, softcap=3.0, sliding_window=6, score_gain=torch.tensor([1.5, 0.5]))
    got = decode_attention_with_mass(*args, **kwargs, need_mass=False)
    want = decode_attention_with_mass(*args, **kwargs)
    assert (got.mass == 0).all() and got.mass.shape == want.mass.shape and got.mass.stride() == (0, 0, 0)
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)


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


def test_rejects_bad_inputs_with_the_argument_named():
    query, key, value, query_pos, key_pos = _inputs(seed=5)
    kwargs = dict(scaling=1.0)
    cases = [
        ((query[:, :5], key, value, query_pos, key_pos), {}, "multiple of key/value heads"),
        ((query, key, value, query_pos, key_pos), {"gqa_reduce": "median"}, "gqa_reduce='median'"),
        ((query, key, value[:, :, :4], query_pos, key_pos), {}, "must share \\[B, H_kv, N\\]"),
        ((query, key[..., :4], value, query_pos, key_pos), {}, "key head size"),
        ((query, key, value, query_pos[:, :3], key_pos), {}, "query_pos has shape \\(2, 3\\), expected \\(2, 7\\)"),
        ((query, key, value, query_pos, key_pos[:, :2]), {}, "key_pos has shape"),
        ((query, key, value, query_pos, key_pos), {"score_gain": torch.ones(2)}, "score_gain has shape"),
        ((query, key, value, query_pos, key_pos), {"lse_out": torch.empty(2, 6, 7, dtype=torch.float64)},
         "lse_out must be a float32 tensor of shape \\(2, 6, 7\\)"),
        ((query, key, value, query_pos, key_pos), {"keep_rows": -1}, "keep_rows \\(-1\\) must be >= 0"),
        # another device ("meta" stands in for a GPU): refused before a kernel reads a pointer
        ((query, key, value.to("meta"), query_pos, key_pos), {"score_gain": torch.ones(2, 7, device="meta")},
         "value, score_gain must be on the query's device \\(cpu\\)"),
    ]
    for args, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            attention_with_mass(*args, **kwargs, **extra)
    with pytest.raises(ValueError, match="query_pos has shape \\(2, 7\\), expected \\(2,\\)"):
        decode_attention_with_mass(query[:, :, 0], key, value, query_pos, key_pos, scaling=1.0)
