"""The CPU decode backend against the naive reference: the C++ slot ops, and where they are not built the fused
flash op when no mass is wanted (odd slot counts, GQA 1-4, padding rows and rows that see nothing, empty
slots, sliding window, fp32 and 16-bit caches, a shape-generic compiled graph) or exactly the naive where
that op cannot serve (the mass wanted, softcap, value heads of another size). Buffers ``torch.empty`` hands
out are NaN-poisoned."""

import pytest
import torch
from torch._dynamo.utils import counters

from evictlayers.kernels.decode import cpu as decode_cpu
from evictlayers.kernels.decode import slots_cpu
from evictlayers.kernels.decode.cpu import decode_attention_with_mass_cpu
from evictlayers.kernels.decode.naive import decode_attention_with_mass
from kernel_inputs import flash_mask_spy, poisoned_empty, prefill_inputs
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


def only(kernel: str, monkeypatch) -> None:
    """Make the backend take the C++ slot ops (the fused op unreachable) or, as where they cannot be built,
    the fused op."""
    if kernel == "slot-ops":
        assert slots_cpu.available()
        monkeypatch.setattr(decode_cpu, "_FLASH", None)
    else:
        monkeypatch.setattr(slots_cpu, "serves", lambda *tensors: False)


def decode_inputs(seed, older, groups, head_dim=24, v_dim=None, dtype=torch.float32):
    """One decode query per row over ``older`` unordered slots plus its own: row 1 is padding."""
    query, key, value, query_pos, key_pos = prefill_inputs(seed, older, 1, groups=groups, head_dim=head_dim,
                                                           v_dim=v_dim, dtype=dtype)
    query_pos = query_pos[:, -1].clone()
    query_pos[1] = -1
    return query[:, :, -1], key, value, query_pos, key_pos


@pytest.mark.parametrize(
    "older,groups,window,dtype",
    [(36, 1, None, torch.float32), (99, 3, 40, torch.float32), (256, 4, None, torch.float32),
     (63, 2, 9, torch.bfloat16), (40, 3, None, torch.float16)],
    ids=["n37-g1", "n100-g3-window", "n257-g4", "n64-g2-window-bf16", "n41-g3-fp16"],
)
@pytest.mark.parametrize("kernel", ["slot-ops", "flash"])
def test_without_the_mass_matches_naive(older, groups, window, dtype, kernel, monkeypatch):
    only(kernel, monkeypatch)
    inputs = decode_inputs(older + groups, older, groups, dtype=dtype)
    kwargs = dict(scaling=0.3, sliding_window=window, score_gain=torch.tensor([1.5, 0.5]))
    with poisoned_empty():
        got = decode_attention_with_mass_cpu(*inputs, **kwargs, need_mass=False)
    want = decode_attention_with_mass(*inputs, **kwargs)
    assert got.out.dtype == dtype and (got.mass == 0).all() and got.mass.shape == want.mass.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.out.float(), want.out.float(), rtol=1e-4, atol=atol)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-4, atol=atol)  # -inf for the padding row
    assert (got.out[1] == 0).all() and (got.lse[1] == float("-inf")).all()


@pytest.mark.parametrize("kernel", ["slot-ops", "flash"])
def test_a_row_that_sees_nothing_gets_zero_output_and_no_normaliser(kernel, monkeypatch):
    """A real query whose window holds no slot (not only padding): output 0 and LSE -inf, as the naive."""
    only(kernel, monkeypatch)
    query, key, value, query_pos, key_pos = decode_inputs(7, 20, 3)
    query_pos[1] = 1000  # far past every slot: a window of 5 sees none of them
    kwargs = dict(scaling=0.3, sliding_window=5, need_mass=False)
    got = decode_attention_with_mass_cpu(query, key, value, query_pos, key_pos, **kwargs)
    want = decode_attention_with_mass(query, key, value, query_pos, key_pos, **kwargs)
    assert (got.out[1] == 0).all() and (got.lse[1] == float("-inf")).all()
    torch.testing.assert_close(got.out, want.out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "need_mass,softcap,v_dim,dtype",
    [(True, None, None, torch.float32), (False, 4.0, None, torch.float32), (False, None, 40, torch.float32),
     (True, None, None, torch.bfloat16)],
    ids=["mass", "softcap", "dv-wider", "mass-bf16"],
)
@pytest.mark.parametrize("kernel", [True, False], ids=["slot-ops", "matmul"])
def test_what_the_fused_op_cannot_express_is_the_naive(need_mass, softcap, v_dim, dtype, kernel, monkeypatch):
    """The naive's steps: with the C++ slot ops (float32 sums over the same logits, so close to the naive's
    matmuls, which run in the cache dtype), or without them exactly the naive."""
    monkeypatch.setattr(decode_cpu, "_FLASH", None)  # never reached
    if not kernel:
        monkeypatch.setattr(slots_cpu, "serves", lambda *tensors: False)
    inputs = decode_inputs(5, 30, 3, v_dim=v_dim, dtype=dtype)
    kwargs = dict(scaling=0.3, softcap=softcap, sliding_window=12, gqa_reduce="max", need_mass=need_mass,
                  score_gain=torch.tensor([1.5, 0.5]))
    got = decode_attention_with_mass_cpu(*inputs, **kwargs)
    want = decode_attention_with_mass(*inputs, **kwargs)
    if not kernel:
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        return
    assert slots_cpu.available()
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=atol)
    assert (got.out[1] == 0).all() and (got.lse[1] == float("-inf")).all() and (got.mass[1] == 0).all()


@pytest.mark.parametrize("kernel", ["slot-ops", "flash"])
def test_compiles_into_one_graph_for_every_slot_count(kernel, monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` (the decode step's), after the first static shape every slot
    count shares one dynamic graph (a full cache grows between steps)."""
    only(kernel, monkeypatch)
    compiled = torch.compile(decode_attention_with_mass_cpu, fullgraph=True, dynamic=None)
    torch._dynamo.reset()
    counters.clear()
    for older in (63, 100, 191, 300):
        inputs = decode_inputs(older, older, 3)
        kwargs = dict(scaling=0.3, sliding_window=50, need_mass=False)
        got, want = compiled(*inputs, **kwargs), decode_attention_with_mass(*inputs, **kwargs)
        torch.testing.assert_close(got.out, want.out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.lse, want.lse, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.parametrize("n_slots,groups,dtype", [(37, 1, torch.float32), (130, 3, torch.float32), (65, 4, torch.bfloat16)],
                         ids=["n37-g1", "n130-g3", "n65-g4-bf16"])
def test_every_slot_visible_takes_the_unmasked_op_and_matches_naive(n_slots, groups, dtype, monkeypatch):
    """``all_visible=True`` (a full cache in position order, sliced to its tokens), the slot ops not built:
    the op is called without a mask, and output and LSE are the naive's, which masks as always. Slots are
    unordered on purpose: the promise is visibility, not order."""
    only("flash", monkeypatch)
    g = torch.Generator().manual_seed(n_slots)
    batch, kv_heads, head_dim = 2, 2, 24
    query = torch.randn(batch, kv_heads * groups, head_dim, generator=g).to(dtype)
    key = torch.randn(batch, kv_heads, n_slots, head_dim, generator=g).to(dtype)
    value = torch.randn(batch, kv_heads, n_slots, head_dim, generator=g).to(dtype)
    key_pos = torch.stack([torch.randperm(n_slots, generator=g) for _ in range(batch * kv_heads)]).view(
        batch, kv_heads, n_slots)
    query_pos = torch.full((batch,), n_slots - 1)
    calls = flash_mask_spy(monkeypatch)
    kwargs = dict(scaling=0.3, need_mass=False)
    with poisoned_empty():
        got = decode_attention_with_mass_cpu(query, key, value, query_pos, key_pos, **kwargs, all_visible=True)
    want = decode_attention_with_mass(query, key, value, query_pos, key_pos, **kwargs)
    assert calls == [None]
    assert got.out.dtype == dtype and (got.mass == 0).all() and got.mass.shape == want.mass.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.out.float(), want.out.float(), rtol=1e-4, atol=atol)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-4, atol=atol)
