"""The quantised decode op (attention over packed codes plus a dense residual): the naive reference against
a float64 loop over the codes dequantised from the layout's definition, and the CPU blockwise backend
against the naive on odd shapes (slot counts that are no multiple of the block count, fewer slots than
blocks, GQA 1-4, padding rows, empty slots, sliding window, softcap, score gain, int4/int8, value heads of
another size, no residual), with every buffer ``torch.empty`` hands out poisoned with NaN. The Triton
backend is checked on the interpreter in test_kernels_triton.py."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._dynamo.utils import counters

from evictlayers.kernels.quantized_decode import cpu as quantized_cpu
from evictlayers.kernels.quantized_decode.cpu import quantized_decode_attention_with_mass_cpu
from evictlayers.kernels.quantized_decode.naive import quantized_decode_attention_with_mass
from kernel_inputs import dequantized, loop_reference, poisoned_empty, quantized_inputs
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


def options(head_dim, softcap=None, window=None, reduce="sum", gain=False, need_mass=True):
    return dict(
        scaling=head_dim**-0.5, softcap=softcap, sliding_window=window, gqa_reduce=reduce,
        score_gain=torch.tensor([1.7, 0.5, 0.0]) if gain else None, need_mass=need_mass,
    )


def assert_matches(got, want, *, atol, mass_atol, need_mass=True):
    assert got.out.dtype == want.out.dtype and got.mass.dtype == torch.float32
    if not need_mass:
        assert (got.mass == 0).all() and got.mass.shape == want.mass.shape
        got = got._replace(mass=want.mass)
    for name, a, b in zip(want._fields, got, want):
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} != {tuple(b.shape)}"
        assert not a.isnan().any(), f"{name} has NaN (an element never written?)"
        tol = mass_atol if name == "mass" else atol  # the LSE is a logit: the output's tolerance
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("softcap,window,reduce,gain", [(None, None, "sum", False), (3.0, 30, "max", True),
                                                       (None, 12, "mean", True)],
                         ids=["plain", "softcap-window-max-gain", "window-mean-gain"])
def test_naive_matches_the_loop_over_the_dequantised_codes(bits, softcap, window, reduce, gain):
    """The reference is dequantise-then-attend: the loop's attention over the codes' values and the
    residual, code slots first (mass ``[B, H_kv, C + R]``)."""
    query, packed, rk, rv, query_pos, key_pos, residual_pos = quantized_inputs(
        bits, 29, 6, head_dim=32, v_dim=16, bits=bits, group=8)
    got = quantized_decode_attention_with_mass(
        query, packed, rk, rv, query_pos, key_pos, residual_pos,
        **options(32, softcap, window, reduce, gain))
    keys, values = dequantized(packed, torch.float32)
    out, mass, _, lse = loop_reference(
        query[:, :, None], torch.cat([keys, rk], 2), torch.cat([values, rv], 2), query_pos[:, None],
        torch.cat([key_pos, residual_pos], 2), 32**-0.5, softcap, window, reduce,
        torch.tensor([[1.7], [0.5], [0.0]]) if gain else None,
    )
    torch.testing.assert_close(got.out.double(), out[:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.mass.double(), mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.lse.double(), lse[:, :, 0], rtol=1e-5, atol=1e-5)
    assert (got.out[1] == 0).all() and (got.mass[1] == 0).all()


CPU_CASES = [
    # n_codes, n_residual, groups, (head_dim, v_dim), bits, group, dtype, softcap, window, reduce, gain, need_mass
    (37, 5, 1, (64, 64), 4, 16, torch.float32, None, None, "sum", False, True),
    (100, 32, 3, (80, 48), 4, 8, torch.float32, 4.0, 60, "max", True, True),
    (257, 0, 4, (64, 64), 8, 32, torch.float32, None, 90, "mean", True, True),
    (5, 3, 2, (32, 32), 4, 1, torch.float32, None, None, "sum", True, True),  # fewer slots than blocks
    (63, 7, 3, (64, 96), 8, 16, torch.float16, 5.0, None, "sum", False, True),
    (101, 9, 4, (64, 64), 4, 32, torch.bfloat16, None, 40, "max", True, False),
    (77, 11, 3, (48, 48), 4, 16, torch.float32, 3.0, 25, "mean", True, False),
]


def cpu_id(case):
    n, r, groups, (d, dv), bits, group, dtype, softcap, window, reduce, gain, need_mass = case
    switches = (("softcap", softcap), ("window", window), ("gain", gain), ("no-mass", not need_mass))
    flags = [f for f, on in switches if on]
    return "-".join([f"c{n}", f"r{r}", f"g{groups}", f"d{d}x{dv}", f"int{bits}", f"group{group}",
                     str(dtype).removeprefix("torch."), reduce, *flags])


@pytest.mark.parametrize("block_bytes", [None, 512], ids=["blocks-by-size", "most-blocks"])
@pytest.mark.parametrize("case", CPU_CASES, ids=map(cpu_id, CPU_CASES))
def test_cpu_matches_naive(case, block_bytes, monkeypatch):
    """Eager, with the blocks these small caches get (one) and with the most blocks (some of them empty
    where the slots are fewer)."""
    if block_bytes is not None:
        monkeypatch.setattr(quantized_cpu, "EAGER_BLOCK_BYTES", block_bytes)
    n_codes, n_residual, groups, (head_dim, v_dim), bits, group, dtype, softcap, window, reduce, gain, need_mass = case
    inputs = quantized_inputs(n_codes + groups, n_codes, n_residual, groups=groups, head_dim=head_dim, v_dim=v_dim,
                              bits=bits, group=group, dtype=dtype)
    kwargs = options(head_dim, softcap, window, reduce, gain, need_mass)
    with poisoned_empty():
        got = quantized_decode_attention_with_mass_cpu(*inputs, **kwargs)
    want = quantized_decode_attention_with_mass(*inputs, **{**kwargs, "need_mass": True})
    # 16-bit caches: the naive multiplies in the cache dtype, the blocks in float32
    low = dtype != torch.float32
    assert_matches(got, want, atol=2e-2 if low else 1e-5, mass_atol=1e-3 if low else 1e-6, need_mass=need_mass)
    assert (got.out[1] == 0).all()


def spy_on_blocks(monkeypatch):
    """The slot counts of the blocks ``cpu.py`` dequantises, appended to the returned list as they are made."""
    lengths = []
    real = quantized_cpu._unpacked

    def spy(*args):
        block = real(*args)
        lengths.append(block.shape[2])
        return block

    monkeypatch.setattr(quantized_cpu, "_unpacked", spy)
    return lengths


@pytest.mark.parametrize("block_bytes,blocks", [(None, 1), (100_000, 4), (30_000, 11), (10_000, 16)])
def test_cpu_never_dequantises_more_than_a_block(monkeypatch, block_bytes, blocks):
    """The point of the backend: no dense copy of the code slots beyond a bounded block. Eager, the int8
    keys of batch 3, 2 KV heads, 203 slots and 64 channels take 3 * 2 * 203 * 64 * 4 = 311,808 float32 bytes:
    one block under the default 2 MiB, ceil(311,808 / 100,000) = 4 blocks of at most 51 slots, 11 of at
    most 19 under 30,000, and no more than ``EAGER_MAX_BLOCKS`` (16, of at most 13 slots) however small
    the allowance."""
    if block_bytes is not None:
        monkeypatch.setattr(quantized_cpu, "EAGER_BLOCK_BYTES", block_bytes)
    lengths = spy_on_blocks(monkeypatch)
    inputs = quantized_inputs(3, 203, 4, bits=8)
    quantized_decode_attention_with_mass_cpu(*inputs, **options(64))
    assert len(lengths) == 2 * blocks  # keys, then values
    assert sum(lengths) == 2 * 203 and max(lengths) == -(-203 // blocks)


@pytest.mark.parametrize("group,blocks", [(16, 0), (2, 0), (1, 1)])
def test_cpu_int4_reads_the_codes_in_registers_when_the_group_is_even(monkeypatch, group, blocks):
    """int4 codes whose groups pack whole bytes go to int4_cpu.py's ops, eager and compiled: no block of
    dequantised slots is made at all. An odd group (a byte's nibbles in two groups) takes the blocks."""
    lengths = spy_on_blocks(monkeypatch)
    inputs = quantized_inputs(3, 203, 4, group=group)
    quantized_decode_attention_with_mass_cpu(*inputs, **options(64))
    assert len(lengths) == 2 * blocks


def test_cpu_eager_scratch_buffers_are_per_thread():
    """Eager, int8 blocks are unpacked into buffers kept between calls: two threads decoding different
    caches at once (and each switching between a large and a small one) still match the reference."""
    cases = [quantized_inputs(seed, n_codes, 4, bits=8) for seed, n_codes in ((1, 300), (2, 37), (3, 150), (4, 61))]
    want = [quantized_decode_attention_with_mass(*inputs, **options(64)) for inputs in cases]

    def decode(order):
        torch.set_num_threads(1)
        return [(i, quantized_decode_attention_with_mass_cpu(*cases[i], **options(64))) for _ in range(20) for i in order]

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(decode, [(0, 1), (2, 3)]))
    for run in runs:
        for i, got in run:
            assert_matches(got, want[i], atol=1e-5, mass_atol=1e-6)


def test_cpu_eager_scratch_buffers_outlive_inference_mode():
    """A thread whose first decode runs under ``torch.inference_mode`` (its scratch buffers made there) can
    decode outside it afterwards, and inside it again."""
    inputs = quantized_inputs(5, 300, 4, bits=8)
    want = quantized_decode_attention_with_mass(*inputs, **options(64))

    def decode():  # a fresh thread: its scratch buffers do not exist yet
        torch.set_num_threads(1)
        with torch.inference_mode():
            first = quantized_decode_attention_with_mass_cpu(*inputs, **options(64))
        return first, quantized_decode_attention_with_mass_cpu(*inputs, **options(64))

    with ThreadPoolExecutor(1) as pool:
        for got in pool.submit(decode).result():
            assert_matches(got, want, atol=1e-5, mass_atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_eager_gradients_match_the_reference(monkeypatch, bits):
    """With grad enabled, the query's gradient is the reference's: through int4_cpu.py's ops (int4), and
    through 11 int8 blocks (each unpacked while the products of the previous ones are saved for the
    backward)."""
    monkeypatch.setattr(quantized_cpu, "EAGER_BLOCK_BYTES", 30_000)
    inputs = quantized_inputs(6, 203, 4, bits=bits)
    grads = []
    for kernel in (quantized_decode_attention_with_mass, quantized_decode_attention_with_mass_cpu):
        query = inputs[0].detach().clone().requires_grad_()
        out = kernel(query, *inputs[1:], **options(64)).out
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append(query.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_compiles_into_one_graph_for_every_slot_count(bits):
    """Under ``torch.compile(fullgraph=True)`` (the decode step's), int4_cpu.py's ops (int4) and the blocks
    (int8) stay symbolic: after the first (static) shape, slot counts that do and do not divide by the block
    count share one dynamic graph."""
    compiled = torch.compile(quantized_decode_attention_with_mass_cpu, fullgraph=True, dynamic=None)
    torch._dynamo.reset()
    counters.clear()
    for n_codes in (100, 131, 256, 301):
        inputs = quantized_inputs(n_codes, n_codes, 4, bits=bits)
        kwargs = options(64, 2.0, 150, "max", True)
        assert_matches(compiled(*inputs, **kwargs), quantized_decode_attention_with_mass(*inputs, **kwargs),
                       atol=1e-5, mass_atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.parametrize("slots,per_byte", [(37, 24), (65, 13), (300, 40)])
def test_codes_as_float_is_each_byte_value_eager_and_compiled(slots, per_byte):
    """The op the blocks convert bytes with, on a strided block of slots holding every byte value, eager and
    under ``torch.compile(fullgraph=True)``, where a second slot count reuses one shape-generic graph."""
    g = torch.Generator().manual_seed(slots)
    codes = torch.randint(0, 256, (3, 2, 2 * slots, per_byte), generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    block = codes[:, :, 1::2]
    got = quantized_cpu.codes_as_float(block)
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor(block.tolist(), dtype=torch.float32))
    compiled = torch.compile(lambda c: quantized_cpu.codes_as_float(c[:, :, 1:]) * 2, fullgraph=True, dynamic=None)
    torch._dynamo.reset()
    counters.clear()
    for n in (slots, slots + 3, slots + 8):
        part = codes[:, :, :n]
        assert torch.equal(compiled(part), torch.tensor(part[:, :, 1:].tolist(), dtype=torch.float32) * 2)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_rejects_codes_that_do_not_fit():
    query, packed, rk, rv, query_pos, key_pos, residual_pos = quantized_inputs(1, 20, 3, head_dim=32, group=8)
    cases = [
        (packed._replace(key_codes=packed.key_codes[..., :8]), key_pos, "key_codes is torch.uint8 .*expected"),
        (packed._replace(value_scale=packed.value_scale[:, :, :5]), key_pos, "value_scale is"),
        (packed._replace(key_channel_scale=packed.key_channel_scale.double()), key_pos, "key_channel_scale is"),
        (packed._replace(bits=3), key_pos, "bits must be 4 or 8"),
        (packed._replace(group=5), key_pos, "group 5 must divide the head dims 32 and 32"),
        (packed, key_pos[:, :1], "key_pos has shape \\(3, 1, 20\\)"),
        # another device ("meta" stands in for a GPU): refused before a kernel reads a pointer
        (packed._replace(value_codes=packed.value_codes.to("meta")), key_pos.to("meta"),
         "value_codes, key_pos must be on the query's device \\(cpu\\)"),
    ]
    for bad, positions, message in cases:
        with pytest.raises(ValueError, match=message):
            quantized_decode_attention_with_mass_cpu(query, bad, rk, rv, query_pos, positions, residual_pos,
                                                     scaling=0.2)
    with pytest.raises(ValueError, match="residual_pos has shape \\(3, 2, 1\\), expected \\(3, 2, 3\\)"):
        quantized_decode_attention_with_mass(query, packed, rk, rv, query_pos, key_pos, residual_pos[:, :, :1],
                                             scaling=0.2)
