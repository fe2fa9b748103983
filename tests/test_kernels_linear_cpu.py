"""The decode's weight products on CPU (``kernels/linear_cpu.cpp``): ``few_rows_linear`` against float64
``F.linear`` (in float32, and in bfloat16 at the avx512_bf16 instruction-set level), and ``few_rows_forward``, the
linear layers' forward that sends few-row calls to it. Below the avx512 level the op has no loops: skipped.

Odd shapes: 1-9 input rows (every row block the kernel has, then a second block of 8), weight rows around its
tiles (16 / rows weight rows a tile, two at 8 rows, the remainder one at a time), widths around its 16-float
vectors (1, 15, 17, 100, 576), with and without a bias. Inputs and weights are views into NaN-filled buffers (a
wider row stride), so a read outside the view poisons the result. Threads: the tile range is split across 2."""

import pytest
import torch
import torch.nn.functional as F

from evictlayers.kernels import linear_cpu
from evictlayers.kernels.cpu_extension import at_least, describe_level
from evictlayers.kernels.linear_cpu import few_rows_forward, few_rows_linear
from tiny_models import single_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.skipif(
    not at_least("avx512"), reason=f"the op has loops from the avx512 instruction-set level up; here {describe_level()}"
)
BFLOAT16 = at_least("avx512_bf16")


def test_the_op_is_built_with_the_loops_of_the_level():
    """CI has a compiler and ninja: from avx512 up the op runs its own float32 loops, from avx512_bf16 up its
    bfloat16 ones too."""
    assert linear_cpu.available()
    assert linear_cpu.served_dtypes() == ((torch.float32, torch.bfloat16) if BFLOAT16 else (torch.float32,))


def nan_framed(values: torch.Tensor) -> torch.Tensor:
    """``values`` ``[..., K]`` as a view into a NaN-filled buffer 3 columns wider."""
    frame = torch.full((*values.shape[:-1], values.shape[-1] + 3), float("nan"))
    frame[..., 1 : values.shape[-1] + 1] = values
    return frame[..., 1 : values.shape[-1] + 1]


SHAPES = [  # input rows, weight rows, width
    (1, 37, 576), (2, 9, 100), (3, 11, 17), (4, 6, 15), (5, 7, 1), (6, 5, 64), (7, 3, 33), (8, 49, 576),
    (8, 1, 16), (9, 20, 40),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"m{m}-n{n}-k{k}" for m, n, k in SHAPES])
def test_the_op_matches_a_float64_linear(shape, with_bias, threads):
    rows, outputs, width = shape
    generator = torch.Generator().manual_seed(sum(shape))
    x = nan_framed(torch.randn(rows, 1, width, generator=generator))
    weight = nan_framed(torch.randn(outputs, width, generator=generator))
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    torch.set_num_threads(threads)
    try:
        out = few_rows_linear(x, weight, bias)
    finally:
        torch.set_num_threads(1)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (rows, 1, outputs) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not BFLOAT16, reason=f"bfloat16 loops need the avx512_bf16 level; here {describe_level()}")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", SHAPES + [(8, 5, 31), (2, 3, 32), (1, 2, 65)],
                         ids=[f"m{m}-n{n}-k{k}" for m, n, k in SHAPES + [(8, 5, 31), (2, 3, 32), (1, 2, 65)]])
def test_the_bfloat16_op_matches_a_float64_linear(shape, with_bias):
    """bfloat16 in, bfloat16 out: the float64 product of the same bfloat16 values, rounded once (widths around
    the 32-channel vectors too)."""
    rows, outputs, width = shape
    generator = torch.Generator().manual_seed(sum(shape))
    x = nan_framed(torch.randn(rows, 1, width, generator=generator)).bfloat16()
    weight = nan_framed(torch.randn(outputs, width, generator=generator)).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16() if with_bias else None
    out = few_rows_linear(x, weight, bias)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (rows, 1, outputs) and out.dtype == torch.bfloat16
    # one rounding to bfloat16 (8 bits): within one unit in the last place of the exact product
    torch.testing.assert_close(out.double(), reference, rtol=2**-8, atol=1e-3)


def test_the_op_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="expected float32 or bfloat16 input and weight of the same dtype"):
        few_rows_linear(torch.randn(2, 8, dtype=torch.float16), torch.randn(3, 8, dtype=torch.float16), None)
    with pytest.raises(RuntimeError, match="expected float32 or bfloat16 input and weight of the same dtype"):
        few_rows_linear(torch.randn(2, 8), torch.randn(3, 8, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match=r"input \[\.\.\., 8\] does not match weight \[3, 9\]"):
        few_rows_linear(torch.randn(2, 8), torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="a Float bias of 3 elements"):
        few_rows_linear(torch.randn(2, 8), torch.randn(3, 8), torch.randn(4))


def graph_targets(function, *args) -> list:
    """The call targets of the graph dynamo traces for ``function(*args)`` (the FX graph before inductor)."""
    seen = []

    def backend(graph, example_inputs):
        seen.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    torch.compile(function, backend=backend, fullgraph=True)(*args)
    return seen


def test_the_forward_runs_the_op_for_few_rows_and_blas_otherwise():
    layer = torch.nn.Linear(24, 10)
    forward = few_rows_forward(layer)
    few, many = torch.randn(32, 1, 24), torch.randn(33, 24)
    with torch.no_grad():
        assert few_rows_linear in graph_targets(forward, few)
        assert few_rows_linear not in graph_targets(forward, many)  # past MAX_ROWS: BLAS's product
        torch.testing.assert_close(forward(few), F.linear(few, layer.weight, layer.bias))
        torch.testing.assert_close(forward(many), F.linear(many, layer.weight, layer.bias))
        # bfloat16 layers go to the op where it has bfloat16 loops; float16 ones never do
        half = torch.nn.Linear(24, 10).to(torch.bfloat16)
        assert (few_rows_linear in graph_targets(few_rows_forward(half), few.to(torch.bfloat16))) == BFLOAT16
        torch.testing.assert_close(few_rows_forward(half)(few.to(torch.bfloat16)),
                                   F.linear(few.to(torch.bfloat16), half.weight, half.bias), rtol=2**-7, atol=1e-2)
        float16 = torch.nn.Linear(24, 10).to(torch.float16)
        assert few_rows_linear not in graph_targets(few_rows_forward(float16), few.to(torch.float16))


def test_the_forward_leaves_gradients_to_blas():
    layer, x = torch.nn.Linear(24, 10), torch.randn(2, 24)
    assert few_rows_linear not in graph_targets(few_rows_forward(layer), x)
    few_rows_forward(layer)(x).sum().backward()  # F.linear, which has a backward
    assert layer.weight.grad is not None
