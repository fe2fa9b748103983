"""The Triton kernels against their PyTorch references: compiled on a CUDA GPU where there is one, else on
the Triton CPU interpreter.

Without CUDA, ``TRITON_INTERPRET=1`` must be set before the kernels are decorated (``triton.jit`` reads it
then), so it is set here, before the kernel modules are imported. Inputs are built on the CPU and moved to
the kernels' device; the references run on the CPU. bfloat16 cases run on CUDA only: the interpreter's
``tl.dot`` is wrong for bfloat16, so there the kernels upcast and the case would test nothing new. Their
reference takes the same bfloat16 values in float32 (a bfloat16 reference rounds its logits to 8 bits).
The interpreter is slow: shapes are small and the
parametrisation covers each feature (head dims 64/80, value heads of another size, odd slot counts,
GQA groups 1/2/3/4, the three reductions, gain, softcap, window, kept rows, the mass skipped,
float32/float16; for the quantised decode int4/int8 codes, group sizes, a residual or none) in a handful of
cases rather than their product. Every buffer ``torch.empty`` hands
out during a kernel call is filled with NaN, and so is the ``lse_out`` buffer passed in, so an output
element the kernels forget to write, or a scratch value read before it is written, fails the test.
"""

import functools
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
_loaded = sys.modules.get("evictlayers.kernels.decode.triton")
if not CUDA and _loaded is not None and type(_loaded._split_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
DEVICE = torch.device("cuda" if CUDA else "cpu")

from evictlayers.kernels import dispatch  # noqa: E402
from evictlayers.kernels.decode.naive import decode_attention_with_mass  # noqa: E402
from evictlayers.kernels.decode.triton import decode_attention_with_mass_triton  # noqa: E402
from evictlayers.kernels.prefill import triton as prefill_triton  # noqa: E402
from evictlayers.kernels.prefill.naive import attention_with_mass  # noqa: E402
from evictlayers.kernels.prefill.triton import attention_with_mass_triton  # noqa: E402
from evictlayers.kernels.quantized_decode.naive import quantized_decode_attention_with_mass  # noqa: E402
from evictlayers.kernels.quantized_decode.triton import quantized_decode_attention_with_mass_triton  # noqa: E402
from kernel_inputs import compare_prefill, on_device, poisoned_empty, prefill_inputs, quantized_inputs  # noqa: E402
from tiny_models import single_thread  # noqa: E402,F401 (autouse fixture)

pytestmark = [
    pytest.mark.triton,
    # a CUDA GPU computes float32 products in TF32 unless told otherwise: the references must not
    pytest.mark.usefixtures("exact_float32"),
    # the interpreter evaluates both sides of tl.where with numpy: -inf - -inf in the unused side warns
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]


BF16_NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="bfloat16 tl.dot is wrong on the Triton CPU interpreter")


def to_device(value):
    """``kernel_inputs.on_device`` on the kernels' device."""
    return on_device(value, DEVICE)


def on_cpu(result):
    """A kernel's result (a namedtuple of tensors) on the CPU."""
    return type(result)(*(t.cpu() for t in result))


def reference_inputs(inputs, dtype):
    """What the reference attends over: the inputs themselves, except that bfloat16 tensors are taken in
    float32 (the same values; a bfloat16 reference would round its logits to 8 bits of mantissa)."""
    if dtype != torch.bfloat16:
        return inputs
    return [t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t for t in inputs]


def slots(g, batch, kv_heads, n_slots, older, new=0):
    """``[B, H_kv, N]`` positions: ``older`` shuffled slots holding positions below 2 * older with ~20%
    empty (-1), then ``new`` slots in order holding positions 2 * older, 2 * older + 1, ..."""
    old = torch.stack([torch.randperm(2 * older, generator=g)[:older] for _ in range(batch * kv_heads)])
    old[torch.rand(old.shape, generator=g) < 0.2] = -1
    fresh = torch.arange(2 * older, 2 * older + new).expand(batch * kv_heads, new)
    return torch.cat([old, fresh], dim=1).view(batch, kv_heads, n_slots)


def tensors(g, dtype, *shapes):
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


OUT_ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_matches(got, want, dtype, mass_atol):
    atol = OUT_ATOL[dtype]
    for name, a, b in zip(want._fields, got, want):
        assert not a.isnan().any(), f"{name} has NaN (an element never written?)"
        tol = atol if name == "out" else mass_atol
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=tol, msg=lambda m: f"{name}: {m}")


DECODE_CASES = [
    # (head_dim, v_dim), n_slots, groups, dtype, reduce, gain, softcap, window
    ((64, 64), 37, 1, torch.float32, "sum", False, None, None),
    ((80, 48), 100, 3, torch.float32, "mean", True, None, None),
    ((64, 64), 257, 4, torch.float32, "max", True, None, 40),
    ((80, 80), 37, 4, torch.float16, "sum", False, 5.0, None),
    ((64, 64), 100, 3, torch.float16, "max", True, 5.0, 30),
    ((80, 80), 100, 1, torch.float16, "mean", False, None, 25),
    ((80, 96), 257, 3, torch.float32, "sum", True, 3.0, 100),
    ((64, 64), 257, 3, torch.bfloat16, "sum", True, None, 40),
    ((128, 128), 100, 4, torch.bfloat16, "max", False, 5.0, None),
]


def case_id(case):
    """``d64-n37-g1-float32-sum`` plus the options that are on."""
    (head_dim, v_dim), size, groups, dtype, reduce, gain, softcap, window, *more = case
    size = size if isinstance(size, int) else "+".join(map(str, size))
    flags = [f"dv{v_dim}"] if v_dim != head_dim else []
    flags += [f for f, on in (("gain", gain), ("softcap", softcap), ("window", window)) if on]
    if more:
        rows, need_mass = more
        flags += ([f"rows{rows}"] if rows else []) + ([] if need_mass else ["no-mass"])
    return "-".join([f"d{head_dim}", f"n{size}", f"g{groups}", str(dtype).removeprefix("torch."), reduce, *flags])


def params(cases, ids=case_id):
    """``cases`` as pytest params named by ``ids``, the bfloat16 ones marked to need CUDA."""
    return [pytest.param(*case, id=ids(case), marks=[BF16_NEEDS_CUDA] if torch.bfloat16 in case else [])
            for case in cases]


@pytest.mark.parametrize("dims,n_slots,groups,dtype,reduce,with_gain,softcap,window", params(DECODE_CASES))
def test_decode_matches_reference(dims, n_slots, groups, dtype, reduce, with_gain, softcap, window):
    head_dim, v_dim = dims
    g = torch.Generator().manual_seed(n_slots + groups)
    batch, kv_heads = 3, 2
    query, key, value = tensors(g, dtype, (batch, kv_heads * groups, head_dim), (batch, kv_heads, n_slots, head_dim),
                                (batch, kv_heads, n_slots, v_dim))
    key_pos = slots(g, batch, kv_heads, n_slots, n_slots)
    # a query that sees every filled slot, a padding row, and one that sees only the oldest positions
    query_pos = torch.tensor([2 * n_slots, -1, n_slots // 4])
    gain = torch.tensor([1.7, 0.5, 0.0]) if with_gain else None  # gain 0: uniform over the visible slots
    kwargs = dict(scaling=head_dim**-0.5, softcap=softcap, sliding_window=window, gqa_reduce=reduce, score_gain=gain)
    inputs = (query, key, value, query_pos, key_pos)
    with poisoned_empty():
        got = on_cpu(decode_attention_with_mass_triton(*to_device(inputs), **to_device(kwargs)))
    want = decode_attention_with_mass(*reference_inputs(inputs, dtype), **kwargs)
    assert got.out.dtype == dtype and got.mass.dtype == torch.float32
    # the float16 reference rounds its logits to float16 before the softmax; the kernel keeps float32
    assert_matches(got, want, dtype, mass_atol=1e-3 if dtype == torch.float16 else 1e-5)
    assert (got.out[1] == 0).all() and (got.mass[1] == 0).all()


def test_decode_without_the_mass_keeps_output_and_lse():
    """``need_mass=False``: no logits are cached and no mass pass runs; the mass is zeros, the rest the reference's
    (here with the query positions a strided view)."""
    g = torch.Generator().manual_seed(5)
    query, key, value = tensors(g, torch.float32, (2, 6, 64), (2, 2, 70, 64), (2, 2, 70, 64))
    key_pos = slots(g, 2, 2, 70, 70)
    query_pos = torch.tensor([[140, 7], [-1, 7]])[:, 0]  # a strided view: the kernel must not assume stride 1
    kwargs = dict(scaling=0.125, sliding_window=50, score_gain=torch.tensor([1.5, 0.5]))
    inputs = (query, key, value, query_pos, key_pos)
    with poisoned_empty():
        got = on_cpu(decode_attention_with_mass_triton(*to_device(inputs), **to_device(kwargs), need_mass=False))
    want = decode_attention_with_mass(query, key, value, query_pos, key_pos, **kwargs)
    assert (got.mass == 0).all() and got.mass.shape == want.mass.shape
    assert_matches(got._replace(mass=want.mass), want, torch.float32, mass_atol=1e-5)


QUANTIZED_CASES = [
    # n_codes, n_residual, groups, (head_dim, v_dim), bits, group, dtype, softcap, window, reduce, gain, need_mass
    (37, 5, 1, (64, 64), 4, 16, torch.float32, None, None, "sum", False, True),
    (100, 0, 3, (80, 48), 4, 8, torch.float32, 4.0, 60, "max", True, True),
    (57, 17, 4, (64, 96), 8, 32, torch.float16, None, 40, "mean", True, True),
    (41, 6, 2, (32, 32), 4, 1, torch.float16, 3.0, None, "sum", True, False),
    (200, 13, 3, (64, 64), 4, 32, torch.bfloat16, None, None, "sum", True, True),
    (73, 9, 4, (128, 128), 8, 32, torch.bfloat16, 5.0, 50, "max", False, True),
]


def quantized_case_id(case):
    """``c37-r5-d64x64-int4-group16-float32``."""
    n_codes, n_residual, _, (head_dim, v_dim), bits, group, dtype, *_ = case
    return f"c{n_codes}-r{n_residual}-d{head_dim}x{v_dim}-int{bits}-group{group}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", [pytest.param(c, id=p.id, marks=p.marks)
                                  for c, p in zip(QUANTIZED_CASES, params(QUANTIZED_CASES, quantized_case_id))])
def test_quantized_decode_matches_reference(case):
    """The codes dequantised in registers against dequantise-then-attend, with a residual after the codes
    (or none), padding and empty slots; ``need_mass=False`` must leave the mass at zero."""
    n_codes, n_residual, groups, dims, bits, group, dtype, softcap, window, reduce, with_gain, need_mass = case
    head_dim, v_dim = dims
    inputs = quantized_inputs(n_codes, n_codes, n_residual, groups=groups, head_dim=head_dim, v_dim=v_dim, bits=bits,
                              group=group, dtype=dtype)
    kwargs = dict(scaling=head_dim**-0.5, softcap=softcap, sliding_window=window, gqa_reduce=reduce,
                  score_gain=torch.tensor([1.7, 0.5, 0.0]) if with_gain else None)
    with poisoned_empty():
        got = on_cpu(quantized_decode_attention_with_mass_triton(*to_device(inputs), **to_device(kwargs),
                                                                 need_mass=need_mass))
    # the kernel dequantises into the residual's dtype, a float32 reference into float32: with bfloat16 the
    # codes' rounding moves the logits by ~1e-2 of their size, hence the wider mass tolerance
    want = quantized_decode_attention_with_mass(*reference_inputs(inputs, dtype), **kwargs)
    assert got.out.dtype == dtype and got.mass.shape == (3, 2, n_codes + n_residual)
    if not need_mass:
        assert (got.mass == 0).all()
        got = got._replace(mass=want.mass)
    assert_matches(got, want, dtype, mass_atol={torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype])
    assert (got.out[1] == 0).all()


def _wider_view(t):
    """``t``'s values in the first columns of a buffer twice as wide: last dim contiguous, other strides
    unlike ``t``'s."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def test_quantized_decode_reads_zero_points_by_their_own_strides():
    """Zero points laid out unlike the scales (as a compiled graph may hand them over): the kernel must
    not index them with the scales' strides."""
    query, packed, *rest = quantized_inputs(5, 37, 5, groups=2, bits=4, group=16, dtype=torch.float32)
    # laid out on the kernels' device: moving a view with gaps there would make it dense again
    on_kernel_device = to_device(packed)
    moved = on_kernel_device._replace(key_zero=_wider_view(on_kernel_device.key_zero),
                                      value_zero=_wider_view(on_kernel_device.value_zero))
    assert moved.key_zero.stride() != moved.key_scale.stride() and moved.key_zero.stride(-1) == 1
    kwargs = dict(scaling=64**-0.5, softcap=None, sliding_window=None, gqa_reduce="sum", score_gain=None)
    with poisoned_empty():
        got = on_cpu(quantized_decode_attention_with_mass_triton(to_device(query), moved, *to_device(tuple(rest)),
                                                                 **kwargs, need_mass=True))
    want = quantized_decode_attention_with_mass(*reference_inputs((query, packed, *rest), torch.float32), **kwargs)
    assert_matches(got, want, torch.float32, mass_atol=1e-5)


PREFILL_CASES = [
    # (head_dim, v_dim), (older slots, new slots), groups, dtype, reduce, gain, softcap, window, keep_rows, need_mass
    ((64, 64), (0, 37), 1, torch.float32, "sum", False, None, None, 0, True),
    ((80, 48), (20, 17), 3, torch.float32, "max", True, None, None, 5, True),
    ((64, 64), (60, 40), 4, torch.float32, "mean", True, 5.0, 12, 40, False),
    ((80, 80), (21, 16), 4, torch.float16, "max", False, None, 9, 3, True),
    ((64, 96), (0, 37), 3, torch.float16, "sum", True, 4.0, None, 1, False),
    ((80, 80), (30, 19), 1, torch.float16, "mean", True, None, None, 19, True),
    ((64, 64), (10, 21), 2, torch.float32, "sum", True, None, 7, 0, False),
    ((64, 64), (40, 90), 3, torch.bfloat16, "sum", True, None, None, 4, True),
    ((128, 128), (0, 70), 4, torch.bfloat16, "max", False, 5.0, 30, 0, True),
]


@pytest.mark.parametrize("dims,split,groups,dtype,reduce,with_gain,softcap,window,keep_rows,need_mass",
                         params(PREFILL_CASES))
def test_prefill_matches_reference(dims, split, groups, dtype, reduce, with_gain, softcap, window, keep_rows,
                                   need_mass):
    """A (chunked) prefill: the new tokens' slots come after older, unordered ones; row 1 is left-padded.
    ``lse_out`` is always asked for; ``need_mass=False`` must leave the mass at zero."""
    head_dim, v_dim = dims
    older, new = split
    inputs = prefill_inputs(older + new + groups, older, new, groups=groups, head_dim=head_dim, v_dim=v_dim,
                            dtype=dtype)
    gain = torch.rand(2, new, generator=torch.Generator().manual_seed(new)) * 2 if with_gain else None
    got = compare_prefill(
        attention_with_mass_triton, inputs, out_atol=OUT_ATOL[dtype], mass_atol=1e-4, rtol=1e-3, device=DEVICE,
        reference_dtype=torch.float32 if dtype == torch.bfloat16 else None, scaling=head_dim**-0.5, softcap=softcap,
        sliding_window=window, gqa_reduce=reduce, score_gain=gain, keep_rows=keep_rows, need_mass=need_mass,
    )
    assert got.rows.shape == (2, 2, min(keep_rows, new), older + new)
    assert (got.out[1, :, :3] == 0).all()


@pytest.mark.parametrize("dims,split,groups,dtype,reduce,with_gain,softcap,window,keep_rows,need_mass",
                         params([case for case in PREFILL_CASES if case[-1]]))
@pytest.mark.parametrize("programs", ["per item", "one"])
def test_prefill_one_pass_matches_reference(dims, split, groups, dtype, reduce, with_gain, softcap, window, keep_rows,
                                            need_mass, programs):
    """The one-pass form (output and mass from the same logits, through a scratch) against the reference: with
    a program per query block, and with one program that takes every block in turn over the same scratch
    (a ``max_chunk_elements`` of one block's scratch), so that a block reading what the last one wrote fails."""
    head_dim, v_dim = dims
    older, new = split
    inputs = prefill_inputs(older + new + groups, older, new, groups=groups, head_dim=head_dim, v_dim=v_dim,
                            dtype=dtype)
    gain = torch.rand(2, new, generator=torch.Generator().manual_seed(new)) * 2 if with_gain else None
    block = 16 if prefill_triton.interpreting() else 64
    budget = 1 << 24 if programs == "per item" else block * prefill_triton.cdiv(older + new, block) * block
    n_blocks = prefill_triton.cdiv(new, block) * 2 * 2 * groups
    assert prefill_triton.one_pass_programs(older + new, n_blocks, block, budget) == (
        n_blocks if programs == "per item" else 1)
    got = compare_prefill(
        functools.partial(attention_with_mass_triton, passes=1), inputs, out_atol=OUT_ATOL[dtype], mass_atol=1e-4,
        rtol=1e-3, device=DEVICE, reference_dtype=torch.float32 if dtype == torch.bfloat16 else None,
        scaling=head_dim**-0.5, softcap=softcap, sliding_window=window, gqa_reduce=reduce, score_gain=gain,
        keep_rows=keep_rows, max_chunk_elements=budget,
    )
    assert (got.out[1, :, :3] == 0).all()


IN_ORDER_CASES = [
    # as PREFILL_CASES
    ((64, 64), (0, 37), 3, torch.float32, "sum", False, None, None, 5, True),
    ((80, 48), (23, 18), 2, torch.float32, "mean", True, None, 9, 18, True),
    ((80, 80), (0, 33), 2, torch.float16, "max", True, 5.0, 9, 0, True),
    ((64, 64), (40, 90), 3, torch.bfloat16, "sum", True, None, 30, 4, True),
    ((128, 128), (0, 70), 4, torch.bfloat16, "max", False, None, None, 1, True),
]


@pytest.mark.parametrize("dims,split,groups,dtype,reduce,with_gain,softcap,window,keep_rows,need_mass",
                         params(IN_ORDER_CASES))
@pytest.mark.parametrize("passes", [1, 2])
def test_prefill_in_order_matches_reference(dims, split, groups, dtype, reduce, with_gain, softcap, window, keep_rows,
                                            need_mass, passes, monkeypatch):
    """Slots in position order (a whole prompt, or a chunk after in-order slots, each row from its own first
    position), where the kernels find the tiles a block sees from the indices alone (at any size here)."""
    monkeypatch.setattr(prefill_triton, "IN_ORDER_MIN_SLOTS", 0)
    head_dim, v_dim = dims
    older, new = split
    query, key, value, _, _ = prefill_inputs(older + new + groups, older, new, groups=groups, head_dim=head_dim,
                                             v_dim=v_dim, dtype=dtype)
    first = torch.tensor([0, 5])  # each row's first position
    key_pos = (first[:, None] + torch.arange(older + new)).repeat_interleave(2, dim=0).view(2, 2, -1)
    query_pos = key_pos[:, 0, older:].contiguous()
    assert prefill_triton.in_order(query_pos, key_pos)
    gain = torch.rand(2, new, generator=torch.Generator().manual_seed(new)) * 2 if with_gain else None
    compare_prefill(
        functools.partial(attention_with_mass_triton, passes=passes), (query, key, value, query_pos, key_pos),
        out_atol=OUT_ATOL[dtype], mass_atol=1e-4, rtol=1e-3, device=DEVICE,
        reference_dtype=torch.float32 if dtype == torch.bfloat16 else None, scaling=head_dim**-0.5, softcap=softcap,
        sliding_window=window, gqa_reduce=reduce, score_gain=gain, keep_rows=keep_rows, need_mass=need_mass,
    )


def test_prefill_passes_are_checked():
    """``passes`` other than 1, 2 or None, and one pass without the mass or without room for one block's
    scratch, are refused, naming what was wrong."""
    query, key, value, query_pos, key_pos = to_device(tuple(prefill_inputs(40, 0, 37, groups=1, head_dim=64,
                                                                            v_dim=64, dtype=torch.float32)))
    call = functools.partial(attention_with_mass_triton, query, key, value, query_pos, key_pos, scaling=0.125)
    with pytest.raises(ValueError, match="passes must be 1, 2 or None"):
        call(passes=3)
    with pytest.raises(ValueError, match="need_mass=False"):
        call(passes=1, need_mass=False)
    with pytest.raises(ValueError, match="max_chunk_elements=100"):
        call(passes=1, max_chunk_elements=100)


def test_prefill_passes_rule():
    """One pass only where it was measured faster: a program for every item, and at most
    ``ONE_PASS_MAX_SLOTS`` slots."""
    most = prefill_triton.ONE_PASS_MAX_SLOTS
    assert prefill_triton.passes_for(most, 288, 288) == 1
    assert prefill_triton.passes_for(most + 1, 288, 288) == 2
    assert prefill_triton.passes_for(most, 287, 288) == 2
    assert prefill_triton.passes_for(16, 0, 1) == 2


def test_dispatcher_runs_triton_when_asked(monkeypatch):
    """``EVICTLAYERS_KERNELS=triton``: the Triton kernels serve CUDA tensors, and CPU tensors under the
    interpreter."""
    g = torch.Generator().manual_seed(1)
    inputs = tensors(g, torch.float32, (1, 2, 1, 16), (1, 1, 20, 16), (1, 1, 20, 16))
    inputs += [torch.tensor([[30]]), slots(g, 1, 1, 20, 20)]
    query, key, value, query_pos, key_pos = to_device(tuple(inputs))
    monkeypatch.setattr(dispatch, "_requested", dispatch._requested)  # restored after the test
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    dispatch.reload_kernel_choice()
    # a strided lse_out (every other element of a buffer) is filled too
    lse, want_lse = torch.full((1, 2, 2), float("nan"), device=DEVICE)[:, :, :1], torch.empty(1, 2, 1)
    assert dispatch.prefill_backend(query) == dispatch.decode_backend(query) == "triton"
    got = dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.25, keep_rows=1, lse_out=lse)
    want = attention_with_mass(*inputs, scaling=0.25, keep_rows=1, lse_out=want_lse)
    assert_matches(on_cpu(got), want, torch.float32, mass_atol=1e-5)
    assert not lse.is_contiguous()
    torch.testing.assert_close(lse.cpu(), want_lse)
    got = dispatch.decode_attention(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.25)
    query, key, value, query_pos, key_pos = inputs
    want = decode_attention_with_mass(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.25)
    assert_matches(on_cpu(got), want, torch.float32, mass_atol=1e-5)
