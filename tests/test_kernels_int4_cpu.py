"""The int4 CPU ops (``quantized_decode/int4_cpu.py``, C++ in ``int4_cpu.cpp``): their PyTorch references
against the layout's definition (``kernel_inputs.dequantized``), the compiled ops against the references on
odd shapes (slot counts that fill no tile of 8 or 16, strided slices of a larger cache, 1-7 query rows per KV
head, groups that take the AVX-512 path, the AVX2 path and the scalar loops, every scale dtype) with their
outputs poisoned with NaN, their gradients, and what happens when the extension cannot be built. The
quantised decode op that calls them is checked in test_kernels_quantized.py."""

import warnings

import pytest
import torch

from evictlayers.kernels import cpu_extension
from evictlayers.kernels.quantization import PackedKV, quantize_groups
from evictlayers.kernels.quantized_decode import int4_cpu, naive
from kernel_inputs import dequantized, poisoned_empty
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


def codes_of(shape, group, scale_dtype, seed, spare=0):
    """int4 codes, scale and zero point of random ``shape`` ``[B, H, C, D]`` values: a slice of slots 2 ..
    C + 2 of a cache with ``spare`` more slots (so every stride is a larger cache's)."""
    g = torch.Generator().manual_seed(seed)
    batch, heads, slots, dim = shape
    values = torch.randn(batch, heads, slots + 2 + spare, dim, generator=g) * 3
    codes, scale, zero = quantize_groups(values, 4, group, -1, scale_dtype)
    return tuple(t[:, :, 2:slots + 2] for t in (codes, scale, zero))


def codes_order(x):
    """``[..., D]`` natural channel order -> the ops' order: even channels (low nibbles), then odd ones."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


def test_the_references_are_attention_over_the_layouts_dequantised_values():
    """The references dequantise as the layout defines (channel ``2p`` in byte ``p``'s low nibble, ``code *
    scale + zero`` per group), only in the codes' channel order."""
    codes, scale, zero = codes_of((2, 3, 13, 32), 8, torch.bfloat16, 0)
    packed = PackedKV(codes, scale, zero, torch.ones(2, 3, 1, 32), codes, scale, zero, 4, 8)
    keys, _ = dequantized(packed, torch.float32)  # [B, H, C, D], natural order
    g = torch.Generator().manual_seed(1)
    query, probs = torch.randn(2, 3, 4, 32, generator=g), torch.rand(2, 3, 4, 13, generator=g)
    torch.testing.assert_close(int4_cpu.int4_logits_reference(codes_order(query), codes, scale, zero),
                               query @ keys.transpose(-1, -2))
    torch.testing.assert_close(int4_cpu.int4_values_reference(probs, codes, scale, zero), codes_order(probs @ keys))


def test_the_extension_builds_here():
    """Without it every other test here would compare the references with themselves."""
    assert int4_cpu.extension() is not None


CASES = [
    # slots, head dim, group, query rows per KV head, scale dtype (groups of 32 or 64 channels: the AVX-512 loops
    # where the machine has them, 16: the AVX2 ones)
    (1, 64, 32, 3, torch.bfloat16),
    (33, 32, 32, 5, torch.float16),  # AVX-512 at head dim 32: blocks of 4 + 1 rows, tiles of 16 + 16 + 1 slots
    (9, 64, 32, 1, torch.float16),  # one full tile of 8 and one slot
    (100, 64, 16, 4, torch.float32),
    (37, 256, 32, 2, torch.bfloat16),  # Gemma 3's head dim
    (45, 128, 64, 3, torch.bfloat16),  # AVX-512 at head dim 128: blocks of 2 + 1 rows, two 16-byte loads a group
    (23, 48, 16, 3, torch.float16),  # a head dim whose channels are not a multiple of 32
    (19, 64, 32, 7, torch.bfloat16),  # 7 query rows: blocks of 4 + 3 rows (QK), 3 + 3 + 1 (PV)
    (70, 128, 16, 5, torch.float32),  # PV tiles of 32 slots (16 KB): two whole, one of 6
    (17, 64, 8, 3, torch.bfloat16),  # groups under 16 channels: the scalar loops
    (30, 24, 6, 2, torch.float32),
    (11, 32, 2, 1, torch.float16),
    (0, 64, 32, 3, torch.bfloat16),  # no code slots
]


@pytest.mark.parametrize("slots,dim,group,rows,scale_dtype", CASES,
                         ids=[f"c{c}-d{d}-group{k}-g{r}-{str(t).removeprefix('torch.')}" for c, d, k, r, t in CASES])
def test_ops_match_their_references(slots, dim, group, rows, scale_dtype):
    codes, scale, zero = codes_of((3, 2, slots, dim), group, scale_dtype, slots + dim, spare=5)
    g = torch.Generator().manual_seed(7)
    query = torch.randn(3, 2, rows, dim, generator=g)
    # probabilities as the decode passes them: the code slots' columns of a wider row (strided)
    probs = torch.softmax(torch.randn(3, 2, rows, slots + 4, generator=g), -1)[..., 1:slots + 1]
    with poisoned_empty():
        logits = int4_cpu.int4_logits(query, codes, scale, zero)
        out = int4_cpu.int4_values(probs, codes, scale, zero)
    assert not logits.isnan().any() and not out.isnan().any()
    torch.testing.assert_close(logits, int4_cpu.int4_logits_reference(query, codes, scale, zero),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, int4_cpu.int4_values_reference(probs, codes, scale, zero), rtol=1e-4, atol=1e-5)


def test_gradients_match_the_references():
    """Each op's backward is the other op on the same codes; the references' come from autograd."""
    codes, scale, zero = codes_of((2, 3, 21, 64), 32, torch.bfloat16, 3)
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(2, 3, 3, 64, generator=g), torch.rand(2, 3, 3, 21, generator=g)]
    weights = [torch.randn(2, 3, 3, 21, generator=g), torch.randn(2, 3, 3, 64, generator=g)]
    pairs = [(int4_cpu.int4_logits, int4_cpu.int4_logits_reference),
             (int4_cpu.int4_values, int4_cpu.int4_values_reference)]
    for x, weight, (op, reference) in zip(inputs, weights, pairs):
        grads = []
        for fn in (op, reference):
            leaf = x.clone().requires_grad_()
            (fn(leaf, codes, scale, zero) * weight).sum().backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4)


def test_the_compiled_ops_check_their_inputs():
    codes, scale, zero = codes_of((2, 3, 5, 64), 32, torch.bfloat16, 5)
    query = torch.randn(2, 3, 3, 64)
    with pytest.raises(RuntimeError, match="codes must be \\[B, H, C, P\\] uint8 with contiguous bytes"):
        int4_cpu.int4_logits(query, codes.transpose(-1, -2).contiguous().transpose(-1, -2), scale, zero)
    with pytest.raises(RuntimeError, match="query .* must have 2P channels"):
        int4_cpu.int4_logits(query[..., :32], codes, scale, zero)
    with pytest.raises(RuntimeError, match="query must be \\[B, H, G, X\\] float32, got .* BFloat16"):
        int4_cpu.int4_logits(query.bfloat16(), codes, scale, zero)
    with pytest.raises(RuntimeError, match="K dividing P"):
        int4_cpu.int4_values(torch.rand(2, 3, 3, 5), codes, scale[..., :1].expand(2, 3, 5, 3),
                             zero[..., :1].expand(2, 3, 5, 3))
    with pytest.raises(RuntimeError, match="probs .* must have one column per code slot"):
        int4_cpu.int4_values(torch.rand(2, 3, 3, 6), codes, scale, zero)


def test_without_the_extension_the_decode_warns_once_and_dequantises_blocks(monkeypatch, tmp_path):
    """A machine that cannot compile it (no compiler, no ninja) still decodes int4 caches, told why and how to
    fix it: the quantised decode takes its blocks (dequantise a block of slots, then ``torch.matmul``)."""
    import torch.utils.cpp_extension
    from evictlayers.kernels.quantized_decode import cpu as quantized_cpu

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing cached: the build is asked for
    loaded = {name: module for name, module in cpu_extension._BUILT.items() if name != "evictlayers_int4_cpu"}
    monkeypatch.setattr(cpu_extension, "_BUILT", loaded)  # this kernel not loaded yet, the others as they were
    calls = []
    monkeypatch.setattr(quantized_cpu, "int4_logits", lambda *args: calls.append(1))
    codes, scale, zero = codes_of((2, 3, 10, 64), 32, torch.bfloat16, 6)
    packed = PackedKV(codes, scale, zero, torch.ones(2, 3, 1, 64), codes, scale, zero, 4, 32)
    g = torch.Generator().manual_seed(7)
    query, residual = torch.randn(2, 9, 64, generator=g), torch.randn(2, 3, 2, 64, generator=g)
    key_pos = torch.arange(10).expand(2, 3, 10)
    args = (query, packed, residual, residual, torch.full((2,), 12), key_pos, torch.tensor([10, 11]).expand(2, 3, 2))
    with pytest.warns(RuntimeWarning, match="could not compile its int4 CPU kernel .*Ninja is required.*install a C"):
        got = quantized_cpu.quantized_decode_attention_with_mass_cpu(*args, scaling=0.125)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the failed build is remembered
        quantized_cpu.quantized_decode_attention_with_mass_cpu(*args, scaling=0.125)
    assert calls == []
    expected = naive.quantized_decode_attention_with_mass(*args, scaling=0.125)
    torch.testing.assert_close(got.out, expected.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.mass, expected.mass, rtol=1e-4, atol=1e-5)


def test_rows_split_over_threads_give_the_same_result():
    """``at::parallel_for`` hands each thread its own (batch, head) rows and scratch: two threads compute
    what one does, bit for bit."""
    codes, scale, zero = codes_of((3, 4, 29, 64), 32, torch.bfloat16, 8)
    g = torch.Generator().manual_seed(9)
    query, probs = torch.randn(3, 4, 3, 64, generator=g), torch.rand(3, 4, 3, 29, generator=g)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append((int4_cpu.int4_logits(query, codes, scale, zero),
                        int4_cpu.int4_values(probs, codes, scale, zero)))
    torch.set_num_threads(1)
    for one, two in zip(*results):
        assert torch.equal(one, two)


@pytest.mark.parametrize("bits,group,device,built", [(4, 32, "cpu", True), (4, 8, "cpu", True), (8, 32, "cpu", False),
                                                     (4, 1, "cpu", False), (4, 32, "meta", False)])
def test_int4_storage_builds_the_kernel_at_allocation(monkeypatch, bits, group, device, built):
    """The build (about a minute, once per machine) happens when an int4 CPU cache is allocated at prefill,
    not inside the first decode step that uses it; nothing else asks for it."""
    from evictlayers.modules.quantized_kv import QuantizedKV

    calls = []
    monkeypatch.setattr(int4_cpu, "extension", lambda: calls.append(1))
    QuantizedKV(bits, group, 4).allocate(1, 2, 8, 32, 32, torch.float32, device)
    assert calls == ([1] if built else [])


FUSED_CASES = [
    # slots, head dim, group, query rows per KV head, ring entries, ring dtype, options
    (37, 64, 32, 3, 4, torch.float32, {}),
    (9, 64, 16, 1, 0, torch.float32, {"gqa_reduce": "max"}),  # no ring
    (100, 128, 32, 4, 7, torch.bfloat16, {"sliding_window": 40, "softcap": 30.0}),
    (23, 48, 16, 3, 2, torch.float16, {"gqa_reduce": "mean"}),  # a head dim whose channels are not a multiple of 32
    (17, 64, 8, 2, 3, torch.float32, {"score_gain": torch.tensor([0.0, 2.5, 1.0])}),  # groups for the scalar loops
    (5, 64, 32, 3, 5, torch.bfloat16, {"need_mass": False}),
]


@pytest.mark.parametrize("slots,dim,group,rows,ring,ring_dtype,options", FUSED_CASES,
                         ids=[f"c{c}-d{d}-group{k}-g{r}-ring{n}-{str(t).removeprefix('torch.')}-"
                              f"{'-'.join(o) or 'plain'}" for c, d, k, r, n, t, o in FUSED_CASES])
def test_one_op_takes_the_whole_step_and_matches_the_naive_decode(monkeypatch, slots, dim, group, rows, ring,
                                                                  ring_dtype, options):
    """Without a gradient the CPU backend hands the step to ``int4_attention`` (codes and ring in one softmax, the
    ring's mass at its entries' columns): the naive decode's result, empty slots, slots past the query, a padding
    query and a normalised key channel scale included."""
    from evictlayers.kernels.quantized_decode import cpu as quantized_cpu

    monkeypatch.setattr(quantized_cpu, "int4_logits", lambda *args: pytest.fail("the two-op path ran"))
    key_codes, key_scale, key_zero = codes_of((3, 2, slots, dim), group, torch.bfloat16, slots, spare=3)
    value_codes, value_scale, value_zero = codes_of((3, 2, slots, dim), group, torch.bfloat16, slots + 1)
    g = torch.Generator().manual_seed(dim + ring)
    channel_scale = 2.0 ** torch.randint(-2, 3, (3, 2, 1, dim), generator=g).float()
    packed = PackedKV(key_codes, key_scale, key_zero, channel_scale, value_codes, value_scale, value_zero, 4, group)
    query = torch.randn(3, 2 * rows, dim, generator=g)
    ring_keys, ring_values = (torch.randn(3, 2, ring, dim, generator=g).to(ring_dtype) for _ in range(2))
    key_pos = torch.randint(-1, 120, (3, 2, slots), generator=g)
    ring_pos = torch.randint(-1, 120, (3, 2, ring), generator=g)
    query_pos = torch.tensor([119, 60, -1])
    got = quantized_cpu.quantized_decode_attention_with_mass_cpu(
        query, packed, ring_keys, ring_values, query_pos, key_pos, ring_pos, scaling=0.125, **options)
    # the naive decode computes in the ring's dtype; the op in float32, which the same ring in float32 gives exactly
    expected = naive.quantized_decode_attention_with_mass(
        query, packed, ring_keys.float(), ring_values.float(), query_pos, key_pos, ring_pos, scaling=0.125, **options)
    torch.testing.assert_close(got.out, expected.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.lse, expected.lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.mass, expected.mass, rtol=1e-4, atol=1e-5)
    assert (got.out[2] == 0).all() and (got.lse[2] == float("-inf")).all()


def test_a_gradient_takes_the_two_ops_and_the_whole_step_op_checks_its_inputs():
    """``int4_attention`` has no backward: a query that wants a gradient goes through ``int4_logits`` and
    ``int4_values`` (each the other's gradient). Its own checks name what was wrong."""
    from evictlayers.kernels.quantized_decode import cpu as quantized_cpu

    codes, scale, zero = codes_of((2, 3, 10, 64), 32, torch.bfloat16, 6)
    packed = PackedKV(codes, scale, zero, torch.ones(2, 3, 1, 64), codes, scale, zero, 4, 32)
    ring = torch.randn(2, 3, 2, 64)
    assert quantized_cpu.whole_step_serves(torch.randn(2, 9, 64), packed, ring, ring)
    assert not quantized_cpu.whole_step_serves(torch.randn(2, 9, 64, requires_grad=True), packed, ring, ring)
    assert not quantized_cpu.whole_step_serves(torch.randn(2, 9, 64), packed, ring, ring.bfloat16())
    query = torch.randn(2, 9, 64, requires_grad=True)
    args = (query, packed, ring, ring, torch.full((2,), 12), torch.arange(10).expand(2, 3, 10),
            torch.tensor([10, 11]).expand(2, 3, 2))
    quantized_cpu.quantized_decode_attention_with_mass_cpu(*args, scaling=0.125).out.sum().backward()
    torch.testing.assert_close(query.grad, torch.autograd.grad(
        naive.quantized_decode_attention_with_mass(*args, scaling=0.125).out.sum(), query)[0], rtol=1e-4, atol=1e-4)

    grouped = torch.randn(2, 3, 3, 64)
    positions = torch.arange(10).expand(2, 3, 10), torch.tensor([10, 11]).expand(2, 3, 2), torch.full((2,), 12)

    def call(ring_keys=ring, ring_pos=positions[1], query=grouped):
        return int4_cpu.int4_attention(grouped, query, codes, scale, zero, codes, scale, zero, ring_keys, ring,
                                       positions[0], ring_pos, None, positions[2], 0.125, 0.0, -1, None, 0, True)

    with pytest.raises(RuntimeError, match="ring_pos must be \\[B, H, 2\\] int64"):
        call(ring_pos=positions[1][..., :1])
    with pytest.raises(RuntimeError, match="ring_keys must be \\[B, H, R, 64\\] .* one dtype"):
        call(ring_keys=ring.double())
    with pytest.raises(RuntimeError, match="query must be \\[B, H, G, D\\] float32"):
        call(query=grouped[..., :32])


@pytest.mark.parametrize("need_mass", [True, False])
def test_the_ring_over_its_slots_in_one_op_equals_masking_and_folding_around_the_backend(monkeypatch, need_mass):
    """``quantized_ring_attention`` (``QuantizedSlots``' layout: ring entries overlay code slots, -1 for none) on CPU
    hands the overlay to ``int4_attention``, which hides the overlaid code rows and adds each entry's mass to its
    slot; the same call with the overlay built around the backend (masked slot positions, then the mass folded
    with ``scatter_add``) is the reference."""
    from evictlayers.kernels import dispatch

    key_codes, key_scale, key_zero = codes_of((2, 3, 40, 64), 32, torch.bfloat16, 11)
    value_codes, value_scale, value_zero = codes_of((2, 3, 40, 64), 32, torch.bfloat16, 12)
    packed = PackedKV(key_codes, key_scale, key_zero, torch.ones(2, 3, 1, 64), value_codes, value_scale, value_zero,
                      4, 32)
    g = torch.Generator().manual_seed(13)
    query = torch.randn(2, 9, 64, generator=g)
    ring_keys, ring_values = (torch.randn(2, 3, 6, 64, generator=g) for _ in range(2))
    slot_pos = torch.randint(-1, 50, (2, 3, 40), generator=g)
    ring_slot = torch.stack([torch.randperm(40, generator=g)[:6] for _ in range(6)]).view(2, 3, 6)
    ring_slot[0, 1, :2] = -1  # entries holding nothing
    args = (query, packed, ring_keys, ring_values, torch.tensor([49, 30]), slot_pos, ring_slot)
    got = dispatch.quantized_ring_attention(*args, scaling=0.125, need_mass=need_mass)
    monkeypatch.setattr(dispatch, "whole_step_serves", lambda *args: False)
    expected = dispatch.quantized_ring_attention(*args, scaling=0.125, need_mass=need_mass)
    assert got.mass.shape == expected.mass.shape == slot_pos.shape
    for name in ("out", "lse", "mass"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-4, atol=1e-5)
