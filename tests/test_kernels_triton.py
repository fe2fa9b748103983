"""The Triton kernels against their PyTorch references, on the Triton CPU interpreter.

``TRITON_INTERPRET=1`` must be set before the kernels are decorated (``triton.jit`` reads it then), so it
is set here, before the kernel modules are imported. The interpreter is slow: shapes are small and the
parametrisation covers each feature (head dims 64/80, odd slot counts, GQA groups 1/3/4, the three
reductions, gain, softcap, window, float32/float16) in a handful of cases rather than their product.
Every buffer ``torch.empty`` hands out during a kernel call is filled with NaN, so an output element
the kernels forget to write, or a scratch value read before it is written, fails the test.
"""

import contextlib
import os
import sys

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
_loaded = sys.modules.get("evictlayers.kernels.triton_decode")
if _loaded is not None and type(_loaded._split_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

from evictlayers.kernels import dispatch  # noqa: E402
from evictlayers.kernels.attention_mass import attention_with_mass  # noqa: E402
from evictlayers.kernels.decode_attention import decode_attention_with_mass  # noqa: E402
from evictlayers.kernels.triton_decode import decode_attention_with_mass_triton  # noqa: E402
from evictlayers.kernels.triton_prefill import attention_with_mass_triton  # noqa: E402
from tiny_models import single_thread  # noqa: E402,F401 (autouse fixture)

pytestmark = [
    pytest.mark.triton,
    # the interpreter evaluates both sides of tl.where with numpy: -inf - -inf in the unused side warns
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]


@contextlib.contextmanager
def poisoned_empty():
    """Make ``torch.empty`` return NaN-filled float tensors for the duration."""
    real = torch.empty

    def empty(*args, **kwargs):
        tensor = real(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def slots(g, batch, kv_heads, n_slots, older, new=0):
    """``[B, H_kv, N]`` positions: ``older`` shuffled slots holding positions below 2 * older with ~20%
    empty (-1), then ``new`` slots in order holding positions 2 * older, 2 * older + 1, ..."""
    old = torch.stack([torch.randperm(2 * older, generator=g)[:older] for _ in range(batch * kv_heads)])
    old[torch.rand(old.shape, generator=g) < 0.2] = -1
    fresh = torch.arange(2 * older, 2 * older + new).expand(batch * kv_heads, new)
    return torch.cat([old, fresh], dim=1).view(batch, kv_heads, n_slots)


def tensors(g, dtype, *shapes):
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


def assert_matches(got, want, dtype, mass_atol):
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(want._fields, got, want):
        assert not a.isnan().any(), f"{name} has NaN (an element never written?)"
        tol = atol if name == "out" else mass_atol
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=tol, msg=lambda m: f"{name}: {m}")


DECODE_CASES = [
    # head_dim, n_slots, groups, dtype, reduce, gain, softcap, window
    (64, 37, 1, torch.float32, "sum", False, None, None),
    (80, 100, 3, torch.float32, "mean", True, None, None),
    (64, 257, 4, torch.float32, "max", True, None, 40),
    (80, 37, 4, torch.float16, "sum", False, 5.0, None),
    (64, 100, 3, torch.float16, "max", True, 5.0, 30),
    (80, 100, 1, torch.float16, "mean", False, None, 25),
    (80, 257, 3, torch.float32, "sum", True, 3.0, 100),
]


def case_id(case):
    """``d64-n37-g1-float32-sum`` plus the options that are on."""
    head_dim, size, groups, dtype, reduce, gain, softcap, window, *rows = case
    size = size if isinstance(size, int) else "+".join(map(str, size))
    flags = [f for f, on in (("gain", gain), ("softcap", softcap), ("window", window)) if on]
    flags += [f"rows{rows[0]}"] if rows and rows[0] else []
    return "-".join([f"d{head_dim}", f"n{size}", f"g{groups}", str(dtype).removeprefix("torch."), reduce, *flags])


@pytest.mark.parametrize(
    "head_dim,n_slots,groups,dtype,reduce,with_gain,softcap,window", DECODE_CASES, ids=map(case_id, DECODE_CASES)
)
def test_decode_matches_reference(head_dim, n_slots, groups, dtype, reduce, with_gain, softcap, window):
    g = torch.Generator().manual_seed(n_slots + groups)
    batch, kv_heads = 3, 2
    query, key, value = tensors(g, dtype, (batch, kv_heads * groups, head_dim), (batch, kv_heads, n_slots, head_dim),
                                (batch, kv_heads, n_slots, head_dim))
    key_pos = slots(g, batch, kv_heads, n_slots, n_slots)
    # a query that sees every filled slot, a padding row, and one that sees only the oldest positions
    query_pos = torch.tensor([2 * n_slots, -1, n_slots // 4])
    gain = torch.tensor([1.7, 0.5, 0.0]) if with_gain else None  # gain 0: uniform over the visible slots
    kwargs = dict(scaling=head_dim**-0.5, softcap=softcap, sliding_window=window, gqa_reduce=reduce, score_gain=gain)
    with poisoned_empty():
        got = decode_attention_with_mass_triton(query, key, value, query_pos, key_pos, **kwargs)
    want = decode_attention_with_mass(query, key, value, query_pos, key_pos, **kwargs)
    assert got.out.dtype == dtype and got.mass.dtype == torch.float32
    # the float16 reference rounds its logits to float16 before the softmax; the kernel keeps float32
    assert_matches(got, want, dtype, mass_atol=1e-5 if dtype == torch.float32 else 1e-3)
    assert (got.out[1] == 0).all() and (got.mass[1] == 0).all()


PREFILL_CASES = [
    # head_dim, (older slots, new slots), groups, dtype, reduce, gain, softcap, window, keep_rows
    (64, (0, 37), 1, torch.float32, "sum", False, None, None, 0),
    (80, (20, 17), 3, torch.float32, "max", True, None, None, 5),
    (64, (60, 40), 4, torch.float32, "mean", True, 5.0, 12, 40),
    (80, (21, 16), 4, torch.float16, "max", False, None, 9, 3),
    (64, (0, 37), 3, torch.float16, "sum", True, 4.0, None, 1),
    (80, (30, 19), 1, torch.float16, "mean", True, None, None, 19),
]


@pytest.mark.parametrize(
    "head_dim,split,groups,dtype,reduce,with_gain,softcap,window,keep_rows",
    PREFILL_CASES,
    ids=map(case_id, PREFILL_CASES),
)
def test_prefill_matches_reference(head_dim, split, groups, dtype, reduce, with_gain, softcap, window, keep_rows):
    """A (chunked) prefill: the new tokens' slots come after older, unordered ones; row 1 is left-padded."""
    older, new = split
    n_slots = older + new
    g = torch.Generator().manual_seed(n_slots + groups)
    batch, kv_heads = 2, 2
    query, key, value = tensors(g, dtype, (batch, kv_heads * groups, new, head_dim),
                                (batch, kv_heads, n_slots, head_dim), (batch, kv_heads, n_slots, head_dim))
    key_pos = slots(g, batch, kv_heads, n_slots, older, new)
    query_pos = torch.arange(2 * older, 2 * older + new).repeat(batch, 1)
    query_pos[1, :3] = -1
    key_pos[1, :, older : older + 3] = -1  # padding tokens occupy no slot
    gain = torch.rand(batch, new, generator=g) * 2 if with_gain else None
    kwargs = dict(scaling=head_dim**-0.5, softcap=softcap, sliding_window=window, gqa_reduce=reduce,
                  score_gain=gain, keep_rows=keep_rows)
    with poisoned_empty():
        got = attention_with_mass_triton(query, key, value, query_pos, key_pos, **kwargs)
    want = attention_with_mass(query, key, value, query_pos, key_pos, **kwargs)
    assert got.rows.shape == (batch, kv_heads, min(keep_rows, new), n_slots)
    assert_matches(got, want, dtype, mass_atol=1e-4)
    assert (got.out[1, :, :3] == 0).all()


def test_dispatcher_runs_triton_on_cpu_under_the_interpreter(monkeypatch):
    g = torch.Generator().manual_seed(1)
    query, key, value = tensors(g, torch.float32, (1, 2, 1, 16), (1, 1, 20, 16), (1, 1, 20, 16))
    key_pos = slots(g, 1, 1, 20, 20)
    query_pos = torch.tensor([[30]])
    monkeypatch.setattr(dispatch, "_requested", dispatch._requested)  # restored after the test
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    dispatch.reload_kernel_choice()
    got = dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.25, keep_rows=1)
    want = attention_with_mass(query, key, value, query_pos, key_pos, scaling=0.25, keep_rows=1)
    assert_matches(got, want, torch.float32, mass_atol=1e-5)
    got = dispatch.decode_attention(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.25)
    want = decode_attention_with_mass(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.25)
    assert_matches(got, want, torch.float32, mass_atol=1e-5)
