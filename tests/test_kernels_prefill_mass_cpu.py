"""The C++ prefill-with-mass kernel (``kernels/prefill/mass_cpu.py``) against its dense float64 reference on odd
shapes (several blocks and tiles, a query chunk after older slots, windows, value heads of another size,
blocks of a few rows), with NaN-poisoned outputs written through views; its input checks; threads; and
``cpu.py``'s routing: which calls it serves, and what runs when it cannot be built."""

import warnings

import pytest
import torch

from evictlayers.kernels import cpu_extension
from evictlayers.kernels.prefill import mass_cpu
from evictlayers.kernels.prefill.cpu import attention_with_mass_cpu
from kernel_inputs import compare_prefill, prefill_inputs
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


def test_the_extension_builds_here():
    """CI has a compiler and ninja: the kernel under test is the C++ one, not a fallback."""
    assert mass_cpu.extension() is not None


def kernel_inputs(shape, seed=0):
    rows_of, groups, q_len, n_slots, head_dim, v_dim = shape
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows_of, groups, q_len, head_dim, generator=g),
            torch.randn(rows_of, n_slots, head_dim, generator=g), torch.randn(rows_of, n_slots, v_dim, generator=g))


def run_kernel(query, key, value, *, window, rows, need_mass=True, mass_start=None, gain=None):
    """The kernel writing into views of NaN-filled buffers (every other element of out and lse, a slice of a
    wider mass buffer starting at ``mass_start``, zeros by default)."""
    rows_of, groups, q_len, _ = query.shape
    n_slots, v_dim = key.shape[1], value.shape[2]
    out = torch.full((rows_of, groups, q_len, 2 * v_dim), float("nan"))[..., :v_dim]
    lse = torch.full((rows_of, groups, q_len, 2), float("nan"))[..., 0]
    mass_buffer = torch.full((rows_of, groups, n_slots + 5), float("nan"))
    mass = mass_buffer[..., 2 : n_slots + 2]
    mass.copy_(torch.zeros(rows_of, groups, n_slots) if mass_start is None else mass_start)
    mass_cpu.prefill_mass(query, key, value, gain=gain, scaling=0.3, window=window, need_mass=need_mass, rows=rows,
                          out=out, lse=lse, mass=mass)
    assert mass_buffer[..., :2].isnan().all() and mass_buffer[..., n_slots + 2 :].isnan().all()
    return out, lse, mass


@pytest.mark.parametrize(
    "shape,window,rows",
    [
        ((2, 3, 37, 37, 16, 16), None, 128),  # one block, one tile
        ((1, 2, 700, 900, 24, 8), None, 128),  # a chunk after 200 older slots: several blocks and tiles
        ((2, 1, 300, 300, 64, 64), 50, 128),  # a window: each block's tiles start past the slots it hides
        ((1, 3, 300, 1100, 20, 36), 1000, 7),  # blocks of 7 rows; a window reaching back over older slots
        ((3, 4, 1, 513, 8, 12), None, 128),  # one query (a decode step through the prefill path), 2 tiles
        ((1, 2, 45, 45, 16, 16), 1, 16),  # a window of one: each row sees itself alone
    ],
    ids=["one-tile", "chunk-after-older", "window", "rows7-window-dv", "one-query", "window1"],
)
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_prefill_mass_matches_the_dense_reference(shape, window, rows, with_gain):
    """With a score gain (one factor >= 0 per query row, a few of them 0: uniform over the visible slots) the
    mass is that of ``softmax(gain * logits)``, while the output and LSE stay the model's."""
    query, key, value = kernel_inputs(shape)
    gain = None
    if with_gain:
        gain = torch.rand(shape[0], shape[2], generator=torch.Generator().manual_seed(7)) * 3
        gain[:, ::5] = 0.0
    out, lse, mass = run_kernel(query, key, value, window=window, rows=rows, gain=gain)
    want_out, want_lse, want_mass = mass_cpu.prefill_mass_reference(query, key, value, scaling=0.3, window=window,
                                                                    gain=gain)
    for name, got, want in (("out", out, want_out), ("lse", lse, want_lse), ("mass", mass, want_mass)):
        assert not got.isnan().any(), f"{name} has NaN (an element never written?)"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
    # each query row's probabilities sum to 1, so each head's mass sums to its number of rows
    torch.testing.assert_close(mass.sum(-1), torch.full(mass.shape[:2], float(shape[2])))


def test_the_mass_is_added_to_what_is_there_and_left_alone_without_need_mass():
    query, key, value = kernel_inputs((2, 3, 150, 170, 16, 16), seed=1)
    start = torch.rand(2, 3, 170, generator=torch.Generator().manual_seed(2))
    _, _, want_mass = mass_cpu.prefill_mass_reference(query, key, value, scaling=0.3, window=None)
    _, _, mass = run_kernel(query, key, value, window=None, rows=64, mass_start=start)
    torch.testing.assert_close(mass, start + want_mass, rtol=1e-4, atol=2e-5)
    out, lse, untouched = run_kernel(query, key, value, window=None, rows=64, need_mass=False, mass_start=start)
    assert torch.equal(untouched, start)
    want_out, want_lse, _ = mass_cpu.prefill_mass_reference(query, key, value, scaling=0.3, window=None)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=2e-5)


def test_blocks_split_over_threads_compute_what_one_thread_does():
    """Each block is computed alike on any thread (out and lse bit for bit); the mass of blocks on other threads
    is summed from per-thread buffers, so only its rounding may differ."""
    query, key, value = kernel_inputs((2, 3, 333, 333, 16, 24), seed=3)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(run_kernel(query, key, value, window=None, rows=32))
    torch.set_num_threads(1)
    (out1, lse1, mass1), (out2, lse2, mass2) = results
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    torch.testing.assert_close(mass1, mass2, rtol=1e-5, atol=1e-5)


def test_the_kernel_checks_its_inputs():
    module = mass_cpu.extension()
    query, key, value = kernel_inputs((2, 3, 10, 12, 16, 16))

    def call(q=query, k=key, v=value, gain=torch.empty(0), window=0, rows=8, out=None, lse=None, mass=None):
        out = torch.empty(2, 3, q.shape[2], v.shape[2]) if out is None else out
        lse = torch.empty(2, 3, q.shape[2]) if lse is None else lse
        mass = torch.zeros(2, 3, k.shape[1]) if mass is None else mass
        module.prefill_mass(q, k, v, gain, 0.3, window, True, rows, out, lse, mass)

    with pytest.raises(RuntimeError, match="key must be a CPU float32 tensor of shape"):
        call(k=key.double())
    with pytest.raises(RuntimeError, match="query must be a CPU float32 tensor .* contiguous last dim"):
        call(q=query.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(RuntimeError, match="the Q = 13 queries must be the last of the N = 12 slots"):
        call(q=torch.randn(2, 3, 13, 16))
    with pytest.raises(RuntimeError, match="value must be a CPU float32 tensor of shape"):
        call(v=value[:, :11])
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        call(window=-1)
    with pytest.raises(RuntimeError, match="block_rows must be >= 1"):
        call(rows=0)
    with pytest.raises(RuntimeError, match="mass .* must be a CPU float32 tensor of shape"):
        call(mass=torch.zeros(2, 3, 11))
    with pytest.raises(RuntimeError, match="gain .* must be a CPU float32 tensor of shape"):
        call(gain=torch.ones(2, 9))
    with pytest.raises(RuntimeError, match="gain must be >= 0"):
        call(gain=-torch.ones(2, 10))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The rows ``cpu.py`` hands the kernel, one entry ``(queries, slots)`` per call."""
    calls = []
    real = mass_cpu.prefill_mass

    def spy(query, key, *args, **kwargs):
        calls.append((query.shape[2], key.shape[1]))
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(mass_cpu, "prefill_mass", spy)
    return calls


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("window", [None, 9], ids=["causal", "window"])
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_cpu_prefill_sends_an_in_order_prompt_to_the_kernel(kernel_calls, reduce, window, with_gain):
    """A whole prompt with its mass read: every row but the kept ones through the kernel, the kept rows through
    the blocks, all matching the naive reference (output, LSE, mass, kept rows)."""
    inputs = prefill_inputs(41, 0, 150, groups=3, batch=1)
    gain = torch.rand(1, 150, generator=torch.Generator().manual_seed(8)) * 2 if with_gain else None
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, sliding_window=window, gqa_reduce=reduce,
                    keep_rows=6, score_gain=gain)
    assert kernel_calls == [(144, 144)]


def test_cpu_prefill_sends_a_chunk_after_in_order_slots_to_the_kernel(kernel_calls):
    """Queries that are the last of in-order slots (a chunked prefill of an uncompressed cache, batch rows at
    different starting positions): query ``i`` sees the slots up to its own."""
    query, key, value, _, _ = prefill_inputs(42, 30, 40, groups=2, batch=2)
    start = torch.tensor([0, 5])
    key_pos = (start[:, None] + torch.arange(70))[:, None].expand(2, 2, 70).contiguous()
    query_pos = start[:, None] + torch.arange(30, 70)
    compare_prefill(attention_with_mass_cpu, (query, key, value, query_pos, key_pos), scaling=0.3, keep_rows=3)
    assert kernel_calls == [(37, 67)]


@pytest.mark.parametrize(
    "case", ["padded", "unordered", "negative-gain", "softcap", "no-mass", "small-chunks"],
)
def test_cpu_prefill_keeps_other_calls_on_its_blocks(kernel_calls, case):
    batch = 2 if case == "padded" else 1
    query, key, value, query_pos, key_pos = prefill_inputs(43, 9 if case == "unordered" else 0, 60, batch=batch)
    options = {"keep_rows": 4}
    if case == "negative-gain":  # the kernel's running max assumes gain >= 0
        options["score_gain"] = torch.linspace(-1, 1, 60)[None]
    if case == "softcap":
        options["softcap"] = 3.0
    if case == "no-mass":
        options["need_mass"] = False
    if case == "small-chunks":  # not one row of 60 slots fits in 50 floats
        options["max_chunk_elements"] = 50
    compare_prefill(attention_with_mass_cpu, (query, key, value, query_pos, key_pos), scaling=0.3, **options)
    assert kernel_calls == []


def test_a_small_max_chunk_elements_gives_the_kernel_fewer_rows(monkeypatch):
    """The scratch bound: rows x slots x threads within ``max_chunk_elements``."""
    rows = []
    real = mass_cpu.prefill_mass
    monkeypatch.setattr(mass_cpu, "prefill_mass", lambda *a, **k: rows.append(k["rows"]) or real(*a, **k))
    inputs = prefill_inputs(44, 0, 90, batch=1)
    compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, max_chunk_elements=900)
    assert rows == [10]


def test_without_the_extension_the_blocks_serve_after_one_warning(monkeypatch, kernel_calls, tmp_path):
    """A machine that cannot compile it still prefills with mass (the blocks), told why and how to fix it."""
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing cached: the build is asked for
    loaded = {name: module for name, module in cpu_extension._BUILT.items() if name != "evictlayers_mass_cpu"}
    monkeypatch.setattr(cpu_extension, "_BUILT", loaded)  # this kernel not loaded yet, the others as they were
    inputs = prefill_inputs(45, 0, 50, batch=1)
    with pytest.warns(RuntimeWarning, match="could not compile its CPU prefill-with-mass kernel .*Ninja is requi"):
        compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, keep_rows=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the failed build is remembered
        compare_prefill(attention_with_mass_cpu, inputs, scaling=0.3, keep_rows=2)
    assert kernel_calls == []


@pytest.mark.parametrize("recipe,built", [("h2o", True), ("streaming_llm", False)])
def test_applying_a_policy_that_reads_mass_builds_the_kernel(monkeypatch, recipe, built):
    """The build (or the load of a cached build) happens at ``apply``, not inside the first prefill."""
    import evictlayers as el
    from tiny_models import build

    calls = []
    monkeypatch.setattr(mass_cpu, "extension", lambda: calls.append(1))
    with el.apply(build("llama"), el.load_recipe(recipe)):
        pass
    assert bool(calls) == built
