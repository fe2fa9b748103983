"""The C++ decode ops (``kernels/decode/slots_cpu.cpp``): the matmuls over dense slots against float64 matmuls,
the softmax with the mass against ``naive.py``'s ``softmax_mass`` in float64.

Odd shapes: slot counts around the kernels' tiles (8 slots for the logits, 16 with AVX-512; 64 for float32
values of head dim 64), GQA groups 1-9 (row blocks of 4 and 3 with remainders), head dims through the vector
paths (multiples of 8 with and without a 32-channel remainder; with AVX-512, 64 and 128 through the 16-wide
logits, multiples of 16 through the 16-wide values, 8, 24 and 40 through the 8-wide loops) and the scalar one
(not a multiple of 8); float32, bfloat16 and
float16 slots. Slots are views into NaN-filled buffers (a wider row stride, slots past the end), so a read
outside the view poisons the result; the probabilities are a strided view too. The softmax: slot counts around
its 8-wide vectors, empty slots, slots past the query, sliding windows, softcap, AhaKV's score gain (zero
included), each GQA reduction, a padding query and a head that sees nothing."""

import pytest
import torch

from evictlayers.kernels import cpu_extension
from evictlayers.kernels.decode import naive, slots_cpu
from evictlayers.kernels.decode.slots_cpu import slot_logits, slot_values
from tiny_models import single_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.skipif(not slots_cpu.available(), reason="the C++ slot kernel could not be built here")


def nan_framed(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` ``[B, H, C, D]`` as ``dtype``, a view into a buffer of NaNs 2 slots longer and 5 channels
    wider (row stride ``D + 5``, a contiguous last dimension)."""
    batch, heads, slots, dim = values.shape
    frame = torch.full((batch, heads, slots + 2, dim + 5), float("nan"), dtype=dtype)
    frame[:, :, 1 : slots + 1, :dim] = values.to(dtype)
    return frame[:, :, 1 : slots + 1, :dim]


SHAPES = [  # batch, kv heads, groups, head dim, slots
    (2, 3, 3, 64, 130),
    (1, 2, 1, 64, 7),
    (2, 1, 4, 256, 65),
    (1, 2, 5, 40, 64),
    (3, 1, 9, 24, 9),
    (1, 1, 7, 128, 1),
    (2, 2, 2, 12, 33),  # a head dim the vector loops do not take
    (1, 1, 3, 8, 200),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{b}-h{h}-g{g}-d{d}-c{c}" for b, h, g, d, c in SHAPES])
def test_both_ops_match_float64_matmuls(shape, dtype):
    batch, heads, groups, dim, slots = shape
    generator = torch.Generator().manual_seed(sum(shape))
    query = torch.randn(batch, heads, groups, dim, generator=generator)
    keys = nan_framed(torch.randn(batch, heads, slots, dim, generator=generator), dtype)
    values = nan_framed(torch.randn(batch, heads, slots, dim, generator=generator), dtype)
    probs_frame = torch.full((batch, heads, groups, slots + 3), float("nan"))
    probs_frame[..., 2 : slots + 2] = torch.softmax(torch.randn(batch, heads, groups, slots, generator=generator), -1)
    probs = probs_frame[..., 2 : slots + 2]

    logits = slot_logits(query, keys)
    out = slot_values(probs, values)

    want_logits = query.double() @ keys.double().transpose(-1, -2)
    want_out = probs.double() @ values.double()
    assert logits.dtype == out.dtype == torch.float32
    assert logits.shape == (batch, heads, groups, slots) and out.shape == (batch, heads, groups, dim)
    torch.testing.assert_close(logits.double(), want_logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)


def test_value_heads_of_another_size_and_two_threads():
    """``D_v != D``; every (batch, head) is one task, so two threads give the same bits as one."""
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, 2, 3, 77, generator=generator), -1)
    values = torch.randn(3, 2, 77, 48, generator=generator)
    query, keys = torch.randn(3, 2, 3, 16, generator=generator), torch.randn(3, 2, 77, 16, generator=generator)
    one = slot_values(probs, values), slot_logits(query, keys)
    torch.set_num_threads(2)
    try:
        two = slot_values(probs, values), slot_logits(query, keys)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    torch.testing.assert_close(one[0].double(), probs.double() @ values.double(), rtol=1e-5, atol=1e-6)


SOFTMAX_SHAPES = [  # batch, kv heads, groups, slots
    (2, 3, 3, 130),
    (1, 1, 1, 1),
    (3, 2, 5, 17),
    (1, 2, 9, 8),
    (2, 1, 4, 203),
]
SOFTMAX_OPTIONS = {  # softcap, sliding window, score gain (one per batch row, built from the batch size)
    "plain": (None, None, None),
    "softcap-window": (20.0, 9, None),
    "gain": (None, None, lambda batch: torch.linspace(0.0, 3.0, batch)),
    "all": (5.0, 30, lambda batch: torch.linspace(2.0, 0.5, batch)),
}


def softmax_inputs(batch, heads, groups, slots, generator):
    """Logits (a view into NaNs), slot positions with empty slots (-1) and slots past the query, and query
    positions with a padding row (-1) when the batch has more than one row; one head of the first row sees
    nothing (all its slots are empty or in the future)."""
    frame = torch.full((batch, heads, groups, slots + 4), float("nan"))
    frame[..., 2 : slots + 2] = 6 * torch.randn(batch, heads, groups, slots, generator=generator)
    key_pos = torch.randint(-1, 50, (batch, heads, slots), generator=generator)
    query_pos = torch.randint(20, 50, (batch,), generator=generator)
    key_pos[0, 0] = torch.where(key_pos[0, 0] >= 0, query_pos[0] + 1, -1)
    if batch > 1:
        query_pos[-1] = -1
    return frame[..., 2 : slots + 2], query_pos, key_pos


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("options", SOFTMAX_OPTIONS.values(), ids=SOFTMAX_OPTIONS.keys())
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=[f"b{b}-h{h}-g{g}-c{c}" for b, h, g, c in SOFTMAX_SHAPES])
def test_the_softmax_op_matches_the_float64_reference(shape, options, reduce):
    softcap, window, gain_of = options
    generator = torch.Generator().manual_seed(sum(shape))
    logits, query_pos, key_pos = softmax_inputs(*shape, generator)
    gain = None if gain_of is None else gain_of(shape[0])
    settings = dict(softcap=softcap, sliding_window=window, need_mass=True, gqa_reduce=reduce)

    probs, lse, mass = slots_cpu.softmax_mass(logits, 0.3, query_pos, key_pos, score_gain=gain, **settings)
    want = naive.softmax_mass(logits.double(), 0.3, query_pos, key_pos,
                              score_gain=None if gain is None else gain.double(), **settings)

    assert probs.shape == logits.shape and lse.shape == logits.shape[:3] and mass.shape == key_pos.shape
    assert (lse[0, 0] == float("-inf")).all() and (probs[0, 0] == 0).all() and (mass[0, 0] == 0).all()
    for got, expected in zip((probs, lse, mass), want):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=1e-6)


def test_the_softmax_op_without_the_mass_and_on_two_threads():
    """``need_mass=False`` gives the probabilities and LSE alike and the broadcast zero mass; every (batch,
    head) is one task, so two threads give the same bits as one."""
    logits, query_pos, key_pos = softmax_inputs(3, 2, 3, 77, torch.Generator().manual_seed(5))
    settings = dict(softcap=None, sliding_window=None, score_gain=None, gqa_reduce="sum")
    one = slots_cpu.softmax_mass(logits, 0.125, query_pos, key_pos, need_mass=True, **settings)
    bare = slots_cpu.softmax_mass(logits, 0.125, query_pos, key_pos, need_mass=False, **settings)
    assert torch.equal(bare[0], one[0]) and torch.equal(bare[1], one[1])
    assert bare[2].shape == key_pos.shape and bare[2].stride() == (0, 0, 0) and not bare[2].any()
    torch.set_num_threads(2)
    try:
        two = slots_cpu.softmax_mass(logits, 0.125, query_pos, key_pos, need_mass=True, **settings)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def _softmax_op(logits=None, query_pos=None, key_pos=None, softcap=0.0, reduce=0, gain=None):
    logits = torch.randn(2, 3, 4, 5) if logits is None else logits
    query_pos = torch.tensor([4, 4]) if query_pos is None else query_pos
    key_pos = torch.zeros(2, 3, 5, dtype=torch.long) if key_pos is None else key_pos
    return torch.ops.evictlayers.slot_softmax(logits, query_pos, key_pos, 1.0, softcap, -1, gain, reduce, True)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: slot_logits(torch.randn(1, 2, 3, 8).half(), torch.randn(1, 2, 5, 8)), "query must be .* float32"),
        (lambda: slot_logits(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 8, 5).transpose(-1, -2)),
         "keys must be .* contiguous last dimension"),
        (lambda: slot_logits(torch.randn(1, 2, 3, 8), torch.randn(1, 3, 5, 8)), "must share \\[B, H\\]"),
        (lambda: slot_logits(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 16)), "same head dim"),
        (lambda: slot_logits(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8).double()),
         "keys must be float32, bfloat16 or float16"),
        (lambda: slot_values(torch.randn(1, 2, 3, 6), torch.randn(1, 2, 5, 8)), "one column per slot"),
        (lambda: _softmax_op(logits=torch.randn(2, 3, 4, 5).double()), "logits must be \\[B, H, G, C\\] float32"),
        (lambda: _softmax_op(key_pos=torch.zeros(2, 3, 6, dtype=torch.long)), "key_pos must be \\[B, H, C\\] int64"),
        (lambda: _softmax_op(query_pos=torch.tensor([4.0, 4.0])), "query_pos must be \\[B\\] int64"),
        (lambda: _softmax_op(reduce=3), "reduce must be 0 \\(sum\\), 1 \\(mean\\) or 2 \\(max\\)"),
        (lambda: _softmax_op(softcap=-1.0), "softcap must be positive"),
        (lambda: _softmax_op(gain=torch.ones(3)), "gain must be \\[B\\]"),
    ],
    ids=["query-dtype", "strided-channels", "batch-heads", "head-dim", "slot-dtype", "probs-columns",
         "softmax-logits", "softmax-key-pos", "softmax-query-pos", "softmax-reduce", "softmax-softcap", "softmax-gain"],
)
def test_bad_inputs_are_refused_with_what_was_wrong(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_the_compiled_decode_step_calls_them_as_one_graph_for_every_slot_count():
    """Under ``torch.compile(fullgraph=True)`` the ops are opaque calls with ``register_fake``'s shapes: one
    shape-generic graph after the first, and the result of the eager ops."""
    from torch._dynamo.utils import counters

    def ops(query, keys, values, probs, key_pos):
        softmax = slots_cpu.softmax_mass(slot_logits(query, keys), 0.5, torch.tensor([60, 60]), key_pos, softcap=None,
                                         sliding_window=None, score_gain=None, need_mass=True, gqa_reduce="sum")
        return slot_logits(query, keys), slot_values(probs, values), *softmax

    compiled = torch.compile(ops, fullgraph=True, dynamic=None)
    torch._dynamo.reset()
    counters.clear()
    for slots in (17, 40, 101):
        query, keys, values = torch.randn(2, 2, 3, 32), torch.randn(2, 2, slots, 32), torch.randn(2, 2, slots, 32)
        probs = torch.softmax(torch.randn(2, 2, 3, slots), -1)
        key_pos = torch.randint(-1, 80, (2, 2, slots))
        got, want = compiled(query, keys, values, probs, key_pos), ops(query, keys, values, probs, key_pos)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_without_the_extension_nothing_is_sent_to_them(monkeypatch):
    """A machine that cannot build the kernel: ``serves`` is false and ``decode/cpu.py`` runs torch.matmul."""
    monkeypatch.setattr(cpu_extension, "_BUILT", {"evictlayers_slots_cpu": None})
    tensors = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert not slots_cpu.serves(*tensors)
    monkeypatch.setattr(cpu_extension, "_BUILT", {})
    assert slots_cpu.serves(*tensors)  # built (or loaded from torch's cache) again


def test_a_gradient_or_an_unsupported_cache_takes_the_matmuls():
    """The ops have no backward, and read float32/bfloat16/float16 CPU slots with contiguous channels."""
    query, keys, values = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert slots_cpu.serves(query, keys, values)
    assert not slots_cpu.serves(query.requires_grad_(), keys, values)
    assert not slots_cpu.serves(query.detach(), keys.double(), values)
    assert not slots_cpu.serves(query.detach(), keys.transpose(-1, -2), values)


@pytest.mark.parametrize("recipe", ["h2o", "streaming_llm"])
def test_applying_a_policy_on_cpu_builds_the_kernels(monkeypatch, recipe):
    """The build (or the load of a cached build) happens at ``apply``, not inside the first decode step: for a
    policy whose decode reads the mass (the matmuls) and for one that does not (the first free slot's search)."""
    import evictlayers as el
    from tiny_models import build

    calls = []
    monkeypatch.setattr(slots_cpu, "extension", lambda: calls.append(1))
    with el.apply(build("llama"), el.load_recipe(recipe)):
        pass
    assert calls == [1]
