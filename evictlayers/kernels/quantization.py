"""Group-wise asymmetric integer quantisation of K/V tensors, pure PyTorch reference.

KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache") stores each
group of ``group`` consecutive elements as ``b``-bit codes plus a scale and a zero point (the group's
minimum): keys grouped along tokens (per channel), values along channels (per token). H2O (Table 6)
and Scissorhands (Table 4) show such 4-bit storage composes with eviction. These functions do the
arithmetic for any grouping axis; ``modules/quantized_kv.py`` decides the layout.

Every shape here is fixed by the input's shape: no ``nonzero``, no ``.item()``, nothing that syncs
with the host, so the ops trace into a ``torch.compile(fullgraph=True)`` decode step.

Error bound. With ``lo``/``hi`` a group's minimum and maximum, the stored zero point is ``lo``
rounded down and the stored scale ``(hi - zero) / (2**bits - 1)`` rounded up to ``scale_dtype``, so
the grid ``zero + scale * [0, 2**bits - 1]`` covers the group and every element satisfies

    |x - dequantize(quantize(x))| <= scale / 2                     (up to float32 rounding)

where ``scale`` is the stored scale: exactly ``(hi - lo) / (2**bits - 1)`` when ``scale_dtype`` is
float32, at most one 16-bit rounding step wider when scales are stored in 16 bits (as KIVI does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BITS = (4, 8)


class PackedKV(NamedTuple):
    """The keys and values of ``C`` slots per ``(b, h)`` held as group-wise codes (``QuantizedKV``'s
    layout, which the quantised decode kernels read without a dense copy).

    Attributes (``P`` = ``D / 2`` for int4, two codes per byte, low nibble first; ``D`` for int8):
        key_codes: ``[B, H, C, P]`` uint8; key_scale, key_zero: ``[B, H, C, D / group]`` (16-bit);
        key_channel_scale: ``[B, H, 1, D]`` float32: a key is ``(code * scale + zero) * key_channel_scale``;
        value_codes: ``[B, H, C, P_v]`` uint8; value_scale, value_zero: ``[B, H, C, D_v / group]``:
            a value is ``code * scale + zero``;
        bits: 4 or 8; group: channels per scale and zero point.
    """

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    key_channel_scale: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    bits: int
    group: int

    def keys(self, dtype: torch.dtype, slots: slice = slice(None)) -> torch.Tensor:
        """``[B, H, n, D]`` the keys of ``slots`` dequantised (in float32, then cast to ``dtype``)."""
        codes, scale, zero = (t[:, :, slots] for t in (self.key_codes, self.key_scale, self.key_zero))
        return (dequantize_groups(codes, scale, zero, self.bits, self.group) * self.key_channel_scale).to(dtype)

    def values(self, dtype: torch.dtype, slots: slice = slice(None)) -> torch.Tensor:
        """``[B, H, n, D_v]`` the values of ``slots`` dequantised (in float32, then cast to ``dtype``)."""
        codes, scale, zero = (t[:, :, slots] for t in (self.value_codes, self.value_scale, self.value_zero))
        return dequantize_groups(codes, scale, zero, self.bits, self.group, dtype=dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` uint8 codes in ``[0, 15]`` -> ``[..., n]`` uint8, element ``2i`` in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[..., n]`` uint8 -> ``[..., 2n]`` uint8 codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def quantize_groups(
    x: torch.Tensor, bits: int, group: int, dim: int = -1, scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``x`` in groups of ``group`` consecutive elements along ``dim`` (min/max, asymmetric).

    Args:
        x: any float tensor; ``x.shape[dim]`` must be a multiple of ``group``, and for ``bits=4`` the
            last dim must be even (codes are packed two per byte along the last dim).
        bits: 4 or 8. scale_dtype: dtype of the stored scale and zero point (default ``x.dtype``).

    Returns:
        ``codes``: uint8, ``x.shape`` with the last dim halved for ``bits=4``;
        ``scale``, ``zero``: ``x.shape`` with ``dim`` reduced to ``x.shape[dim] // group``;
        ``x ~= code * scale + zero`` per group, within ``scale / 2`` (module docstring).
    """
    dim = dim % x.dim()
    levels = 2**bits - 1
    scale_dtype = scale_dtype or x.dtype
    grouped = x.float().unflatten(dim, (x.shape[dim] // group, group))  # group members on dim + 1
    lo = grouped.amin(dim + 1, keepdim=True)
    hi = grouped.amax(dim + 1, keepdim=True)
    zero = _rounded(lo, scale_dtype, toward=-torch.inf)
    scale = _rounded((hi - zero.float()) / levels, scale_dtype, toward=torch.inf)
    # a constant group has scale 0: every element equals the zero point, code 0
    step = torch.where(scale > 0, scale.float(), 1.0)
    codes = ((grouped - zero.float()) / step).round().clamp(0, levels).to(torch.uint8).flatten(dim, dim + 1)
    if bits == 4:
        codes = pack_int4(codes)
    return codes, scale.squeeze(dim + 1), zero.squeeze(dim + 1)


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group: int,
    dim: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: ``code * scale + zero`` computed in float32, returned as ``dtype``.

    Shapes as :func:`quantize_groups` returns them; the result has the original ``x.shape``.
    """
    if bits == 4:
        codes = unpack_int4(codes)
    dim = dim % codes.dim()
    grouped = codes.float().unflatten(dim, (codes.shape[dim] // group, group))
    out = grouped * scale.float().unsqueeze(dim + 1) + zero.float().unsqueeze(dim + 1)
    return out.flatten(dim, dim + 1).to(dtype)


def _rounded(x: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    """``x`` (float32) cast to ``dtype``, rounded toward ``toward`` instead of to nearest, so the stored
    grid still covers the group (the error bound holds with the stored scale).

    The step to the neighbouring ``dtype`` value is computed in float32 (one unit in the last place of
    ``near``, ``eps * 2**floor(log2 |near|)``; below a power of two that skips one value, which is still
    representable and still on the right side) rather than with ``nextafter`` on ``dtype``: compiled
    code evaluates ``dtype`` ops in float32, where ``nextafter`` moves by a float32 ulp and the result
    rounds straight back to ``near``."""
    near = x.to(dtype).float()
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(near.abs().clamp(min=torch.finfo(dtype).tiny))))
    past = (near < x) if toward > 0 else (near > x)
    return torch.where(past, near + ulp if toward > 0 else near - ulp, near).to(dtype)
