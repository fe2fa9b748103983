"""The CPU prefill backend against the naive reference on odd shapes, every option, NaN-poisoned buffers.

Its paths are covered: the C++ kernel (an in-order prompt whose mass is read; its own tests are in
``test_kernels_prefill_mass_cpu.py``), the one-pass blocks (every other row whose probabilities are
read, and every row under softcap or with value heads of another size) and the fused flash op (rows
whose output alone is needed); small ``max_chunk_elements`` cut the queries into many blocks and chunks."""

import pytest
import torch

import evictlayers.kernels.prefill.cpu as prefill_cpu
from evictlayers.kernels.prefill.cpu import attention_with_mass_cpu
from evictlayers.kernels.prefill.naive import attention_with_mass
from kernel_inputs import compare_prefill, prefill_inputs
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize(
    "older,new,groups,window,chunk",
    [(0, 29, 1, None, 1 << 24), (13, 17, 3, None, 200), (40, 23, 4, 9, 1 << 24), (7, 31, 3, 5, 700)],
    ids=["prompt-g1", "chunked-g3-small-chunks", "chunked-g4-window", "chunked-g3-window-small-chunks"],
)
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_cpu_prefill_matches_reference(reduce, older, new, groups, window, chunk, with_gain):
    inputs = prefill_inputs(older + new + groups, older, new, groups=groups)
    gain = torch.rand(2, new, generator=torch.Generator().manual_seed(3)) * 3 if with_gain else None
    if gain is not None:
        gain[0, 4] = 0.0  # gain 0: uniform over the visible slots
    got = compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, sliding_window=window, gqa_reduce=reduce,
                          score_gain=gain, keep_rows=6, max_chunk_elements=chunk)
    key_pos = inputs[4]
    assert (got.out[1, :, :3] == 0).all() and (got.mass[key_pos < 0] == 0).all()


@pytest.mark.parametrize(
    "head_dim,v_dim,softcap", [(24, 24, 2.5), (24, 40, None), (20, 12, 4.0)],
    ids=["softcap", "dv-wider", "dv-narrower-softcap"],
)
@pytest.mark.parametrize("need_mass", [True, False], ids=["mass", "no-mass"])
def test_cpu_prefill_with_softcap_and_value_heads_of_another_size(head_dim, v_dim, softcap, need_mass):
    inputs = prefill_inputs(17, 11, 21, groups=3, head_dim=head_dim, v_dim=v_dim)
    gain = torch.rand(2, 21, generator=torch.Generator().manual_seed(5)) * 2
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, softcap=softcap, sliding_window=8,
                    gqa_reduce="max", score_gain=gain, keep_rows=5, max_chunk_elements=400, need_mass=need_mass)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("need_mass", [True, False], ids=["mass", "no-mass"])
def test_cpu_prefill_of_an_unpadded_prompt(softcap, need_mass):
    """One in-order prompt: each block's leading slots are seen by all its rows and go unmasked."""
    inputs = prefill_inputs(29, 0, 53, groups=2, batch=1)
    gain = torch.rand(1, 53, generator=torch.Generator().manual_seed(6)) * 2
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, softcap=softcap, gqa_reduce="mean",
                    score_gain=gain, keep_rows=7, max_chunk_elements=900, need_mass=need_mass)


@pytest.mark.parametrize("keep_rows", [0, 1, 6, 40], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_cpu_prefill_without_the_mass_keeps_output_and_rows(keep_rows, with_gain):
    """``need_mass=False`` (a policy that reads no summed mass) skips the recompute outside the kept rows:
    the output, lse and kept rows are the reference's, across chunk boundaries, with a window and a gain."""
    inputs = prefill_inputs(11, 13, 31, groups=3)
    gain = torch.rand(2, 31, generator=torch.Generator().manual_seed(4)) * 3 if with_gain else None
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, sliding_window=7, score_gain=gain,
                    keep_rows=keep_rows, max_chunk_elements=500, need_mass=False)


@pytest.mark.parametrize(
    "batch,window,plain", [(1, None, True), (1, 60, True), (1, 20, False), (2, None, False)],
    ids=["prompt", "window-covers-prompt", "window-shorter", "left-padded"],
)
def test_cpu_prefill_of_a_whole_prompt_takes_one_causal_flash_call(monkeypatch, batch, window, plain):
    """A whole unpadded prompt on an empty cache: one flash call with the op's causal mask and no mask
    tensor; a window shorter than the prompt or a padded row keeps the additive mask. Either way the
    output and LSE are the reference's."""
    calls = []
    real = prefill_cpu._FLASH

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is None))
        return real(*args, **kwargs)

    monkeypatch.setattr(prefill_cpu, "_FLASH", spy)
    inputs = prefill_inputs(31, 0, 47, groups=3, batch=batch)
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, sliding_window=window, keep_rows=5,
                    max_chunk_elements=2000, need_mass=False)
    assert (calls == [(True, True)]) == plain
    assert all(not causal and not unmasked for causal, unmasked in calls) != plain


def test_cpu_prefill_without_mass_or_rows_scores_nothing(monkeypatch):
    """With neither the mass nor kept rows wanted, no probability is computed: the flash op alone. With
    kept rows, only the blocks holding them are."""
    scored = []
    real = prefill_cpu._block
    monkeypatch.setattr(prefill_cpu, "_block", lambda *a, **k: scored.append(k["scored"]) or real(*a, **k))
    query, key, value, query_pos, key_pos = prefill_inputs(13, 5, 40)
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, need_mass=False,
                            max_chunk_elements=300)
    assert scored == []
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, need_mass=False, keep_rows=2,
                            max_chunk_elements=300)
    assert scored == [True, True]  # blocks of one query here (300 elements, 45 slots): the last two only


def test_cpu_prefill_in_half_precision_and_with_keep_rows_beyond_the_chunk():
    inputs = prefill_inputs(5, 11, 19, groups=4, dtype=torch.float16)
    got = compare_prefill(attention_with_mass_cpu, inputs, out_atol=1e-3, mass_atol=1e-3, scaling=0.25,
                          keep_rows=50, max_chunk_elements=300)
    assert got.rows.shape == (2, 2, 19, 30)


def test_cpu_prefill_leaves_a_float32_cache_uncopied(monkeypatch):
    """The flash op and the one-pass blocks read the cache itself (views, stride-0 group expansion)."""
    query, key, value, query_pos, key_pos = prefill_inputs(7, 8, 10)
    seen = []

    def spy(name, real):
        def record(q, k, v, *args, **kwargs):
            seen.append((name, k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
            return real(q, k, v, *args, **kwargs)

        return record

    monkeypatch.setattr(prefill_cpu, "_FLASH", spy("flash", prefill_cpu._FLASH))
    monkeypatch.setattr(prefill_cpu, "_block", spy("block", prefill_cpu._block))
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, max_chunk_elements=200,
                            need_mass=False, keep_rows=3)
    # chunks through the flash op, then blocks for the kept rows, all on the cache's own storage
    assert {name for name, *_ in seen} == {"flash", "block"}
    cache = (key.untyped_storage().data_ptr(), value.untyped_storage().data_ptr())
    assert {tuple(ptrs) for _, *ptrs in seen} == {cache}


@pytest.mark.parametrize("need_mass", [True, False], ids=["one-pass", "flash"])
def test_cpu_prefill_fills_a_strided_lse_out(need_mass):
    """An ``lse_out`` that is not contiguous (every other element of a buffer) is filled all the same."""
    query, key, value, query_pos, key_pos = prefill_inputs(19, 6, 14)
    lse = torch.full((*query.shape[:3], 2), float("nan"))[..., 0]
    want = torch.empty(query.shape[:3])
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, lse_out=lse, need_mass=need_mass)
    attention_with_mass(query, key, value, query_pos, key_pos, scaling=0.3, lse_out=want)
    assert not lse.is_contiguous()
    torch.testing.assert_close(lse, want, rtol=1e-4, atol=1e-5)


def test_cpu_prefill_blocks_hold_at_most_max_chunk_elements_logits(monkeypatch):
    """The memory bound: each one-pass block's logits ``[B * H_kv, G, r, L]`` stay within
    ``max_chunk_elements`` (a block of one row excepted), and a causal prompt's early blocks see only
    the slots up to their last row."""
    shapes = []
    real = prefill_cpu._block

    def record(queries, keys, *args, **kwargs):
        shapes.append((queries.shape, keys.shape))
        return real(queries, keys, *args, **kwargs)

    monkeypatch.setattr(prefill_cpu, "_block", record)
    inputs = prefill_inputs(23, 0, 61, batch=1)
    softcap = 50.0  # without one the C++ kernel would take these rows
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, keep_rows=4, max_chunk_elements=2000,
                    softcap=softcap)
    assert len(shapes) > 3
    for (rows_of, groups, r, _), (_, limit, _) in shapes:
        assert r == 1 or rows_of * groups * r * limit <= 2000
    assert shapes[0][1][1] < 61  # the first block does not reach the last slots
