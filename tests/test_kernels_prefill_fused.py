"""The fused prefill backend (``prefill/fused.py``) against the naive reference, and its place in the dispatcher.

Without CUDA the backend runs on the CPU: output and LSE from the CPU flash op, the mass pass on the Triton
interpreter (``TRITON_INTERPRET=1``, set here before triton is imported, as ``test_kernels_triton.py`` does).
On a machine with CUDA the same cases run on the GPU in float32 (the memory-efficient op), and ``TestCuda``
runs them again in bfloat16 and float16 (cuDNN for whole prompts, FlashAttention-2 for chunks and windows),
plus a long prompt. Each case says whether the fused ops serve it (a causal prompt in slot order, no
soft-cap, head dims the flash kernel takes) or the Triton kernel does, and the test checks which ran. ``compare_prefill`` fills ``lse_out`` and every buffer
``torch.empty`` hands out with NaN, so an element nobody writes fails.
"""

import os
import sys
from typing import NamedTuple

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
_loaded = sys.modules.get("evictlayers.kernels.prefill.triton")
if not CUDA and _loaded is not None and type(_loaded._mass_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
DEVICE = torch.device("cuda" if CUDA else "cpu")

from evictlayers.kernels import dispatch  # noqa: E402
from evictlayers.kernels.common import in_order  # noqa: E402
from evictlayers.kernels.prefill import fused  # noqa: E402
from evictlayers.kernels.prefill.fused import attention_with_mass_fused  # noqa: E402
from evictlayers.kernels.prefill.naive import attention_with_mass  # noqa: E402
from kernel_inputs import compare_prefill, on_device, prefill_inputs  # noqa: E402
from tiny_models import single_thread  # noqa: E402,F401 (autouse fixture)

pytestmark = [
    pytest.mark.triton,
    pytest.mark.usefixtures("exact_float32", "fused_at_any_size"),
    # the interpreter evaluates both sides of tl.where with numpy: -inf - -inf in the unused side warns
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]


@pytest.fixture
def fused_at_any_size(monkeypatch):
    """The fused ops serve from the first slot on (``MIN_SLOTS``), so that small cases reach them."""
    monkeypatch.setattr(fused, "MIN_SLOTS", 0)


class Case(NamedTuple):
    ordered: bool  # slots in position order (a causal prompt, or a chunk after in-order slots), else shuffled
    held: int  # slots before the step's queries
    new: int  # the step's queries
    groups: int
    dims: tuple[int, int] = (64, 64)  # (head dim, value head dim)
    reduce: str = "sum"
    gain: bool = False
    softcap: float | None = None
    window: int | None = None
    keep_rows: int = 0
    need_mass: bool = True

    def fused_serves(self, dtype):
        """Whether the fused ops serve the case (``prefill/fused.py``'s rules)."""
        head_dim, v_dim = self.dims
        float32_window = DEVICE.type == "cuda" and dtype == torch.float32 and self.window is not None
        return (self.ordered and self.softcap is None and head_dim == v_dim and head_dim % 8 == 0
                and not float32_window)


CASES = [
    Case(True, 0, 1, 3, keep_rows=1),  # a one-token prompt
    Case(True, 0, 7, 1, reduce="max", gain=True, keep_rows=3),
    Case(True, 0, 33, 3, reduce="mean", gain=True),
    Case(True, 0, 130, 3, keep_rows=5),
    Case(True, 23, 18, 3, reduce="max", gain=True, keep_rows=18),  # a chunk after in-order slots
    Case(True, 40, 33, 1, dims=(128, 128), gain=True, window=9, keep_rows=4),
    Case(True, 0, 37, 3, reduce="mean", window=12, keep_rows=2, need_mass=False),
    Case(True, 17, 7, 3, gain=True, keep_rows=2, need_mass=False),
    Case(True, 0, 19, 3, dims=(32, 32), need_mass=False),  # the LSE only: no mass pass
    # the Triton kernel's: padding, held slots shuffled with holes (LSE rows of -inf), soft-cap, head dims
    Case(False, 30, 19, 3, gain=True, keep_rows=4),
    Case(False, 21, 16, 1, reduce="max", window=9, need_mass=False, keep_rows=3),
    Case(True, 0, 33, 3, reduce="max", softcap=5.0, keep_rows=2),
    Case(True, 0, 21, 3, dims=(20, 20), gain=True),
    Case(True, 10, 21, 3, dims=(64, 48), reduce="mean"),
]


def case_id(case):
    """``ordered-h23-q18-g3-d64-max-gain-rows18`` and the like."""
    head_dim, v_dim = case.dims
    flags = [f for f, on in (("gain", case.gain), ("softcap", case.softcap), ("no-mass", not case.need_mass)) if on]
    flags += [f"window{case.window}"] * bool(case.window) + [f"rows{case.keep_rows}"] * bool(case.keep_rows)
    dims = f"d{head_dim}" + (f"x{v_dim}" if v_dim != head_dim else "")
    layout = "ordered" if case.ordered else "shuffled"
    return "-".join([layout, f"h{case.held}", f"q{case.new}", f"g{case.groups}", dims, case.reduce, *flags])


def case_inputs(case, dtype):
    """``(query, key, value, query_pos, key_pos)``; in order each row's slots start at its own position (0, 5)."""
    head_dim, v_dim = case.dims
    inputs = prefill_inputs(case.held + case.new + case.groups, case.held, case.new, groups=case.groups,
                            head_dim=head_dim, v_dim=v_dim, dtype=dtype)
    if not case.ordered:
        return inputs
    query, key, value, _, _ = inputs
    key_pos = (torch.tensor([0, 5])[:, None] + torch.arange(case.held + case.new)).repeat_interleave(2, 0)
    key_pos = key_pos.view(2, 2, -1)
    query_pos = key_pos[:, 0, case.held :].contiguous()
    assert in_order(query_pos, key_pos)
    return query, key, value, query_pos, key_pos


def fallbacks(monkeypatch):
    """Record the calls the fused backend hands to the Triton kernel; returns the list they go to."""
    calls = []
    real = fused.attention_with_mass_triton

    def recorded(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "attention_with_mass_triton", recorded)
    return calls


TOLERANCES = {  # out and lse, mass and rows, rtol
    torch.float32: (1e-5, 1e-4, 1e-3),
    # the reference takes the same values in float32; the gained queries are rounded to the dtype
    torch.float16: (2e-3, 2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1e-2, 1e-2),
}


def check_case(case, dtype, monkeypatch):
    calls = fallbacks(monkeypatch)
    inputs = case_inputs(case, dtype)
    gain = torch.rand(2, case.new, generator=torch.Generator().manual_seed(case.new)) * 2 if case.gain else None
    out_atol, mass_atol, rtol = TOLERANCES[dtype]
    got = compare_prefill(
        attention_with_mass_fused, inputs, out_atol=out_atol, mass_atol=mass_atol, rtol=rtol, device=DEVICE,
        reference_dtype=None if dtype == torch.float32 else torch.float32, scaling=case.dims[0] ** -0.5,
        softcap=case.softcap, sliding_window=case.window, gqa_reduce=case.reduce, score_gain=gain,
        keep_rows=case.keep_rows, need_mass=case.need_mass,
    )
    assert (len(calls) == 0) == case.fused_serves(dtype), calls
    assert got.rows.shape == (2, 2, min(case.keep_rows, case.new), case.held + case.new)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_matches_reference(case, monkeypatch):
    check_case(case, torch.float32, monkeypatch)


@pytest.mark.skipif(CUDA, reason="TestCuda runs bfloat16 on the GPU")
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5]], ids=case_id)
def test_fused_bfloat16_on_cpu(case, monkeypatch):
    """bfloat16 through the CPU flash op (the mass pass upcasts on the interpreter, whose bfloat16 ``tl.dot``
    is wrong), loosely."""
    check_case(case, torch.bfloat16, monkeypatch)


@pytest.mark.parametrize("held", [0, 5], ids=["whole-prompt", "chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lse_out_strided_and_queries_transposed(held, dtype, monkeypatch):
    """A strided ``lse_out`` (every other element of a NaN buffer) gets exactly its elements written, and
    queries laid out ``[B, Q, H, D]`` (as a model's projection gives them) are read by their strides."""
    calls = fallbacks(monkeypatch)
    case = Case(True, held, 20, 3, gain=True, keep_rows=2)
    query, key, value, query_pos, key_pos = case_inputs(case, dtype)
    query = query.transpose(1, 2).contiguous().transpose(1, 2)
    kwargs = dict(scaling=0.125, score_gain=torch.rand(2, 20, generator=torch.Generator().manual_seed(3)), keep_rows=2)
    buffer = torch.full((2, 6, 40), float("nan"), device=DEVICE)
    got = attention_with_mass_fused(*on_device((query, key, value, query_pos, key_pos), DEVICE),
                                    **on_device(kwargs, DEVICE), lse_out=buffer[:, :, ::2])
    want_lse = torch.empty(2, 6, 20)
    want = attention_with_mass(query.float(), key.float(), value.float(), query_pos, key_pos, **kwargs,
                               lse_out=want_lse)
    assert not calls
    buffer = buffer.cpu()
    assert buffer[:, :, 1::2].isnan().all()
    out_atol, mass_atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(buffer[:, :, ::2], want_lse, rtol=rtol, atol=out_atol)
    for name, a, b in zip(want._fields, got, want):
        torch.testing.assert_close(a.cpu().float(), b, rtol=rtol, atol=out_atol if name == "out" else mass_atol,
                                   msg=lambda m: f"{name}: {m}")


def test_short_prompts_go_to_triton_without_the_order_test(monkeypatch):
    """Below ``MIN_SLOTS`` slots the Triton kernel serves in-order inputs too, and no order test (a host sync)
    is made."""
    monkeypatch.setattr(fused, "MIN_SLOTS", 50)
    calls = fallbacks(monkeypatch)
    tested = []
    monkeypatch.setattr(fused, "in_order", lambda *args: tested.append(1) or in_order(*args))
    for new, fallback, order_tests in ((49, 1, 0), (50, 1, 1)):
        query, key, value, query_pos, key_pos = on_device(case_inputs(Case(True, 0, new, 1), torch.float32), DEVICE)
        attention_with_mass_fused(query, key, value, query_pos, key_pos, scaling=0.125)
        assert (len(calls), len(tested)) == (fallback, order_tests)


def test_dispatch_runs_fused_under_auto_and_triton_when_asked(monkeypatch):
    """On CUDA tensors (here pretended, on CPU ones) ``auto`` runs the fused prefill and the Triton decode;
    ``EVICTLAYERS_KERNELS=triton`` runs the Triton prefill kernel."""
    monkeypatch.setattr(dispatch, "_requested", dispatch._requested)  # restored after the test
    if not CUDA:
        monkeypatch.setattr(dispatch, "_use_triton", lambda tensor: True)
    ran = []
    for name in ("attention_with_mass_fused", "attention_with_mass_triton"):
        module = fused if name.endswith("fused") else sys.modules["evictlayers.kernels.prefill.triton"]
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _name=name, _real=real, **kw: ran.append(_name) or _real(*a, **kw))
    inputs = case_inputs(Case(True, 0, 9, 3, keep_rows=1), torch.float32)
    query, *_ = device_inputs = on_device(inputs, DEVICE)
    want = attention_with_mass(*inputs, scaling=0.125, keep_rows=1)
    for choice, prefill, called in (("auto", "fused", ["attention_with_mass_fused"]),
                                    ("triton", "triton", ["attention_with_mass_triton"])):
        monkeypatch.setenv(dispatch.ENV_VAR, choice)
        dispatch.reload_kernel_choice()
        assert (dispatch.prefill_backend(query), dispatch.decode_backend(query)) == (prefill, "triton")
        ran.clear()
        got = dispatch.prefill_attention(*device_inputs, scaling=0.125, keep_rows=1)
        assert ran == called
        for name, a, b in zip(want._fields, got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
class TestCuda:
    """The cases in half precision on the GPU, where cuDNN or FlashAttention-2 serves the ordered ones, and a
    long prompt (many blocks of both kernels) in bfloat16 and float32."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_half_matches_reference(self, case, dtype, monkeypatch):
        check_case(case, dtype, monkeypatch)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
    @pytest.mark.parametrize("case", [Case(True, 0, 1000, 3, gain=True, keep_rows=8),
                                      Case(True, 300, 700, 3, reduce="max", window=256, keep_rows=3)], ids=case_id)
    def test_long_prompt(self, case, dtype, monkeypatch):
        check_case(case, dtype, monkeypatch)
