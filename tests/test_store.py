"""SlotStore behaviour: windows, sinks, padding, per-row budgets, growth, bounded prefill memory."""

import json
import subprocess
import sys
import textwrap

import torch

import evictlayers as el


def _feed(store, q, k, v, real=None, chunk=1):
    for start in range(0, k.shape[2], chunk):
        sl = slice(start, start + chunk)
        store.step(q[:, :, sl], k[:, :, sl], v[:, :, sl], None if real is None else real[:, sl], scaling=0.5)


def _kept(store, b=0, h=0):
    pos = store.pos[b, h]
    return sorted(pos[pos >= 0].tolist())


def _qkv(batch=1, heads=2, n=30, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads * 2, n, d, generator=g), torch.randn(batch, heads, n, d, generator=g),
            torch.randn(batch, heads, n, d, generator=g))


def test_local_window_keeps_exactly_the_last_budget_tokens_at_every_step():
    q, k, v = _qkv()
    store = el.SlotStore(el.Policy(el.RecentWindow(), budget=7))
    for i in range(30):
        _feed(store, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
        for h in range(2):
            assert _kept(store, 0, h) == list(range(max(0, i - 6), i + 1))


def test_streaming_llm_keeps_sinks_and_recent():
    q, k, v = _qkv()
    store = el.SlotStore(el.Policy(el.SinkTokens(4), el.RecentWindow(), budget=10))
    _feed(store, q, k, v, chunk=5)
    assert _kept(store) == [0, 1, 2, 3] + list(range(24, 30))


def test_retained_never_exceeds_budget_and_store_is_budget_plus_one():
    q, k, v = _qkv(batch=2)
    store = el.SlotStore(el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.Cumulative()), budget=5))
    _feed(store, q[:, :, :12], k[:, :, :12], v[:, :, :12], chunk=12)
    assert store.keys.shape == (2, 2, 6, 8)
    for i in range(12, 30):
        _feed(store, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert int(store.retained().max()) == 5
        assert store.keys.shape == (2, 2, 6, 8)
        assert {i - 1, i} <= set(_kept(store, 1, 1))  # the recent window survives
    assert store.kv_bytes() == 2 * 2 * 2 * 6 * 8 * 4
    assert store.state_bytes() == 2 * 2 * 6 * (8 + 4)  # int64 position + one float32 score per slot


def test_state_bytes_count_a_windowed_ring():
    q, k, v = _qkv(n=12)
    store = el.SlotStore(el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.Windowed(4)), budget=5))
    _feed(store, q, k, v, chunk=12)
    assert store.state_bytes() == 1 * 2 * 6 * (8 + 4 * 4)  # position + a ring of 4 rows per slot


def test_padding_occupies_no_slot_and_padded_row_equals_row_alone():
    q, k, v = _qkv(batch=1, n=20, seed=1)
    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.4, min_budget=1)
    alone = el.SlotStore(policy)
    _feed(alone, q[:, :, :14], k[:, :, :14], v[:, :, :14], chunk=14)
    # the same 14 tokens after 6 padding columns carrying garbage
    pad = lambda t: torch.cat([torch.randn(1, t.shape[1], 6, t.shape[3]) * 50, t[:, :, :14]], dim=2)  # noqa: E731
    real = torch.cat([torch.zeros(1, 6, dtype=torch.bool), torch.ones(1, 14, dtype=torch.bool)], dim=1)
    padded = el.SlotStore(policy)
    out_padded = padded.step(pad(q), pad(k), pad(v), real, scaling=0.5)
    assert padded.budget.tolist() == alone.budget.tolist() == [6]  # 40% of 14 real tokens
    same_tokens = lambda: torch.equal(padded.pos.sort(-1).values, alone.pos.sort(-1).values)  # noqa: E731
    assert same_tokens()
    for i in range(14, 20):
        a = alone.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.5)
        b = padded.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.5)
        torch.testing.assert_close(a, b)
        assert same_tokens()
    assert (out_padded[:, :, :6] == 0).all()


def test_float_budget_is_per_row():
    q, k, v = _qkv(batch=2, n=20)
    real = torch.ones(2, 20, dtype=torch.bool)
    real[1, :10] = False
    store = el.SlotStore(el.Policy(el.RecentWindow(), budget=0.5, min_budget=1))
    _feed(store, q, k, v, real, chunk=20)
    assert store.budget.tolist() == [10, 5]
    assert store.retained()[:, 0].tolist() == [10, 5]
    assert store.keys.shape[2] == 11


def test_full_cache_grows_and_keeps_everything():
    q, k, v = _qkv(n=40)
    store = el.SlotStore(el.Policy(budget=None))
    _feed(store, q[:, :, :3], k[:, :, :3], v[:, :, :3], chunk=3)
    _feed(store, q[:, :, 3:], k[:, :, 3:], v[:, :, 3:])
    assert _kept(store) == list(range(40))
    assert store.capacity >= 40


def test_full_cache_grows_by_twice_the_square_root_of_its_slots():
    """Each growth adds ``max(64, 2 * isqrt(C))`` slots: the copy a growth makes, spread over the steps it
    covers, against the empty slots attention reads meanwhile (``compose/store.py``'s ``growth_slots``)."""
    q, k, v = _qkv(n=1100)
    store = el.SlotStore(el.Policy(budget=None))
    _feed(store, q[:, :, :1000], k[:, :, :1000], v[:, :, :1000], chunk=1000)
    capacities = [store.capacity]
    for i in range(1000, 1100):
        _feed(store, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
        if store.capacity != capacities[-1]:
            capacities.append(store.capacity)
    assert capacities == [1000, 1000 + 64, 1064 + 2 * 32]  # 2 * isqrt(1000) = 62 < 64; isqrt(1064) = 32
    assert _kept(store) == list(range(1100))


def test_long_prefill_stays_in_bounded_memory():
    """A 16k-token prompt prefills without an n x n matrix: peak RSS grows far less than one would need."""
    script = textwrap.dedent(
        """
        import json, resource, torch
        import evictlayers as el
        torch.manual_seed(0)
        n, d = 16384, 8
        q, k, v = torch.randn(1, 3, n, d), torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
        store = el.SlotStore(el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=0.1))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        store.step(q, k, v, scaling=d ** -0.5)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"grew_mb": (after - before) / 1024, "retained": int(store.retained().max())}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    full_matrix_mb = 3 * 16384 * 16384 * 4 / 2**20  # 3 query heads, float32: 3 GiB
    assert report["retained"] == 1638
    assert report["grew_mb"] < 400 < full_matrix_mb


def test_values_narrower_than_keys_attend_as_plain_softmax_and_evict():
    """Key and value head dims may differ (MLA-style 16 vs 12): with nothing evicted the output is plain
    causal softmax attention; under a budget the value slots shrink with the key slots."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 10, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g), torch.randn(2, 2, 10, 12, generator=g)
    full = el.SlotStore(el.Policy(budget=None))
    out = full.step(q, k, v, scaling=0.25)
    logits = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    causal = torch.ones(10, 10, dtype=torch.bool).triu(1)
    reference = torch.softmax(logits.masked_fill(causal, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    store = el.SlotStore(el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=4))
    store.step(q[:, :, :6], k[:, :, :6], v[:, :, :6], scaling=0.25)
    for i in range(6, 10):
        step = store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.25)
        assert step.shape == (2, 4, 1, 12)
    assert store.values.shape == (2, 2, 5, 12) and store.keys.shape == (2, 2, 5, 16)
    assert int(store.retained().max()) == 4


def test_eager_decode_ranks_only_on_steps_that_evict(monkeypatch):
    """Scissorhands' drop of m = B/2: a step over the budget ranks once and evicts m; the m - 1 steps after
    it hold no more than the budget, choose no victim, and (eager, CPU) skip the ranking altogether."""
    from evictlayers.compose import ranking

    calls = []
    priority = ranking.priority
    monkeypatch.setattr(ranking, "priority", lambda *args: calls.append(1) or priority(*args))
    q, k, v = _qkv(n=30)
    store = el.SlotStore(el.Policy(el.HeavyHitterSelector(el.LowScoreCounter(window=4)), budget=10, drop=0.5))
    store.step(q[:, :, :10], k[:, :, :10], v[:, :, :10], scaling=0.5)
    ranked = len(calls)
    held = []
    for i in range(10, 20):
        store.step(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], scaling=0.5)
        held.append(int(store.retained().max()))
    # 11 held at step 10 -> 5 evicted -> 6; then 7..10 within the budget; 11 at step 15 -> 6 again
    assert held == [6, 7, 8, 9, 10, 6, 7, 8, 9, 10]
    assert len(calls) - ranked == 2
