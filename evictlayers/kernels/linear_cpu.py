"""A decode step's weight products on CPU: ``evictlayers::few_rows_linear`` (C++, ``linear_cpu.cpp``) and the
linear layers' forward that sends a step's products to it.

- ``few_rows_linear(input [..., K], weight [N, K], bias [N] | None) -> [..., N]``, all float32 or all bfloat16:
  what ``torch.nn.functional.linear`` computes (its reference), for an input of a few rows, accumulated in float32
  (bfloat16: each product exact, the sum rounded once to bfloat16, as BLAS does).

Why. A decode step multiplies every weight of the model by one row per sequence: a matrix of a few rows, a
shape BLAS runs far below its rate. The kernel reads each weight row once per block of up to 8 input rows, in place:
nothing is packed, so a weight changed between steps is read as it is, unlike ``compile="max-autotune"``,
whose graph holds the weights it froze. bfloat16 runs AVX512-BF16's ``vdpbf16ps``, 32 channels a vector.
``python -m benchmarks --only cpu_linear`` times the op against BLAS on SmolLM2-135M's weights, read from
memory as a step reads them, at 1 to 64 rows, in float32 and bfloat16.

Only on request: ``evictlayers.apply(model, policy, compile=True, cpu_linear=True)`` on a CPU model gives each
``torch.nn.Linear`` (the class itself, not a subclass such as a quantised layer's) the forward ``few_rows_forward``
for as long as the patch is active: a call whose input has at most ``MAX_ROWS`` rows, tensors of one dtype the op
has loops for (``served_dtypes``: float32, and bfloat16 where the machine has AVX512-BF16) and no gradient to record
(``serves``) runs the op, and every other call (a prompt's prefill) ``F.linear`` as before. The compiled decode
forward traces the op into its graph. Without ``cpu_linear=True`` no linear layer is touched; the decode
benchmark's ``+cpu_linear`` rows time the op's share of a step.
The op is built by ``kernels/cpu_extension.py`` on first use, for the machine's instruction-set level; where
it cannot be built, or that level is below ``avx512`` (``available``), ``apply`` warns and replaces no forward.
"""

from __future__ import annotations

from pathlib import Path

import torch

from evictlayers.kernels.cpu_extension import build

SOURCE = Path(__file__).with_name("linear_cpu.cpp")

#: The most input rows the op serves. Past 8 it reads each weight once per block of 8 rows, so its lead over BLAS
#: shrinks as the rows grow; 32 is where the ``cpu_linear`` benchmark still finds it ahead.
MAX_ROWS = 32

_LIB = torch.library.Library("evictlayers", "FRAGMENT")
_LIB.define("few_rows_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor")
torch.library.register_fake(
    "evictlayers::few_rows_linear",
    lambda input, weight, bias: input.new_empty((*input.shape[:-1], weight.shape[0])),
    lib=_LIB,
)
few_rows_linear = torch.ops.evictlayers.few_rows_linear


def extension():
    """The compiled module (its import registers the op's CPU kernel), built on the first call; ``None`` (after
    one warning) when it cannot be built."""
    return build(SOURCE, "CPU kernel for the decode's weight products",
                 "the compiled decode forward's linear layers run BLAS instead (same results, slower)")


def unavailable_reason() -> str | None:
    """Why the op has no AVX-512 loops here, to follow "the op ...": the instruction-set level
    (``kernels/cpu_extension.py``) is below ``avx512``, where nothing is built (the op would compute
    ``at::linear``), or the build failed (on the first call); ``None`` where it has them."""
    from evictlayers.kernels.cpu_extension import at_least, describe_level

    if not at_least("avx512"):
        return f"has loops only at the avx512 instruction-set level and above; this run's: {describe_level()}"
    module = extension()
    if module is None or not module.vectorised():
        return "could not be built here (see the warning above)"
    return None


def available() -> bool:
    """Whether the op has its AVX-512 loops here (``unavailable_reason`` says why not)."""
    return unavailable_reason() is None


def served_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the op has vector loops for here: float32 where it is ``available``, bfloat16 too at the
    ``avx512_bf16`` level; none elsewhere."""
    if not available():
        return ()
    return (torch.float32, torch.bfloat16) if extension().bfloat16() else (torch.float32,)


def serves(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether ``F.linear(input, weight, bias)`` goes to the op: CPU tensors of one of ``dtypes`` (those of
    ``served_dtypes``), a 2-D weight, at most ``MAX_ROWS`` input rows, no gradient to record (the op has no
    backward; a model's parameters require one, so this means autograd is off, as it is while generating)."""
    tensors = (input, weight) if bias is None else (input, weight, bias)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return (
        not recording and input.dtype in dtypes
        and all(t.device.type == "cpu" and t.dtype == input.dtype for t in tensors)
        and weight.dim() == 2 and input.dim() >= 1 and input.shape[-1] == weight.shape[1]
        and input.numel() <= MAX_ROWS * weight.shape[1]
    )


def few_rows_forward(module: torch.nn.Linear):
    """A forward for ``module`` that computes ``few_rows_linear`` where ``serves`` accepts the call and
    ``F.linear`` otherwise: ``evictlayers.apply(compile=True, cpu_linear=True)`` sets it as the instance's
    ``forward``."""
    dtypes = served_dtypes()  # read here, once: the forward runs inside the compiled graph

    def forward(input: torch.Tensor) -> torch.Tensor:
        if serves(input, module.weight, module.bias, dtypes):
            return few_rows_linear(input, module.weight, module.bias)
        return torch.nn.functional.linear(input, module.weight, module.bias)

    return forward
