"""The kernel dispatcher: its switch, its refusals, the one-graph decode trace, and the shipped recipes
that skip the summed mass."""

import pytest
import torch

import evictlayers as el
from evictlayers.compose.recipes import shipped_recipes
from evictlayers.kernels import dispatch
from evictlayers.kernels.decode.naive import decode_attention_with_mass
from evictlayers.kernels.prefill.naive import attention_with_mass
from kernel_inputs import prefill_inputs
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

    for name in ("attention_with_mass", "attention_with_mass_cpu", "decode_attention_with_mass"):
        monkeypatch.setattr(dispatch, name, recorder(name, getattr(dispatch, name)))
    return called


@pytest.mark.parametrize(
    "choice,prefill,decode",
    [("auto", "attention_with_mass_cpu", "decode_attention_with_mass"),
     ("reference", "attention_with_mass", "decode_attention_with_mass"),
     ("", "attention_with_mass_cpu", "decode_attention_with_mass")],
    ids=["auto", "reference", "empty-means-auto"],
)
def test_dispatcher_picks_by_environment(kernels, monkeypatch, choice, prefill, decode):
    kernels(choice)
    called = spies(monkeypatch)
    query, key, value, query_pos, key_pos = prefill_inputs(8, 5, 6)
    dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.3)
    dispatch.decode_attention(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.3)
    assert called == [prefill, decode]


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


def _prefill_and_decode(policy, monkeypatch, force_mass: bool):
    """Prefill 300 random tokens (head dim 64, as the int4 recipes' groups need) into a store under
    ``policy`` then decode 4; with ``force_mass`` every prefill computes the summed mass whatever the
    policy reads."""
    import evictlayers.compose.store as store_module

    real = store_module.prefill_attention
    if force_mass:
        monkeypatch.setattr(store_module, "prefill_attention", lambda *a, **k: real(*a, **{**k, "need_mass": True}))
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, h, 304, 64, generator=g) for h in (6, 2, 2))
    store = el.SlotStore(policy)
    outs = [store.step(q[:, :, :300], k[:, :, :300], v[:, :, :300], scaling=0.125)]
    outs += [store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.125) for i in range(300, 304)]
    monkeypatch.setattr(store_module, "prefill_attention", real)
    return store, outs


@pytest.mark.parametrize("recipe", shipped_recipes())
def test_skipping_the_mass_changes_no_shipped_recipe(recipe, monkeypatch):
    """A policy that declares it reads no summed mass (``reads_mass``) keeps, scores and outputs exactly
    what it does when the prefill computes the mass anyway."""
    policy = el.load_recipe(recipe)
    skipped, skipped_outs = _prefill_and_decode(policy, monkeypatch, force_mass=False)
    forced, forced_outs = _prefill_and_decode(el.load_recipe(recipe), monkeypatch, force_mass=True)
    assert torch.equal(skipped.pos, forced.pos)
    for name in forced.state:
        torch.testing.assert_close(skipped.state[name], forced.state[name], rtol=0, atol=0, equal_nan=True)
    for a, b in zip(skipped_outs, forced_outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_which_policies_read_the_mass():
    assert el.load_recipe("h2o").reads_mass and el.load_recipe("ahakv").reads_mass
    assert not any(el.load_recipe(r).reads_mass for r in ("streaming_llm", "local", "full", "keydiff", "knorm",
                                                           "tova", "snapkv", "scissorhands", "tova_keydiff"))
