"""The flash-attention CPU prefill against the reference, and the kernel dispatcher's switch and errors."""

import pytest
import torch

import evictlayers as el
from evictlayers.compose.recipes import shipped_recipes

from evictlayers.kernels import dispatch
from evictlayers.kernels.attention_mass import attention_with_mass
from evictlayers.kernels.decode_attention import decode_attention_with_mass
from evictlayers.kernels.prefill_cpu import attention_with_mass_cpu
from tiny_models import single_thread  # noqa: F401 (autouse fixture)


def prefill_inputs(seed, older, new, groups=3, kv_heads=2, head_dim=24, batch=2, dtype=torch.float32):
    """A (chunked) prefill: ``older`` unordered slots with holes, then ``new`` in-order slots for the chunk's
    queries; row 1 is left-padded by 3 tokens (padding queries at -1, their slots empty)."""
    g = torch.Generator().manual_seed(seed)
    n_slots = older + new
    query = torch.randn(batch, kv_heads * groups, new, head_dim, generator=g).to(dtype)
    key = torch.randn(batch, kv_heads, n_slots, head_dim, generator=g).to(dtype)
    value = torch.randn(batch, kv_heads, n_slots, head_dim, generator=g).to(dtype)
    old = torch.stack([torch.randperm(2 * older, generator=g)[:older] for _ in range(batch * kv_heads)])
    old[torch.rand(old.shape, generator=g) < 0.2] = -1
    fresh = torch.arange(2 * older, 2 * older + new).expand(batch * kv_heads, new)
    key_pos = torch.cat([old, fresh], dim=1).view(batch, kv_heads, n_slots)
    query_pos = torch.arange(2 * older, 2 * older + new).repeat(batch, 1)
    query_pos[1, :3] = -1
    key_pos[1, :, older : older + 3] = -1
    return query, key, value, query_pos, key_pos


def assert_same(got, want, atol=1e-5):
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert not a.isnan().any(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize(
    "older,new,groups,window,chunk",
    [(0, 29, 1, None, 1 << 24), (13, 17, 3, None, 200), (40, 23, 4, 9, 1 << 24), (7, 31, 3, 5, 700)],
    ids=["prompt-g1", "chunked-g3-small-chunks", "chunked-g4-window", "chunked-g3-window-small-chunks"],
)
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_cpu_prefill_matches_reference(reduce, older, new, groups, window, chunk, with_gain):
    query, key, value, query_pos, key_pos = prefill_inputs(older + new + groups, older, new, groups)
    gain = torch.rand(2, new, generator=torch.Generator().manual_seed(3)) * 3 if with_gain else None
    if gain is not None:
        gain[0, 4] = 0.0  # gain 0: uniform over the visible slots
    kwargs = dict(scaling=0.3, sliding_window=window, gqa_reduce=reduce, score_gain=gain, keep_rows=6,
                  max_chunk_elements=chunk)
    got = attention_with_mass_cpu(query, key, value, query_pos, key_pos, **kwargs)
    assert_same(got, attention_with_mass(query, key, value, query_pos, key_pos, **kwargs))
    assert (got.out[1, :, :3] == 0).all() and (got.mass[key_pos < 0] == 0).all()


@pytest.mark.parametrize("keep_rows", [0, 1, 6, 40], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("with_gain", [False, True], ids=["model-softmax", "score-gain"])
def test_cpu_prefill_without_the_mass_keeps_output_and_rows(keep_rows, with_gain):
    """``mass=False`` (a policy that reads no summed mass) skips the recompute outside the kept rows: the
    output and the kept rows are the reference's, across chunk boundaries, with a window and a gain."""
    query, key, value, query_pos, key_pos = prefill_inputs(11, 13, 31, groups=3)
    gain = torch.rand(2, 31, generator=torch.Generator().manual_seed(4)) * 3 if with_gain else None
    kwargs = dict(scaling=0.3, sliding_window=7, score_gain=gain, keep_rows=keep_rows, max_chunk_elements=500)
    got = attention_with_mass_cpu(query, key, value, query_pos, key_pos, mass=False, **kwargs)
    want = attention_with_mass(query, key, value, query_pos, key_pos, **kwargs)
    assert_same(got._replace(mass=want.mass), want)
    assert (got.mass == 0).all()


def test_cpu_prefill_without_mass_or_rows_scores_nothing(monkeypatch):
    """With neither the mass nor kept rows wanted, no probability is recomputed: the flash op alone."""
    import evictlayers.kernels.prefill_cpu as prefill_cpu

    scored = []
    real = prefill_cpu._scoring_probs
    monkeypatch.setattr(prefill_cpu, "_scoring_probs", lambda *a: scored.append(1) or real(*a))
    query, key, value, query_pos, key_pos = prefill_inputs(13, 5, 40)
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, mass=False, max_chunk_elements=300)
    assert scored == []
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, mass=False, keep_rows=2,
                            max_chunk_elements=300)
    assert len(scored) == 2  # chunks of one query here (300 elements): the last two only


def test_dispatcher_without_the_mass_returns_zeros_on_every_kernel(kernels, monkeypatch):
    query, key, value, query_pos, key_pos = prefill_inputs(12, 5, 9)
    for choice in ("auto", "reference"):
        monkeypatch.setattr(dispatch, "_requested", choice)
        got = dispatch.prefill_attention(query, key, value, query_pos, key_pos, scaling=0.3, keep_rows=2,
                                         need_mass=False)
        want = attention_with_mass(query, key, value, query_pos, key_pos, scaling=0.3, keep_rows=2)
        assert_same(got._replace(mass=want.mass), want)
        assert (got.mass == 0).all(), choice


def test_cpu_prefill_in_half_precision_and_with_keep_rows_beyond_the_chunk():
    query, key, value, query_pos, key_pos = prefill_inputs(5, 11, 19, groups=4, dtype=torch.float16)
    kwargs = dict(scaling=0.25, keep_rows=50, max_chunk_elements=300)
    got = attention_with_mass_cpu(query, key, value, query_pos, key_pos, **kwargs)
    assert got.rows.shape == (2, 2, 19, 30)
    assert_same(got, attention_with_mass(query, key, value, query_pos, key_pos, **kwargs), atol=1e-3)


def test_cpu_prefill_falls_back_to_the_reference_for_softcap():
    query, key, value, query_pos, key_pos = prefill_inputs(6, 9, 12)
    kwargs = dict(scaling=0.3, softcap=2.0, gqa_reduce="max", keep_rows=2)
    got = attention_with_mass_cpu(query, key, value, query_pos, key_pos, **kwargs)
    assert_same(got, attention_with_mass(query, key, value, query_pos, key_pos, **kwargs), atol=0.0)


def test_cpu_prefill_leaves_a_float32_cache_uncopied(monkeypatch):
    """The flash op and the logits matmul read the cache itself (views, stride-0 group expansion)."""
    query, key, value, query_pos, key_pos = prefill_inputs(7, 8, 10)
    seen = []
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def spy(q, k, v, **kwargs):
        seen.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
        return flash(q, k, v, **kwargs)

    monkeypatch.setattr("evictlayers.kernels.prefill_cpu._FLASH", spy)
    attention_with_mass_cpu(query, key, value, query_pos, key_pos, scaling=0.3, max_chunk_elements=200)
    assert len(seen) > 1
    assert set(seen) == {(key.untyped_storage().data_ptr(), value.untyped_storage().data_ptr())}


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
