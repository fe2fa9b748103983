"""Quantisation primitives (kernels/quantization.py) and QuantizedSlots (modules/quantized_kv.py)."""

from __future__ import annotations

import pytest
import torch

from evictlayers.kernels.quantization import dequantize_groups, pack_int4, quantize_groups, unpack_int4
from evictlayers.modules.quantized_kv import QuantizedKV
from tiny_models import single_thread  # noqa: F401

B, H, D = 2, 3, 64


def _loop_reference(x: torch.Tensor, bits: int, group: int, dim: int):
    """Plain per-group loop: unpacked codes, float32 scale (max - min) / levels and zero = min."""
    levels = 2**bits - 1
    rows = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    codes, scale, zero = torch.zeros_like(rows, dtype=torch.uint8), [], []
    for r in range(rows.shape[0]):
        for start in range(0, rows.shape[1], group):
            chunk = rows[r, start : start + group]
            lo, hi = chunk.min(), chunk.max()
            step = (hi - lo) / levels
            scale.append(step)
            zero.append(lo)
            if step > 0:
                codes[r, start : start + group] = ((chunk - lo) / step).round().clamp(0, levels).to(torch.uint8)
    moved = x.movedim(dim, -1).shape
    reduced = (*moved[:-1], moved[-1] // group)
    return (
        codes.reshape(moved).movedim(-1, dim),
        torch.stack(scale).reshape(reduced).movedim(-1, dim),
        torch.stack(zero).reshape(reduced).movedim(-1, dim),
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [1, 4, 32])
@pytest.mark.parametrize("dim", [-1, 1])
def test_quantize_matches_loop_and_bound(bits, group, dim):
    torch.manual_seed(bits * 100 + group)
    x = torch.randn(3, 64, 8 if dim == 1 else 64) * 3 + 1
    x[0, :group, :group] = 0.5  # a constant group: scale 0, exact
    codes, scale, zero = quantize_groups(x, bits, group, dim)
    ref_codes, ref_scale, ref_zero = _loop_reference(x, bits, group, dim)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == x.shape[-1] // (2 if bits == 4 else 1)
    assert torch.equal(unpack_int4(codes) if bits == 4 else codes, ref_codes)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(zero, ref_zero, rtol=0, atol=0)
    error = (x - dequantize_groups(codes, scale, zero, bits, group, dim)).abs()
    assert (error <= ref_scale.repeat_interleave(group, dim) / 2 * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_scales_keep_the_bound(bits, scale_dtype):
    """Rounded down zero points and rounded up scales: the stored grid covers every group."""
    torch.manual_seed(bits)
    x = torch.randn(4, 256) * 5 + torch.linspace(-20, 20, 4)[:, None]
    codes, scale, zero = quantize_groups(x, bits, 16, -1, scale_dtype)
    assert scale.dtype == zero.dtype == scale_dtype
    _, ref_scale, ref_zero = _loop_reference(x, bits, 16, -1)
    # at most one rounding step wider: the zero point moves down by <= eps * |min|, the scale up by <= eps
    eps = torch.finfo(scale_dtype).eps
    widest = (ref_scale + eps * ref_zero.abs() / (2**bits - 1)) * (1 + eps) * (1 + 1e-6)
    assert (scale.float() >= ref_scale).all() and (scale.float() <= widest).all()
    assert (zero.float() <= ref_zero).all()
    error = (x - dequantize_groups(codes, scale, zero, bits, 16)).abs()
    assert (error <= scale.float().repeat_interleave(16, -1) / 2 * (1 + 1e-5) + 1e-6).all()


def test_pack_int4_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    assert pack_int4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21


# ---- QuantizedSlots -------------------------------------------------------------------------------


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    """Random keys ``[B, H, n, D]`` with two outlier channels, as LLM keys have (KIVI Figure 2)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, n, D, generator=generator)
    keys[..., [5, 37]] *= 20
    return keys


def _bound(storage, keys_or_values: str) -> torch.Tensor:
    """Per-element error bound ``[B, H, C, D]`` of the quantised slots (module docstring)."""
    group = storage.config.group
    if keys_or_values == "keys":
        return storage.key_scale.float().repeat_interleave(group, -1) / 2 * storage.key_channel_scale * (1 + 1e-5)
    return storage.value_scale.float().repeat_interleave(group, -1) / 2 * (1 + 1e-5)


def _check(storage, keys, values, exact, held=None):
    """Dense view equal where ``exact`` ``[B, H, C]`` (the ring's tokens) and within the bound of the codes
    on the other ``held`` slots (default: every slot; an empty slot's content is unspecified)."""
    got_keys, got_values = storage.dense()
    coded = ~exact if held is None else held & ~exact
    assert ((got_keys - keys).abs() <= _bound(storage, "keys") + 1e-6)[coded].all()
    assert ((got_values - values).abs() <= _bound(storage, "values") + 1e-6)[coded].all()
    assert torch.equal(got_keys[exact], keys[exact]) and torch.equal(got_values[exact], values[exact])


@pytest.mark.parametrize("bits", [4, 8])
def test_from_dense_round_trip_residual_exact(bits):
    config = QuantizedKV(bits=bits, group=16, residual=4)
    keys, values = _keys(12), torch.randn(B, H, 12, D)
    pos = torch.stack([torch.randperm(12) for _ in range(B * H)]).view(B, H, 12)
    pos[0, 1, :3] = -1  # empty slots
    storage = config.from_dense(keys, values, pos)
    newest = pos >= pos.topk(4, dim=-1).values[..., -1:]
    _check(storage, keys, values, newest & (pos >= 0))
    assert not torch.equal(storage.dense()[0][~newest], keys[~newest])  # the rest really is quantised


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype):
    """16-bit models: scales in the model dtype, the dense view in it too (its rounding on top of the bound)."""
    keys, values = _keys(8).to(dtype), torch.randn(B, H, 8, D, dtype=dtype)
    storage = QuantizedKV(bits=4, group=32, residual=2).from_dense(keys, values, torch.arange(8).expand(B, H, 8))
    assert storage.key_scale.dtype == dtype and storage.ring_keys.dtype == dtype
    got_keys, got_values = storage.dense()
    assert got_keys.dtype == got_values.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert ((got_keys - keys).float().abs() <= _bound(storage, "keys") + eps * keys.float().abs() + 1e-6).all()
    assert ((got_values - values).float().abs() <= _bound(storage, "values") + eps * values.float().abs() + 1e-6).all()
    assert torch.equal(got_keys[:, :, 6:], keys[:, :, 6:])


def test_channel_normalisation_tames_outlier_channels():
    """Per-token key groups alone let the outlier channels set every group's scale (KIVI's argument for
    per-channel keys); the static power-of-two channel scale brings the other channels' error back to
    about what KIVI's per-channel groups of 32 tokens give."""
    keys = _keys(64)
    storage = QuantizedKV(bits=4, group=32, residual=0).from_dense(keys, keys, torch.arange(64).expand(B, H, 64))
    ordinary = torch.ones(D, dtype=torch.bool)
    ordinary[[5, 37]] = False

    def error(deq: torch.Tensor) -> torch.Tensor:
        return (deq - keys)[..., ordinary].abs().mean()

    per_token = error(dequantize_groups(*quantize_groups(keys, 4, 32), 4, 32))
    per_channel = error(dequantize_groups(*quantize_groups(keys, 4, 32, dim=2), 4, 32, dim=2))
    normalised = error(storage.dense()[0])
    assert normalised * 3 < per_token and normalised < 1.5 * per_channel


def test_write_then_dense_round_trip():
    config = QuantizedKV(bits=4, group=32, residual=2)
    storage = config.allocate(B, H, 6, D, D, torch.float32, "cpu")
    keys, values = torch.zeros(B, H, 6, D), torch.zeros(B, H, 6, D)
    exact = torch.zeros(B, H, 6, dtype=torch.bool)
    for t in range(6):
        slot = torch.full((B, H), 5 - t)
        key, value = torch.randn(B, H, D), torch.randn(B, H, D)
        storage.write(slot, key, value, torch.full((B, H), t))
        keys[:, :, 5 - t], values[:, :, 5 - t] = key, value
    exact[:, :, :2] = True  # the two newest: slots 1 and 0
    _check(storage, keys, values, exact)


@pytest.mark.parametrize("value_dim", [D, D // 2])
def test_a_token_is_held_once_dense_then_as_codes(value_dim):
    """KIVI's residual: a real token enters the ring and is not quantised meanwhile; once the ring is full,
    the next real token ages the oldest out, which is then quantised, once, into its own slot (what a
    one-shot quantisation of it gives: its key divided by the channel normalisation). Keys and values of
    the same width are quantised in one call, of different widths in two: both give the one-shot codes."""
    storage = QuantizedKV(bits=4, group=16, residual=2).allocate(B, H, 4, D, value_dim, torch.float32, "cpu")
    channel = torch.ones(B, H, 1, D)
    channel[..., [5, 37]] = 32.0
    storage.key_channel_scale = channel  # what from_dense sets for these outlier channels
    keys = _keys(3, seed=7)
    values = -keys[..., :value_dim]
    for t in range(2):
        storage.write(torch.full((B, H), t), keys[:, :, t], values[:, :, t], torch.full((B, H), t))
    assert not storage.key_codes[:, :, :2].any() and not storage.value_codes[:, :, :2].any()
    storage.write(torch.full((B, H), 2), keys[:, :, 2], values[:, :, 2], torch.full((B, H), 2))
    held = (storage.key_codes, storage.key_scale, storage.key_zero, storage.value_codes, storage.value_scale,
            storage.value_zero)
    one_shot = (*quantize_groups(keys[:, :, :1] / channel, 4, 16, -1, torch.bfloat16),
                *quantize_groups(values[:, :, :1], 4, 16, -1, torch.bfloat16))
    for got, want in zip(held, one_shot, strict=True):
        assert torch.equal(got[:, :, :1], want)
    assert not storage.key_codes[:, :, 1:3].any()  # tokens 1 and 2: still dense only
    assert storage.ring_slot.sort(-1).values.tolist() == [[[1, 2]] * H] * B


def test_slots_freed_and_reused_thousands_of_times_stay_bounded():
    """3000 tokens through 24 slots, random victims: the error of every slot holding a token as codes stays
    within the bound of its own token (nothing is re-quantised), the ring holds the newest real tokens
    exactly, and a padding write (pos -1) neither enters the ring nor ages a token out of it (its slot
    stays empty, so its content is not checked)."""
    torch.manual_seed(0)
    capacity, residual = 24, 5
    storage = QuantizedKV(bits=4, group=16, residual=residual).allocate(B, H, capacity, D, D, torch.float32, "cpu")
    channel = torch.ones(B, H, 1, D)
    channel[..., [5, 37]] = 32.0
    storage.key_channel_scale = channel  # what from_dense sets for these outlier channels
    keys, values = torch.zeros(B, H, capacity, D), torch.zeros(B, H, capacity, D)
    written = torch.full((B, H, capacity), -1)  # position of the token each slot holds
    newest = torch.full((B, H, residual), -1)  # positions of each head's last real writes
    worst = 0.0
    for t in range(3000):
        slot = torch.randint(capacity, (B, H))
        key, value = _keys(1, seed=t)[:, :, 0], torch.randn(B, H, D)
        pos = torch.full((B, H), t)
        if t % 7 == 0:
            pos[0] = -1  # row 0 gets a padding token now and then
        storage.write(slot, key, value, pos)
        at = slot[..., None]
        keys.scatter_(2, at[..., None].expand(B, H, 1, D), key[:, :, None])
        values.scatter_(2, at[..., None].expand(B, H, 1, D), value[:, :, None])
        written.scatter_(2, at, pos[..., None])
        newest = torch.where((pos >= 0)[..., None], torch.cat([newest[..., 1:], pos[..., None]], -1), newest)
        if t % 10 == 0 or t > 2990:
            got_keys, got_values = storage.dense()
            exact = (written >= 0) & (written[..., None] == newest[..., None, :]).any(-1)
            coded = (written >= 0) & ~exact
            ratio = ((got_keys - keys).abs() / _bound(storage, "keys"))[coded]
            worst = max(worst, ratio.max().item() if ratio.numel() else 0.0)
            assert torch.equal(got_keys[exact], keys[exact]) and torch.equal(got_values[exact], values[exact])
    assert worst <= 1.0
    _check(storage, keys, values, exact, held=written >= 0)


def test_block_requantisation_drifts():
    """The rejected design, measured: keys per channel over a block of 32 slots (KIVI's grouping),
    re-quantised on every insertion. Surviving tokens are re-rounded on each new grid and their error
    walks away from the one-shot bound; per-token codes (above) never move."""
    torch.manual_seed(0)
    group = 32
    block = torch.randn(group, D)
    codes, scale, zero = quantize_groups(block, 4, group, dim=0)
    worst = 0.0
    for _ in range(3000):
        dense = dequantize_groups(codes, scale, zero, 4, group, dim=0)
        victim, token = torch.randint(group, ()).item(), torch.randn(D)
        dense[victim], block[victim] = token, token
        codes, scale, zero = quantize_groups(dense, 4, group, dim=0)
        one_shot = (block.amax(0) - block.amin(0)) / 15 / 2
        error = dequantize_groups(codes, scale, zero, 4, group, dim=0) - block
        worst = max(worst, (error.abs() / one_shot).max().item())
    assert worst > 4


def test_gather_keeps_slots_and_ring():
    torch.manual_seed(1)
    config = QuantizedKV(bits=4, group=32, residual=4)
    keys, values = _keys(10), torch.randn(B, H, 10, D)
    pos = torch.arange(10).expand(B, H, 10).contiguous()
    storage = config.from_dense(keys, values, pos)
    index = torch.stack([torch.randperm(10)[:7] for _ in range(B * H)]).view(B, H, 7)
    kept = storage.gather(index)
    along = index[..., None].expand(B, H, 7, D)
    for got, want in zip(kept.dense(), storage.dense()):
        assert torch.equal(got, want.gather(2, along))
    # the next real token ages out the oldest ring entry that still points at a kept slot
    kept.write(torch.zeros(B, H, dtype=torch.long), torch.randn(B, H, D), torch.randn(B, H, D), torch.full((B, H), 10))
    assert (kept.ring_slot[..., 0] == 0).all()


def test_gather_to_fewer_slots_than_the_residual_keeps_the_newest():
    config = QuantizedKV(bits=8, group=16, residual=6)
    keys, values = _keys(8), torch.randn(B, H, 8, D)
    storage = config.from_dense(keys, values, torch.arange(8).expand(B, H, 8).contiguous())
    kept = storage.gather(torch.tensor([7, 0, 6]).expand(B, H, 3).contiguous())
    assert kept.ring_keys.shape[2] == 3
    got_keys, _ = kept.dense()
    assert torch.equal(got_keys[:, :, [0, 2]], keys[:, :, [7, 6]])  # newest two: still in the ring
    assert not torch.equal(got_keys[:, :, 1], keys[:, :, 0])  # oldest: left as codes


def test_grow_adds_empty_slots_and_widens_the_ring():
    config = QuantizedKV(bits=4, group=32, residual=5)
    keys, values = _keys(3), torch.randn(B, H, 3, D)
    storage = config.from_dense(keys, values, torch.arange(3).expand(B, H, 3).contiguous())
    storage.grow(4)
    assert storage.key_codes.shape[2] == 7 and storage.ring_keys.shape[2] == 5
    got_keys, got_values = storage.dense()
    assert torch.equal(got_keys[:, :, :3], keys) and torch.equal(got_values[:, :, :3], values)
    assert not got_keys[:, :, 3:].any()
    for t in range(3, 5):  # two more tokens fill the empty entries: all five newest stay exact
        key = torch.randn(B, H, D)
        storage.write(torch.full((B, H), t), key, key, torch.full((B, H), t))
        keys = torch.cat([keys, key[:, :, None]], 2)
    assert torch.equal(storage.dense()[0][:, :, :5], keys)


def test_index_select_batch_reorders_rows():
    storage = QuantizedKV().from_dense(_keys(40), torch.randn(B, H, 40, D), torch.arange(40).expand(B, H, 40))
    before = storage.dense()
    storage.index_select_batch(torch.tensor([1, 1]))
    for got, want in zip(storage.dense(), before):
        assert torch.equal(got, want[[1, 1]])


@pytest.mark.parametrize("bits, ratio", [(4, 512 / 80), (8, 512 / 144)])
def test_nbytes_formula_and_ratio(bits, ratio):
    capacity, residual, group, scale_bytes, dtype_bytes = 4096, 32, 32, 2, 4
    storage = QuantizedKV(bits, group, residual).allocate(1, 2, capacity, D, D, torch.float32, "cpu")
    per_slot = 2 * D * bits // 8 + 2 * 2 * (D // group) * scale_bytes  # codes + scales + zeros, K and V
    per_head = capacity * per_slot + residual * (2 * D * dtype_bytes + 8) + 8 + D * 4  # ring, cursor, channel scale
    assert storage.nbytes() == 2 * per_head
    dense = 2 * capacity * 2 * D * dtype_bytes
    assert dense / (2 * capacity * per_slot) == pytest.approx(ratio)  # 6.4x for int4, 3.6x for int8
    if bits == 4:
        assert 6 <= dense / storage.nbytes() <= 7


@pytest.mark.parametrize(
    "kwargs, match",
    [({"bits": 3}, "bits"), ({"bits": True}, "bits"), ({"group": 0}, "group"), ({"residual": -1}, "residual")],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedKV(**kwargs)


def test_group_must_divide_head_dim_at_allocation():
    with pytest.raises(ValueError, match=r"group=24.*head dim 64 in layer 3"):
        QuantizedKV(group=24).allocate(1, 1, 8, 64, 64, torch.float32, "cpu", layer=3)
    with pytest.raises(ValueError, match=r"group=16.*value head dim 40"):
        QuantizedKV(group=16).from_dense(torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 4, 40), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match="odd"):
        QuantizedKV(bits=4, group=1).allocate(1, 1, 8, 63, 64, torch.float32, "cpu")


def test_write_and_dense_trace_into_one_graph():
    """No host syncs or data-dependent shapes: both trace under fullgraph=True (eager backend: the
    trace is what is checked, not codegen)."""
    storage = QuantizedKV(bits=4, group=32, residual=3).allocate(B, H, 8, D, D, torch.float32, "cpu")
    write = torch.compile(storage.write, fullgraph=True, backend="eager")
    dense = torch.compile(storage.dense, fullgraph=True, backend="eager")
    key = torch.randn(B, H, D)
    write(torch.full((B, H), 2), key, key, torch.zeros(B, H, dtype=torch.long))
    assert torch.equal(dense()[0][:, :, 2], key)
