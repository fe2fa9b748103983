"""Inputs and checks shared by the kernel tests: odd-shaped slot layouts, NaN-poisoned buffers, and the
comparison of a backend with the naive reference.

``flash_mask_spy`` records the ``attn_mask`` the CPU decode backend hands the fused op at every call.

``loop_reference`` is the independent reference the naive kernels are tested against: one query, one
head, one slot at a time in float64, with the visibility rules written out.
"""

from __future__ import annotations

import contextlib
import math

import torch

from evictlayers.kernels.decode import cpu as decode_cpu
from evictlayers.kernels.prefill.naive import attention_with_mass


def flash_mask_spy(monkeypatch) -> list:
    """Wrap ``kernels/decode/cpu.py``'s fused op; returns the list its calls' ``attn_mask`` go to, in call
    order (``None`` for an unmasked call)."""
    masks = []
    real = decode_cpu._FLASH

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_cpu, "_FLASH", spy)
    return masks


def prefill_inputs(seed, older, new, *, groups=3, kv_heads=2, head_dim=24, v_dim=None, batch=2, dtype=torch.float32):
    """A (chunked) prefill: ``older`` unordered slots with ~20% holes (positions below ``2 * older``),
    then ``new`` in-order slots for the chunk's queries. Row 1 is left-padded by 3 tokens (padding
    queries at -1, their slots empty). Returns query ``[B, H_q, new, D]``, key ``[B, H_kv, N, D]``, value
    ``[B, H_kv, N, D_v]``, query_pos ``[B, new]``, key_pos ``[B, H_kv, N]``."""
    g = torch.Generator().manual_seed(seed)
    n_slots = older + new
    query = torch.randn(batch, kv_heads * groups, new, head_dim, generator=g).to(dtype)
    key = torch.randn(batch, kv_heads, n_slots, head_dim, generator=g).to(dtype)
    value = torch.randn(batch, kv_heads, n_slots, v_dim or head_dim, generator=g).to(dtype)
    old = torch.stack([torch.randperm(2 * older, generator=g)[:older] for _ in range(batch * kv_heads)])
    old[torch.rand(old.shape, generator=g) < 0.2] = -1
    fresh = torch.arange(2 * older, 2 * older + new).expand(batch * kv_heads, new)
    key_pos = torch.cat([old, fresh], dim=1).view(batch, kv_heads, n_slots)
    query_pos = torch.arange(2 * older, 2 * older + new).repeat(batch, 1)
    if batch > 1:
        query_pos[1, :3] = -1
        key_pos[1, :, older : older + 3] = -1
    return query, key, value, query_pos, key_pos


@contextlib.contextmanager
def poisoned_empty():
    """Make ``torch.empty`` return NaN-filled float tensors for the duration, so an output element a
    kernel forgets to write, or a scratch value read before it is written, shows up as NaN."""
    real = torch.empty

    def empty(*args, **kwargs):
        tensor = real(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def on_device(value, device):
    """``value`` (a tensor, ``None``, or a tuple/namedtuple/dict of them) on ``device`` (``None``: as it is)."""
    if isinstance(value, torch.Tensor):
        return value if device is None else value.to(device)
    if isinstance(value, dict):
        return {name: on_device(v, device) for name, v in value.items()}
    if isinstance(value, tuple):
        moved = [on_device(v, device) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    return value


def nan_lse(query, device=None):
    """A NaN-filled ``lse_out`` buffer for ``query`` ``[B, H_q, Q, D]``: every element must be written."""
    return torch.full(query.shape[:3], float("nan"), dtype=torch.float32, device=device)


def compare_prefill(kernel, inputs, *, out_atol=1e-5, mass_atol=1e-5, rtol=1e-4, device=None, reference_dtype=None,
                    **options):
    """Run ``kernel`` and the naive reference on ``inputs`` with ``options``, both with a NaN-filled
    ``lse_out`` and the kernel's own allocations poisoned; assert out, mass, rows and lse agree.

    ``device``: where the kernel runs (its inputs and options are moved there; the reference runs on the
    CPU). ``reference_dtype``: the dtype the reference takes the floating-point inputs in (default theirs).
    With ``need_mass=False`` in ``options`` the kernel's mass must be exactly zero and everything
    else must match the reference run with the mass. Returns the kernel's result, on the CPU."""
    query = inputs[0]
    need_mass = options.pop("need_mass", True)
    got_lse, want_lse = nan_lse(query, device), nan_lse(query)
    with poisoned_empty():
        got = kernel(*on_device(tuple(inputs), device), **on_device(options, device), lse_out=got_lse,
                     need_mass=need_mass)
    got, got_lse = type(got)(*(t.cpu() for t in got)), got_lse.cpu()
    if reference_dtype is not None:
        inputs = [t.to(reference_dtype) if t.is_floating_point() else t for t in inputs]
    want = attention_with_mass(*inputs, **options, lse_out=want_lse)
    assert got.out.dtype == query.dtype and got.mass.dtype == got.rows.dtype == torch.float32
    if not need_mass:
        assert (got.mass == 0).all(), "need_mass=False must leave the mass at zero"
        got = got._replace(mass=want.mass)
    for name, a, b, atol in zip(("out", "mass", "rows", "lse"), (*got, got_lse), (*want, want_lse),
                                (out_atol, mass_atol, mass_atol, out_atol)):
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} != {tuple(b.shape)}"
        assert not a.isnan().any(), f"{name} has NaN (an element never written?)"
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    return got


def loop_reference(query, key, value, query_pos, key_pos, scaling, softcap=None, window=None, reduce="sum", gain=None):
    """Prefill attention one query, one head, one slot at a time in float64.

    Returns ``(out [B, H_q, Q, D_v], mass [B, H_kv, N], rows [B, H_kv, Q, N], lse [B, H_q, Q])``: ``rows``
    are every query's scoring probabilities reduced over its GQA group, ``lse`` the log-sum-exp of the
    model's logits (``-inf`` for a query that sees nothing)."""
    batch, q_heads, q_len, _ = query.shape
    kv_heads, n_slots = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    out = torch.zeros(batch, q_heads, q_len, value.shape[-1], dtype=torch.float64)
    head_mass = torch.zeros(batch, q_heads, n_slots, dtype=torch.float64)
    head_rows = torch.zeros(batch, q_heads, q_len, n_slots, dtype=torch.float64)
    lse = torch.full((batch, q_heads, q_len), -math.inf, dtype=torch.float64)
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
                top = max(logits)
                lse[b, h, i] = top + math.log(sum(math.exp(x - top) for x in logits))
                for j, p in zip(visible, _softmax(logits)):
                    out[b, h, i] += p * value[b, kv, j].double()
                scores = _softmax([x * float(gain[b, i]) for x in logits]) if gain is not None else _softmax(logits)
                for j, p in zip(visible, scores):
                    head_mass[b, h, j] += p
                    head_rows[b, h, i, j] = p
    grouped = head_mass.view(batch, kv_heads, groups, n_slots)
    grouped_rows = head_rows.view(batch, kv_heads, groups, q_len, n_slots)
    combine = {"sum": lambda t: t.sum(2), "mean": lambda t: t.mean(2), "max": lambda t: t.amax(2)}[reduce]
    return out, combine(grouped), combine(grouped_rows), lse


def _softmax(logits):
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def quantized_inputs(seed, n_codes, n_residual, *, groups=3, kv_heads=2, head_dim=64, v_dim=None, bits=4, group=16,
                     dtype=torch.float32):
    """Decode inputs of the quantised op over ``n_codes`` code slots and ``n_residual`` dense residual slots,
    batch 3: query ``[3, H_q, D]``, a ``PackedKV`` (keys normalised by power-of-two channel scales, as
    ``QuantizedKV`` holds them; 16-bit scales), residual keys/values in ``dtype``, query_pos ``[3]``,
    key_pos ``[3, H_kv, C]``, residual_pos ``[3, H_kv, R]``.

    Every slot holds a distinct shuffled position below ``2 * (C + R)``; ~20% of the code slots are -1
    (empty, or whose token the residual holds) and so is one residual entry. Row 0's query sees every
    slot, row 1 is padding (-1), row 2 sees only the oldest quarter of the positions."""
    from evictlayers.kernels.quantization import PackedKV, quantize_groups

    g = torch.Generator().manual_seed(seed)
    batch, total = 3, n_codes + n_residual
    v_dim = v_dim or head_dim
    keys = torch.randn(batch, kv_heads, n_codes, head_dim, generator=g) * 2
    values = torch.randn(batch, kv_heads, n_codes, v_dim, generator=g)
    channel = torch.ldexp(torch.ones(batch, kv_heads, 1, head_dim), torch.randint(-1, 3, (batch, kv_heads, 1, head_dim),
                                                                                 generator=g))
    scale_dtype = torch.float16 if dtype == torch.float16 else torch.bfloat16
    packed = PackedKV(
        *quantize_groups(keys / channel, bits, group, -1, scale_dtype), channel,
        *quantize_groups(values, bits, group, -1, scale_dtype), bits, group,
    )
    residual_keys = torch.randn(batch, kv_heads, n_residual, head_dim, generator=g).to(dtype)
    residual_values = torch.randn(batch, kv_heads, n_residual, v_dim, generator=g).to(dtype)
    pos = torch.stack([torch.randperm(2 * total, generator=g)[:total] for _ in range(batch * kv_heads)])
    pos = pos.view(batch, kv_heads, total)
    key_pos, residual_pos = pos[..., :n_codes].clone(), pos[..., n_codes:].clone()
    key_pos[torch.rand(key_pos.shape, generator=g) < 0.2] = -1
    if n_residual:
        residual_pos[0, 0, n_residual // 2] = -1
    query = torch.randn(batch, kv_heads * groups, head_dim, generator=g).to(dtype)
    query_pos = torch.tensor([2 * total, -1, total // 2])
    return query, packed, residual_keys, residual_values, query_pos, key_pos, residual_pos


def dequantized(packed, dtype):
    """``(keys, values)`` of a ``PackedKV`` written out from the layout's definition (int4: channel ``2p`` in
    the low nibble of byte ``p``; ``code * scale + zero`` per group, keys times their channel scale), in
    float32 then cast to ``dtype``: the reference the quantised kernels' dequantisation is held to."""

    def codes_of(packed_codes):
        if packed.bits == 8:
            return packed_codes.float()
        low, high = (packed_codes & 15).float(), (packed_codes >> 4).float()
        return torch.stack([low, high], -1).flatten(-2)

    def values_of(packed_codes, scale, zero):
        per_group = packed.group
        return (codes_of(packed_codes) * scale.float().repeat_interleave(per_group, -1)
                + zero.float().repeat_interleave(per_group, -1))

    keys = values_of(packed.key_codes, packed.key_scale, packed.key_zero) * packed.key_channel_scale
    values = values_of(packed.value_codes, packed.value_scale, packed.value_zero)
    return keys.to(dtype), values.to(dtype)
