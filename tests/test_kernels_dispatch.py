"""The kernel dispatcher: its switch, its refusals, the one-graph decode trace, and the shipped recipes
that skip the summed mass."""

import pytest
import torch

import evictlayers as el
from evictlayers.compose.positions import RotaryTable
from evictlayers.compose.recipes import shipped_recipes
from evictlayers.kernels import dispatch
from evictlayers.kernels.decode.naive import decode_attention_with_mass
from evictlayers.kernels.prefill.naive import attention_with_mass
from kernel_inputs import prefill_inputs, quantized_inputs
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


def assert_same(got, want, atol=1e-5):
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert not a.isnan().any(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def test_dispatcher_hands_lse_out_and_need_mass_to_the_chosen_kernel(kernels, monkeypatch):
    """Asking for the LSE or for no mass keeps the backend the environment picked (the Triton case is in
    test_kernels_triton.py): the mass comes back as zeros, the LSE buffer filled, the rest the reference's."""
    query, key, value, query_pos, key_pos = prefill_inputs(12, 5, 9)
    want_lse = torch.empty(query.shape[:3])
    want = attention_with_mass(query, key, value, query_pos, key_pos, scaling=0.3, keep_rows=2, lse_out=want_lse)
    for choice, backend in (("auto", "attention_with_mass_cpu"), ("reference", "attention_with_mass")):
        kernels(choice)
        called = spies(monkeypatch)
        lse = torch.full(query.shape[:3], float("nan"))
        got = dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.3, keep_rows=2,
                                         need_mass=False, lse_out=lse)
        assert called == [backend]
        assert_same(got._replace(mass=want.mass), want)
        assert (got.mass == 0).all(), choice
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5)


@pytest.fixture
def kernels(monkeypatch):
    """Set ``EVICTLAYERS_KERNELS`` for one test and make the dispatcher re-read it (restored afterwards)."""
    monkeypatch.setattr(dispatch, "_requested", dispatch._requested)

    def choose(value):
        monkeypatch.setenv(dispatch.ENV_VAR, value)
        dispatch.reload_kernel_choice()

    return choose


def spies(monkeypatch):
    """Replace the dispatcher's CPU kernels by recorders; returns the list of names called."""
    called = []

    def recorder(name, real):
        def record(*args, **kwargs):
            called.append(name)
            return real(*args, **kwargs)

        return record

    for name in ("attention_with_mass", "attention_with_mass_cpu", "decode_attention_with_mass",
                 "decode_attention_with_mass_cpu", "quantized_decode_attention_with_mass",
                 "quantized_decode_attention_with_mass_cpu"):
        monkeypatch.setattr(dispatch, name, recorder(name, getattr(dispatch, name)))
    return called


@pytest.mark.parametrize(
    "choice,prefill,decode",
    [("auto", "attention_with_mass_cpu", "decode_attention_with_mass_cpu"),
     ("reference", "attention_with_mass", "decode_attention_with_mass"),
     ("", "attention_with_mass_cpu", "decode_attention_with_mass_cpu")],
    ids=["auto", "reference", "empty-means-auto"],
)
def test_dispatcher_picks_by_environment(kernels, monkeypatch, choice, prefill, decode):
    kernels(choice)
    called = spies(monkeypatch)
    query, key, value, query_pos, key_pos = prefill_inputs(8, 5, 6)
    dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.3)
    dispatch.decode_attention(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.3)
    assert called == [prefill, decode]


@pytest.mark.parametrize(
    "choice,backend",
    [("auto", "quantized_decode_attention_with_mass_cpu"), ("reference", "quantized_decode_attention_with_mass")],
)
def test_quantized_decode_dispatch_hands_every_option_over(kernels, monkeypatch, choice, backend):
    """CPU tensors: the blockwise backend under auto, dequantise-then-attend under reference; the mass
    skipped on request; either way the reference's numbers."""
    kernels(choice)
    called = spies(monkeypatch)
    inputs = quantized_inputs(4, 45, 6)
    kwargs = dict(scaling=0.125, softcap=4.0, sliding_window=60, gqa_reduce="mean",
                  score_gain=torch.tensor([2.0, 1.0, 0.5]))
    got = dispatch.quantized_decode_attention(*inputs, **kwargs, need_mass=False)
    assert called == [backend]
    want = dispatch.quantized_decode_attention_with_mass(*inputs, **kwargs)
    assert (got.mass == 0).all()
    assert_same(got._replace(mass=want.mass), want)


@pytest.mark.parametrize("choice,backend", [("auto", "decode_attention_with_mass_cpu"),
                                            ("reference", "decode_attention_with_mass")])
def test_decode_dispatch_hands_need_mass_over(kernels, monkeypatch, choice, backend):
    kernels(choice)
    called = spies(monkeypatch)
    query, key, value, query_pos, key_pos = prefill_inputs(13, 7, 2)
    args = (query[:, :, -1], key, value, query_pos[:, -1], key_pos)
    got = dispatch.decode_attention(*args, scaling=0.3, sliding_window=5, need_mass=False)
    assert called == [backend]
    want = decode_attention_with_mass(*args, scaling=0.3, sliding_window=5)
    assert (got.mass == 0).all()
    assert_same(got._replace(mass=want.mass), want)


def test_dispatcher_rejects_unknown_choice(kernels):
    kernels("fast")
    query, key, value, query_pos, key_pos = prefill_inputs(9, 0, 4)
    with pytest.raises(ValueError, match="EVICTLAYERS_KERNELS='fast' is not one of .*'auto', 'triton', 'reference'"):
        dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.3)


def test_dispatcher_refuses_triton_on_cpu_without_the_interpreter(kernels, monkeypatch):
    kernels("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    query, key, value, query_pos, key_pos = prefill_inputs(10, 0, 4)
    with pytest.raises(RuntimeError, match="EVICTLAYERS_KERNELS=triton needs CUDA tensors, or TRITON_INTERPRET=1"):
        dispatch.decode_attention(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.3)


def test_dispatcher_refuses_triton_on_other_devices_even_under_the_interpreter(kernels, monkeypatch):
    kernels("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    query, key, value, query_pos, key_pos = (t.to("meta") for t in prefill_inputs(10, 0, 4))
    with pytest.raises(RuntimeError, match="got meta tensors: set EVICTLAYERS_KERNELS to auto or reference"):
        dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.3)


def test_decode_dispatcher_traces_into_one_graph(kernels):
    kernels("auto")
    query, key, value, query_pos, key_pos = prefill_inputs(11, 9, 3)
    args = (query[:, :, -1], key, value, query_pos[:, -1], key_pos)
    kwargs = dict(scaling=0.3, score_gain=torch.tensor([1.5, 0.5]), gqa_reduce="max", sliding_window=20)
    compiled = torch.compile(dispatch.decode_attention, fullgraph=True, backend="eager")
    assert_same(compiled(*args, **kwargs), decode_attention_with_mass(*args, **kwargs), atol=0.0)


def _rope_table() -> RotaryTable:
    def compute(rows, device, dtype):
        angles = torch.arange(rows, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)

    return RotaryTable(compute)


def _prefill_and_decode(policy, monkeypatch, force_mass: bool):
    """Prefill 300 random tokens (head dim 64, as the int4 recipes' groups need) into a store under
    ``policy`` then decode 4; with ``force_mass`` every prefill (and probe) computes the summed mass whatever the
    policy reads. A policy that scores by probes (``kvzip``) defers eviction over the prefill, probes it with 24
    more tokens (which are not stored), then evicts, as ``run.compress_context`` does."""
    import evictlayers.compose.prefill_step as prefill_module
    import evictlayers.compose.probe_step as probe_module

    real = prefill_module.prefill_attention
    if force_mass:
        forced = lambda *a, **k: real(*a, **{**k, "need_mass": True})  # noqa: E731
        monkeypatch.setattr(prefill_module, "prefill_attention", forced)
        monkeypatch.setattr(probe_module, "prefill_attention", forced)
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, h, 328, 64, generator=g) for h in (6, 2, 2))
    # a scorer that reads the queries' positions (ExpectedAttention) needs a rotary table: RoPE's, head dim 64
    store = el.SlotStore(policy, rotary=_rope_table() if policy.reads_queries else None)
    if policy.requires_probes:
        store.defer()
    outs = [store.step(q[:, :, :300], k[:, :, :300], v[:, :, :300], scaling=0.125)]
    if policy.requires_probes:
        store.probing = True
        outs.append(store.step(q[:, :, 304:], k[:, :, 304:], v[:, :, 304:], scaling=0.125))
        store.probing = False
        store.evict_deferred()
    for i in range(300, 304):
        outs.append(store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.125))
    monkeypatch.setattr(prefill_module, "prefill_attention", real)
    monkeypatch.setattr(probe_module, "prefill_attention", real)
    return store, outs


@pytest.mark.parametrize("recipe", shipped_recipes())
def test_skipping_the_mass_changes_no_shipped_recipe(recipe, monkeypatch):
    """A policy that declares it reads no summed mass (``reads_mass``) keeps and scores exactly what it
    does when the prefill computes the mass anyway, and outputs the same: exactly at every decode step,
    and to float rounding at the prefill, whose rows nobody scores then come from the fused flash op
    instead of the one-pass blocks (the kept rows get the same blocks either way)."""
    policy = el.load_recipe(recipe)
    skipped, skipped_outs = _prefill_and_decode(policy, monkeypatch, force_mass=False)
    forced, forced_outs = _prefill_and_decode(el.load_recipe(recipe), monkeypatch, force_mass=True)
    assert torch.equal(skipped.pos, forced.pos)
    for name in forced.state:
        torch.testing.assert_close(skipped.state[name], forced.state[name], rtol=0, atol=0, equal_nan=True)
    multi = 2 if policy.requires_probes else 1  # the prefill, and the probe where there is one
    for a, b in zip(skipped_outs[:multi], forced_outs[:multi]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(skipped_outs[multi:], forced_outs[multi:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_which_policies_read_the_mass():
    """Cumulative and averaged attention sum every row; AhaKV's prefill reads its last rows and a generated
    row is the one-token step's only row (Algorithm 1 lines 8 and 27)."""
    assert el.load_recipe("h2o").reads_mass and el.load_recipe("h2o_averaged").reads_mass
    assert not any(el.load_recipe(r).reads_mass for r in ("streaming_llm", "local", "full", "keydiff", "knorm",
                                                           "expected_attention", "kvzip",
                                                           "tova", "snapkv", "scissorhands", "tova_keydiff",
                                                           "tova_keydiff_chunked", "tova_keydiff_induction",
                                                           "ahakv", "ahakv_windowed"))


def test_what_a_decode_step_of_each_shipped_recipe_reads():
    """The mass (summed or as the step's row), the slots' keys, their values: a decode step computes the
    mass and dequantises a quantised cache only for recipes whose scorers read them (written out from the
    components: attention-fed scorers and windows of rows read the mass; KeyDiff, KeyNorm and k-center the
    keys; ValuePrior as a selector's prior the values, as ``ahakv``'s prefill prior only at prefill;
    ExpectedAttention both, scoring the arriving key and weighing it by its value's norm; ContextReconstruction
    nothing, a generated token scoring 1 on arrival)."""
    mass = {"ahakv", "ahakv_windowed", "h2o", "h2o_averaged", "h2o_int4", "h2o_windowed", "scissorhands",
            "scissorhands_int4", "snapkv", "tova", "tova_keydiff", "tova_keydiff_chunked", "tova_keydiff_induction"}
    keys = {"clustergen_kcenter", "expected_attention", "keydiff", "knorm", "tova_keydiff", "tova_keydiff_chunked",
            "tova_keydiff_induction"}
    values = {"ahakv_windowed", "expected_attention"}
    for recipe in shipped_recipes():
        policy = el.load_recipe(recipe)
        assert (policy.decode_needs_mass, policy.reads_keys, policy.reads_values) == (
            recipe in mass, recipe in keys, recipe in values), recipe
