"""The coins of ClusterGen's reservoir sampling (Algorithm 1 lines 16 and 25), from a counter-based hash.

The coins are uniforms computed by hashing ``(seed, layer, KV head, index of the token in that head's
absorbed stream, coin index)``, not drawn from a ``torch.Generator``: a shared generator's draws depend
on the batch composition (a row would sample differently beside another row than alone),
``torch.compile(fullgraph=True)`` cannot trace an explicit generator, and a per-head counter lets a
one-head reference replay the same coins. The hash ignores the batch row, so rows with identical streams
sample identically; each row's estimator is unchanged in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2^32 / golden ratio: separates the seed from the layer before hashing


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x, c < 2**32`` without overflowing int64 (signed overflow is
    undefined behaviour in the CPU kernels): multiply the two 16-bit halves of ``x`` separately."""
    low = (x & 0xFFFF) * c
    high = (((x >> 16) * c) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer finaliser: a bijection on 32-bit words whose output bits
    each depend on every input bit (the reference implements the same on Python ints)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def layer_salt(seed: int, layer: int) -> int:
    """The 32-bit word every coin of one layer's sketch starts from."""
    x = torch.tensor(((seed ^ _GOLDEN32) & _MASK32), dtype=torch.int64)
    x = _hash32(_hash32(x) ^ (layer & _MASK32))
    return int(x)


def sketch_uniforms(salt: int | torch.Tensor, counter: torch.Tensor, coins: int) -> torch.Tensor:
    """``[B, H, coins]`` float64 uniforms in ``[0, 1)`` for the next absorbed token of every head.

    Args:
        salt: ``layer_salt(seed, layer)``, an int or a 0-d int64 tensor.
        counter: ``[B, H]`` int64, tokens each head has absorbed so far (the index of the next one);
            ``[B, H, W]`` gives the coins of ``W`` tokens per head, ``[B, H, W, coins]``.
        coins: draws per token (``t + s``).

    Coin ``j`` of the ``n``-th token of head ``h`` is ``hash(hash(hash(salt ^ h) ^ n) ^ j) / 2**32``;
    each stage is a bijection, so distinct ``(h, n, j)`` never share a word.
    """
    heads = torch.arange(counter.shape[1], device=counter.device, dtype=torch.int64)
    x = _hash32(heads ^ salt).view(1, -1, *([1] * (counter.dim() - 2)))  # [1, H, 1...]
    x = _hash32(x ^ (counter & _MASK32))  # [B, H, ...]
    j = torch.arange(coins, device=counter.device, dtype=torch.int64)
    x = _hash32(x[..., None] ^ j)  # [B, H, ..., coins]
    return x.double() / 2.0**32


@dataclass
class CoinTable:
    """The coins of the next ``W`` tokens each head will absorb, computed ahead (``ClusterSketch.coin_table``).

    ``absorb(..., coins=table)`` reads its coins here instead of hashing: the same numbers, but a compiled
    decode step then holds a gather instead of the 32-bit integer hash, whose vectorised int64 code made
    inductor's C++ compile ~3x slower, and eager decoding hashes once per ``W`` tokens, not per token.

    Attributes:
        uniforms: ``[B, H, W, t + s]`` float64, ``sketch_uniforms`` of counters ``base .. base + W - 1``.
        base: ``[B, H]`` int64, each head's ``SketchState.absorbed`` when the table was made.
    """

    uniforms: torch.Tensor
    base: torch.Tensor

    def draw(self, counter: torch.Tensor) -> torch.Tensor:
        """``[B, H, t + s]``: the coins of token ``counter`` ``[B, H]`` of every head; the caller keeps
        ``base <= counter < base + W`` (the slot store makes a new table before a step could overrun)."""
        width, coins = self.uniforms.shape[2:]
        index = (counter - self.base).clamp(0, width - 1)
        return self.uniforms.gather(2, index[..., None, None].expand(*index.shape, 1, coins)).squeeze(2)

    def nbytes(self) -> int:
        return self.uniforms.nbytes + self.base.nbytes
