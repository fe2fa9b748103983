"""ClusterSketch and greedy k-center (ClusterGen, shared/seeds/004) on fixed buffers: the batched module flips the same
coins as a plain-loop Algorithm 1 (tests/reference_cluster_sketch.py) and agrees with it exactly, its
error meets the form of Theorem 2.4 on clusterable keys, its memory does not grow with the stream,
and the merge with the exact slots, k-center selection and argument checks behave as documented."""

from __future__ import annotations

import math

import pytest
import torch

from evictlayers.modules import KCenterSelector
from evictlayers.modules.cluster_sketch import ClusterSketch, SketchState, merge_with_exact
from evictlayers.modules.kcenter_selector import kcenter_select
from evictlayers.modules.sketch_coins import sketch_uniforms
from held_memory import held_bytes, storage_addresses
from reference_cluster_sketch import ReferenceStream, coin, reference_kcenter, salt
from tiny_models import single_thread  # noqa: F401 (autouse fixture)

NEG_INF = float("-inf")


def random_stream(batch, heads, n, dim, value_dim, seed, keep=0.7, scale=1.2):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, dim, generator=g) * scale
    values = torch.randn(batch, heads, n, value_dim, generator=g)
    mask = torch.rand(batch, heads, n, generator=g) < keep
    return keys, values, mask


def clusterable(n, m, dim, value_dim, delta, heads, seed):
    """``[1, heads, n, dim]`` keys that are (m, delta)-clusterable (Definition 2.1): each within
    ``delta / 2`` of one of ``m`` centres (so any two of a cluster are within ``delta``), the centres
    ``3 delta sqrt(m)`` from the origin in random directions, far enough apart (checked) that Algorithm 1
    with radius ``delta`` finds exactly the ``m`` clusters. Values are standard normal."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(heads, m, dim, generator=g)
    centres = centres / centres.norm(dim=-1, keepdim=True) * 3 * delta * math.sqrt(m)
    gaps = torch.cdist(centres, centres) + torch.eye(m) * 1e9
    assert gaps.min() > 2 * delta
    which = torch.randint(m, (heads, n), generator=g)
    directions = torch.randn(heads, n, dim, generator=g)
    directions = directions / directions.norm(dim=-1, keepdim=True)
    radii = torch.rand(heads, n, 1, generator=g) * delta / 2
    keys = centres.gather(1, which[..., None].expand(heads, n, dim)) + directions * radii
    values = torch.randn(heads, n, value_dim, generator=g)
    return keys[None], values[None]


def sketch_only(sketch, state, query, scaling, group_size=1):
    """Attention over nothing exact plus the sketch: Algorithm 1's ``z / tau`` (line 30)."""
    batch, q_heads, _ = query.shape
    value_dim = state.pair_values.shape[-1]
    terms = sketch.sketch_terms(state, query, scaling, group_size)
    return merge_with_exact(torch.zeros(batch, q_heads, value_dim), torch.full((batch, q_heads), NEG_INF), *terms)


def exact_attention(query, keys, values, scaling):
    """``(out [B, Hq, Dv], lse [B, Hq])`` of ``query [B, Hq, D]`` over ``keys [B, Hq, N, D]``."""
    logits = torch.einsum("bhd,bhnd->bhn", query, keys) * scaling
    return torch.einsum("bhn,bhnv->bhv", logits.softmax(-1), values), logits.logsumexp(-1)


def assert_states_equal(a: SketchState, b: SketchState):
    assert a.salt == b.salt
    for name, tensor in a.tensors().items():
        assert torch.equal(tensor, b.tensors()[name]), name


def test_batched_equals_plain_loop_algorithm_1():
    """Every head of a batch, with per-head masks, holds exactly what the one-head plain loop holds
    (clusters, counts, reservoirs, M, mu, overflow), and their estimates z / tau agree."""
    batch, heads, n, dim, value_dim, group = 2, 3, 40, 4, 5, 2
    radius, t, s, m = 1.5, 3, 4, 5  # M = 5 is small enough that every head also overflows
    sketch = ClusterSketch(radius=radius, samples_per_cluster=t, value_samples=s, max_clusters=m, seed=7)
    keys, values, mask = random_stream(batch, heads, n, dim, value_dim, seed=0)
    state = sketch.allocate(batch, heads, dim, value_dim, torch.float32, layer=2)
    sketch.absorb(state, keys[:, :, :25], values[:, :, :25], mask[:, :, :25])  # a prefill chunk,
    for i in range(25, n):  # then one token at a time, as while decoding
        sketch.absorb(state, keys[:, :, i : i + 1], values[:, :, i : i + 1], mask[:, :, i : i + 1])
    query = torch.randn(batch, heads * group, dim, generator=torch.Generator().manual_seed(1))
    out = sketch_only(sketch, state, query, 0.5, group)

    assert state.salt == salt(7, layer=2)
    assert (state.overflow > 0).all()
    for b in range(batch):
        for h in range(heads):
            ref = ReferenceStream(radius, t, s, m, value_dim, salt(7, layer=2), h)
            for i in range(n):
                if mask[b, h, i]:
                    ref.absorb(keys[b, h, i], values[b, h, i])
            used = len(ref.clusters)
            assert state.active[b, h].tolist() == [True] * used + [False] * (m - used)
            for i, (x, samples, count) in enumerate(ref.clusters):
                assert torch.equal(state.representatives[b, h, i], x)
                assert state.counts[b, h, i] == count
                assert torch.equal(state.cluster_samples[b, h, i], torch.stack(samples))
            for j, pair in enumerate(ref.pairs):
                if pair is None:
                    assert state.pair_weights[b, h, j] == 0
                else:
                    assert torch.equal(state.pair_keys[b, h, j], pair[0])
                    assert torch.equal(state.pair_values[b, h, j], pair[1])
                    assert state.pair_weights[b, h, j] == pair[2]
            assert state.mu[b, h] == ref.mu
            assert state.absorbed[b, h] == ref.absorbed == int(mask[b, h].sum())
            assert state.overflow[b, h] == ref.overflow
            for g in range(group):
                z, tau = ref.query(query[b, h * group + g], 0.5)
                torch.testing.assert_close(out[b, h * group + g].double(), z / tau, rtol=1e-5, atol=1e-6)


def test_coins_are_the_documented_hash():
    counter = torch.tensor([[0, 1, 2**31 + 5], [7, 2**32 - 1, 12345]])
    coins = sketch_uniforms(salt(3), counter, 4)
    for b in range(2):
        for h in range(3):
            assert coins[b, h].tolist() == [coin(salt(3), h, int(counter[b, h]), j) for j in range(4)]


def test_value_samples_follow_lemma_2_2_and_cluster_samples_follow_lemma_2_3():
    """``M(j)`` holds token ``i`` with probability ``||v_i||^2 / mu`` (Lemma 2.2) and a cluster's
    samples are uniform over its keys (Lemma 2.3, property 5): frequencies over 64 heads x 64 samples
    are within 4.5 standard deviations of those probabilities."""
    heads, n, samples = 64, 5, 64
    sketch = ClusterSketch(radius=10.0, samples_per_cluster=samples, value_samples=samples, max_clusters=2, seed=11)
    scales = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])
    keys = torch.arange(n, dtype=torch.float32)[:, None].expand(n, 2)  # all within radius: one cluster
    values = scales[:, None] * torch.tensor([0.6, 0.8])  # ||v_i|| = scales[i]
    state = sketch.allocate(1, heads, 2, 2, torch.float32)
    expand = (1, heads, n, -1)
    sketch.absorb(state, keys.expand(*expand), values.expand(*expand), torch.ones(1, heads, n, dtype=torch.bool))
    assert (state.active.sum(-1) == 1).all()
    trials = heads * samples
    for held, probs in [
        (state.pair_keys[..., 0], scales**2 / (scales**2).sum()),
        (state.cluster_samples[:, :, 0, :, 0], torch.full((n,), 1 / n)),
    ]:
        freq = torch.stack([(held == i).sum() for i in range(n)]).double() / trials
        sigma = (probs * (1 - probs) / trials).sqrt()
        assert ((freq - probs).abs() <= 4.5 * sigma).all(), (freq, probs)


def test_error_falls_with_samples_and_meets_the_form_of_theorem_2_4():
    """On (m, delta)-clusterable keys, the sketch alone (no exact slots) against exact attention over
    all n tokens. With r = scaling * max ||q|| and the Omega(.) constants of Theorem 2.4 taken as 1,
    i.e. eps(s, t) = max(sqrt(d_v / s), sqrt(e^{2 delta r} ln n / t)) (solving t = eps^-2 e^{2 delta r}
    log n and s = eps^-2 d for eps), every trial (16 heads x 4 queries per setting, stricter than the
    theorem's probability 0.99) satisfies Eq. (3):
        || z/tau - softmax(K q)^T V ||_2 <= eps(s, t) * || softmax(K q) ||_2 * || V ||_op,
    the mean error falls at every step of (s, t) and by 4x over the range (1/sqrt(s) predicts 8x), the
    partition estimate meets Eq. (5) (|tau / Z - 1| <= eps_t / 3 with eps_t the t-term alone), and the
    algorithm finds exactly m clusters (Lemma 2.3 with the pigeonhole argument of Sec. 2.4)."""
    n, m, dim, value_dim, delta, heads, queries = 400, 4, 8, 8, 1.0, 16, 4
    scaling, q_norm = 0.5, 2.0
    r = scaling * q_norm
    keys, values = clusterable(n, m, dim, value_dim, delta, heads, seed=0)
    query = torch.randn(1, heads, queries, dim, generator=torch.Generator().manual_seed(1))
    query = query / query.norm(dim=-1, keepdim=True) * q_norm
    logits = torch.einsum("bhqd,bhnd->bhqn", query, keys) * scaling
    probs = logits.softmax(-1)
    exact = probs @ values
    partition = logits.exp().sum(-1)
    scale = probs.norm(dim=-1) * torch.linalg.matrix_norm(values, ord=2)[..., None]  # [1, H, Q]

    means = []
    for s, t in [(4, 2), (16, 8), (64, 32), (256, 128)]:
        sketch = ClusterSketch(radius=delta, samples_per_cluster=t, value_samples=s, max_clusters=2 * m)
        state = sketch.allocate(1, heads, dim, value_dim, torch.float32)
        sketch.absorb(state, keys, values, torch.ones(1, heads, n, dtype=torch.bool))
        assert (sketch.stats(state)["clusters_in_use"] == m).all() and (state.overflow == 0).all()
        errors, tau_errors = [], []
        for i in range(queries):
            out = sketch_only(sketch, state, query[:, :, i], scaling)
            errors.append((out - exact[:, :, i]).norm(dim=-1) / scale[:, :, i])
            _, normaliser, log_scale = sketch.sketch_terms(state, query[:, :, i], scaling)
            tau_errors.append((normaliser * log_scale.exp() / partition[:, :, i] - 1).abs())
        eps_t = math.sqrt(math.exp(2 * delta * r) * math.log(n) / t)
        eps = max(math.sqrt(value_dim / s), eps_t)
        assert torch.stack(errors).max() <= eps, (s, t, torch.stack(errors).max(), eps)
        assert torch.stack(tau_errors).max() <= eps_t / 3, (s, t, torch.stack(tau_errors).max(), eps_t)
        means.append(float(torch.stack(errors).mean()))
    assert all(a > b for a, b in zip(means, means[1:])), means
    assert means[-1] < means[0] / 4, means


def sketch_bytes_formula(batch, heads, dim, value_dim, clusters, samples, pairs, element_size) -> int:
    """SketchState's documented buffers, per (row, KV head): representatives ``[M, D]``, cluster samples
    ``[M, t, D]``, pair keys ``[s, D]`` and pair values ``[s, D_v]`` in the cache dtype; counts ``[M]``
    int64 and active flags ``[M]`` bool; pair weights ``[s]`` float64; mu, absorbed and overflow one
    8-byte word each. Nothing depends on the number of tokens absorbed (Theorem 2.4: O(d (m t + s)))."""
    in_dtype = (clusters * dim + clusters * samples * dim + pairs * dim + pairs * value_dim) * element_size
    per_head = in_dtype + clusters * 8 + clusters * 1 + pairs * 8 + 3 * 8
    return batch * heads * per_head


def test_memory_does_not_grow_with_the_stream():
    """The tensors the sketch state really holds (their storages, measured) are the documented buffers
    and stay the same, written in place, as 200, 1000 and 2000 tokens of an (m, delta)-clusterable
    stream are absorbed; the reported ``bytes`` is that size."""
    m, dim, value_dim, delta, heads = 3, 4, 4, 1.0, 2
    clusters, samples, pairs = 4, 4, 8
    sketch = ClusterSketch(radius=delta, samples_per_cluster=samples, value_samples=pairs, max_clusters=clusters)
    keys, values = clusterable(2000, m, dim, value_dim, delta, heads, seed=0)
    state = sketch.allocate(1, heads, dim, value_dim, torch.float32)
    expected = sketch_bytes_formula(1, heads, dim, value_dim, clusters, samples, pairs, element_size=4)
    assert held_bytes(state) == expected
    addresses = storage_addresses(state)
    absorbed = 0
    for upto in (200, 1000, 2000):
        chunk = slice(absorbed, upto)
        real = torch.ones(1, heads, upto - absorbed, dtype=torch.bool)
        sketch.absorb(state, keys[:, :, chunk], values[:, :, chunk], real)
        absorbed = upto
        stats = sketch.stats(state)
        assert (stats["absorbed"] == upto).all() and (stats["overflow"] == 0).all()
        assert (stats["clusters_in_use"] == m).all()
        assert (stats["key_samples_held"] == m * samples).all() and (stats["value_samples_held"] == pairs).all()
        assert held_bytes(state) == expected, upto
        assert storage_addresses(state) == addresses, upto  # the same buffers, written in place
        assert stats["bytes"] == expected
        assert held_bytes(sketch) == 0  # the module itself keeps no tensors


def test_full_sketch_joins_the_nearest_cluster_and_counts_it():
    sketch = ClusterSketch(radius=0.1, samples_per_cluster=2, value_samples=2, max_clusters=2)
    keys = torch.tensor([[0.0, 0.0], [5.0, 0.0], [1.0, 0.0], [4.0, 0.0]])[None, None]
    state = sketch.allocate(1, 1, 2, 2, torch.float32)
    sketch.absorb(state, keys, torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, dtype=torch.bool))
    assert state.counts[0, 0].tolist() == [2, 2]  # 1.0 joined 0.0, 4.0 joined 5.0
    assert state.representatives[0, 0].tolist() == [[0.0, 0.0], [5.0, 0.0]]
    assert sketch.stats(state)["overflow"].tolist() == [[2]]


def test_same_seed_same_sketch_other_seed_other_sketch():
    keys, values, mask = random_stream(2, 2, 30, 4, 4, seed=3)
    query = torch.randn(2, 2, 4)
    outs = {}
    for name, seed in [("a", 5), ("b", 5), ("c", 6)]:
        sketch = ClusterSketch(radius=1.0, samples_per_cluster=3, value_samples=4, max_clusters=6, seed=seed)
        state = sketch.allocate(2, 2, 4, 4, torch.float32)
        sketch.absorb(state, keys, values, mask)
        outs[name] = (state, sketch_only(sketch, state, query, 0.5))
    assert_states_equal(outs["a"][0], outs["b"][0])
    assert torch.equal(outs["a"][1], outs["b"][1])
    assert not torch.equal(outs["a"][0].pair_keys, outs["c"][0].pair_keys)


def test_padded_batch_equals_each_row_alone():
    """A row's sketch depends on its own real tokens only: a left-padded row with per-head evictions
    gives the same buffers and output beside another row as alone."""
    batch, heads, n, dim, value_dim = 2, 2, 30, 4, 3
    keys, values, mask = random_stream(batch, heads, n, dim, value_dim, seed=4, keep=0.8)
    mask[1, :, :9] = False  # row 1: padding first
    keys[1, :, :9] = 1e4  # garbage under the mask must not leak in
    sketch = ClusterSketch(radius=1.0, samples_per_cluster=3, value_samples=4, max_clusters=6, seed=1)
    query = torch.randn(batch, heads, dim)
    both = sketch.allocate(batch, heads, dim, value_dim, torch.float32)
    sketch.absorb(both, keys, values, mask)
    out = sketch_only(sketch, both, query, 0.5)
    for b in range(batch):
        alone = sketch.allocate(1, heads, dim, value_dim, torch.float32)
        sketch.absorb(alone, keys[b : b + 1], values[b : b + 1], mask[b : b + 1])
        for name, tensor in alone.tensors().items():
            assert torch.equal(tensor[0], both.tensors()[name][b]), name
        assert torch.equal(sketch_only(sketch, alone, query[b : b + 1], 0.5)[0], out[b])


def test_merge_with_an_empty_sketch_is_exact_attention():
    batch, heads, group, n, dim, value_dim = 2, 2, 2, 7, 4, 3
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(batch, heads * group, n, dim, generator=g)
    values = torch.randn(batch, heads * group, n, value_dim, generator=g)
    query = torch.randn(batch, heads * group, dim, generator=g)
    out, lse = exact_attention(query, keys, values, 0.5)
    sketch = ClusterSketch(radius=1.0)
    state = sketch.allocate(batch, heads, dim, value_dim, torch.float32)
    numerator, normaliser, log_scale = sketch.sketch_terms(state, query, 0.5, group)
    assert (numerator == 0).all() and (normaliser == 0).all() and (log_scale == NEG_INF).all()
    torch.testing.assert_close(merge_with_exact(out, lse, numerator, normaliser, log_scale), out)
    # a query that sees nothing at all (padding) gets zeros, not NaN
    unseen = (torch.full_like(out, float("nan")), torch.full_like(lse, NEG_INF))
    assert (merge_with_exact(*unseen, numerator, normaliser, log_scale) == 0).all()


@pytest.mark.parametrize("scaling", [0.5, 200.0])
def test_merge_with_a_one_token_sketch_is_exact_over_all_tokens(scaling):
    """A sketch that absorbed one token per head holds it exactly (t copies in D, s copies in M, so
    z / tau = v), hence exact slots + sketch = exact attention over slots and token; at scaling 200
    the logits reach ~1000, where a merge outside log space would overflow."""
    batch, heads, n, dim, value_dim = 2, 2, 5, 4, 3
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(batch, heads, n + 1, dim, generator=g)
    values = torch.randn(batch, heads, n + 1, value_dim, generator=g)
    query = torch.randn(batch, heads, dim, generator=g)
    everything, _ = exact_attention(query.double(), keys.double(), values.double(), scaling)
    slots_out, slots_lse = exact_attention(query, keys[:, :, :n], values[:, :, :n], scaling)
    sketch = ClusterSketch(radius=1.0, samples_per_cluster=3, value_samples=4)
    state = sketch.allocate(batch, heads, dim, value_dim, torch.float32)
    sketch.absorb(state, keys[:, :, n:], values[:, :, n:], torch.ones(batch, heads, 1, dtype=torch.bool))
    merged = merge_with_exact(slots_out, slots_lse, *sketch.sketch_terms(state, query, scaling))
    torch.testing.assert_close(merged.double(), everything, rtol=1e-4, atol=1e-5)


def test_absorb_and_query_trace_into_one_graph():
    """No host synchronisation or generator: the decode-time path compiles with fullgraph=True."""
    sketch = ClusterSketch(radius=1.0, samples_per_cluster=3, value_samples=4, max_clusters=5)
    eager, compiled = (sketch.allocate(2, 2, 4, 4, torch.float32) for _ in range(2))

    def step(state, key, value, mask, query, exact_out, exact_lse):
        sketch.absorb(state, key, value, mask)
        return merge_with_exact(exact_out, exact_lse, *sketch.sketch_terms(state, query, 0.5, 2))

    traced = torch.compile(step, fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        args = (
            torch.randn(2, 2, 1, 4, generator=g),
            torch.randn(2, 2, 1, 4, generator=g),
            torch.rand(2, 2, 1, generator=g) < 0.8,
            torch.randn(2, 4, 4, generator=g),
            torch.randn(2, 4, 4, generator=g),
            torch.randn(2, 4, generator=g),
        )
        assert torch.equal(traced(compiled, *args), step(eager, *args))
    assert_states_equal(compiled, eager)


@pytest.mark.parametrize("k", [5, 12])
def test_kcenter_equals_the_plain_reference(k):
    batch, heads, n, dim = 2, 3, 12, 4
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(batch, heads, n, dim, generator=g)
    candidates = torch.rand(batch, heads, n, generator=g) < 0.6
    candidates[1, 2] = False  # a head with nothing to pick
    picks = kcenter_select(keys, candidates, k)
    assert picks.shape == (batch, heads, k) and picks.dtype == torch.int64
    for b in range(batch):
        for h in range(heads):
            assert picks[b, h].tolist() == reference_kcenter(keys[b, h], candidates[b, h], k)
    assert (picks[1, 2] == -1).all()
    assert torch.equal((picks >= 0).sum(-1), candidates.sum(-1).clamp(max=k))


def test_kcenter_does_not_depend_on_slot_order():
    keys = torch.randn(1, 2, 10, 3, generator=torch.Generator().manual_seed(9))
    candidates = torch.ones(1, 2, 10, dtype=torch.bool)
    candidates[:, :, 3] = False
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(10))
    picks = kcenter_select(keys, candidates, 4)
    shuffled = kcenter_select(keys[:, :, perm], candidates[:, :, perm], 4)
    assert torch.equal(perm[shuffled], picks)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"radius": None}, "radius"),
        ({"radius": 0.0}, "radius"),
        ({"radius": -1.0}, "radius"),
        ({"radius": float("inf")}, "radius"),
        ({"radius": True}, "radius"),
        ({"radius": 1.0, "samples_per_cluster": 0}, "samples_per_cluster"),
        ({"radius": 1.0, "value_samples": 0}, "value_samples"),
        ({"radius": 1.0, "value_samples": 2.0}, "value_samples"),
        ({"radius": 1.0, "max_clusters": 0}, "max_clusters"),
        ({"radius": 1.0, "seed": -1}, "seed"),
        ({"radius": 1.0, "seed": 2**32}, "seed"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, named):
    with pytest.raises(ValueError, match=rf"{named}="):
        ClusterSketch(**kwargs)


def test_the_old_mode_argument_names_the_component_that_replaced_it():
    with pytest.raises(TypeError, match="KCenterSelector"):
        ClusterSketch("kcenter")
    with pytest.raises(TypeError, match="mode"):
        ClusterSketch(mode="stream", radius=1.0)
    for centres in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="KCenterSelector\\(centres="):
            KCenterSelector(centres=centres)


def test_params_rebuild_an_equal_component():
    sketch = ClusterSketch(radius=0.5, samples_per_cluster=2, value_samples=3, max_clusters=4, seed=9)
    assert ClusterSketch(**sketch.params()) == sketch
    assert KCenterSelector(**KCenterSelector(centres=16).params()) == KCenterSelector(centres=16)
    assert KCenterSelector(centres=16) != KCenterSelector(centres=8)


def test_bad_shapes_raise():
    sketch = ClusterSketch(radius=1.0)
    state = sketch.allocate(2, 2, 4, 3, torch.float32)
    keys, values, mask = torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 3), torch.ones(2, 2, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="keys has shape"):
        sketch.absorb(state, torch.zeros(2, 2, 1, 5), values, mask)
    with pytest.raises(ValueError, match="values has shape"):
        sketch.absorb(state, keys, torch.zeros(2, 2, 2, 3), mask)
    with pytest.raises(ValueError, match="mask must be bool"):
        sketch.absorb(state, keys, values, mask.float())
    with pytest.raises(ValueError, match="group_size=1"):
        sketch.sketch_terms(state, torch.zeros(2, 4, 4), 0.5, 1)
    with pytest.raises(ValueError, match="k must be"):
        kcenter_select(keys, mask[..., 0], 0)
    with pytest.raises(ValueError, match="candidates"):
        kcenter_select(torch.zeros(2, 2, 6, 4), torch.ones(2, 2, 5, dtype=torch.bool), 2)
