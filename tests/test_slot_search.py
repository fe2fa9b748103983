"""The decode step's search for each head's first free slot: the C++ op (``kernels/decode/slots_cpu.cpp``)
against the PyTorch reference in ``kernels/slot_search.py``, on rows with free slots anywhere, none, or all of
them, strided, eager and inside a compiled graph."""

from __future__ import annotations

import pytest
import torch

from evictlayers.kernels.decode import slots_cpu
from evictlayers.kernels.slot_search import first_free_slot, first_free_slot_reference
from tiny_models import single_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.skipif(not slots_cpu.available(), reason="the C++ slot ops could not be built here")


def positions(seed: int, batch: int, heads: int, n: int) -> torch.Tensor:
    """``[B, H, N]`` shuffled positions with ~25% free (-1); head 2 of row 1 holds every slot, head 1 of row 2 none."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.stack([torch.randperm(4 * n, generator=g)[:n] for _ in range(batch * heads)]).view(batch, heads, n)
    pos[torch.rand(pos.shape, generator=g) < 0.25] = -1
    pos[1, 2] = torch.arange(n)
    pos[2, 1] = -1
    return pos


@pytest.mark.parametrize("n", [1, 7, 64, 1639])
def test_first_free_slot_matches_the_reference(n):
    pos = positions(n, 3, 4, n)
    strided = torch.cat([pos, pos], dim=-1)[..., ::2]
    for p in (pos, strided):
        got = first_free_slot(p)
        assert got.dtype == torch.int64 and got.shape == (3, 4)
        assert torch.equal(got, first_free_slot_reference(p))
    assert first_free_slot(pos)[1, 2] == 0 and first_free_slot(pos)[2, 1] == 0  # none free: 0; all free: 0


def test_first_free_slot_by_hand():
    pos = torch.tensor([[[3, 1, -1, -1], [-1, 0, 2, 5], [4, 6, 7, -1]]])
    assert first_free_slot(pos).tolist() == [[2, 0, 3]]


def test_op_refuses_bad_input():
    with pytest.raises(RuntimeError, match="pos \\[B, H, N\\] int64"):
        torch.ops.evictlayers.first_free_slot(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="pos \\[B, H, N\\] int64"):
        torch.ops.evictlayers.first_free_slot(torch.zeros(1, 2, 3, dtype=torch.int32))


def test_op_traces_into_a_compiled_graph():
    pos = positions(5, 3, 3, 40)
    compiled = torch.compile(first_free_slot, fullgraph=True)
    assert torch.equal(compiled(pos), first_free_slot_reference(pos))
