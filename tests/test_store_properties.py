"""Random call sequences on a model-free slot store (hypothesis): prefill chunks, decode
steps, beam reorders and resets, with random padding and budgets, through the transformers cache layer.

After every call: each head holds at most its budget; positions are unique per head and in the past;
the sink tokens and the most recent tokens are held; and per-slot and per-head state follow their
tokens: ``KeyNorm``'s stored norm equals the norm of the key the caller fed for that (row, position)
(tracked here in a shadow of the inputs, permuted by reorders), and ``KeyDiff``'s anchor equals the
sum of the held keys' unit vectors.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import evictlayers as el
from evictlayers.hf.cache import EvictionLayer
from reference_scorers import single_thread  # noqa: F401 (autouse fixture)

HEADS, DIM = 2, 4


@st.composite
def programs(draw):
    batch = draw(st.integers(1, 3))
    sinks, recent = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    budget = draw(st.integers(sinks + recent + 2, 10))
    calls = draw(st.lists(st.sampled_from(["prefill", "decode", "decode", "decode", "reorder", "reset"]),
                          min_size=1, max_size=14))
    return {"batch": batch, "sinks": sinks, "recent": recent, "budget": budget, "calls": calls,
            "seed": draw(st.integers(0, 2**16)), "lengths": [draw(st.integers(1, 9)) for _ in range(batch)]}


def _policy(p) -> el.Policy:
    modules = [el.SinkTokens(p["sinks"])] if p["sinks"] else []
    modules += [el.RecentWindow(p["recent"])] if p["recent"] else []
    return el.Policy(*modules, el.HeavyHitterSelector(el.KeyNorm(), share=0.5),
                     el.HeavyHitterSelector(el.KeyDiff(), share=0.5), budget=p["budget"])


def _check(layer: EvictionLayer, p, shadow: list[dict[int, torch.Tensor]]) -> None:
    store = layer.store
    if store.kv is None:
        return
    keys = store.keys
    for row in range(p["batch"]):
        seen = int(store.seen[row])
        for head in range(HEADS):
            pos = store.pos[row, head]
            held = pos[pos >= 0].tolist()
            assert len(held) <= p["budget"]
            assert len(set(held)) == len(held) and all(0 <= j < seen for j in held)
            must = set(range(min(p["sinks"], seen))) | set(range(max(0, seen - p["recent"]), seen))
            if seen > p["budget"]:
                assert must <= set(held), (must, held)
            else:
                assert set(held) == set(range(seen))  # under budget nothing is evicted
            unit = torch.zeros(DIM)
            for slot in (pos >= 0).nonzero().flatten().tolist():
                j = int(pos[slot])
                fed = shadow[row][j][head]
                torch.testing.assert_close(keys[row, head, slot], fed)
                assert math.isclose(float(store.state["0.key_norm"][row, head, slot]), float(fed.norm()), rel_tol=1e-5)
                unit += fed / fed.norm()
            torch.testing.assert_close(store.state["1.anchor"][row, head], unit, atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_call_sequences_keep_the_store_invariants(p):
    g = torch.Generator().manual_seed(p["seed"])
    layer = EvictionLayer(_policy(p))
    batch = p["batch"]
    shadow: list[dict[int, torch.Tensor]] = [{} for _ in range(batch)]  # row -> position -> [H, D] key fed
    for call in p["calls"]:
        store = layer.store
        if call == "reset":
            layer.reset()
            shadow = [{} for _ in range(batch)]
            continue
        if call == "reorder":
            if store.kv is None:
                continue
            order = torch.randint(0, batch, (batch,), generator=g)
            layer.reorder_cache(order)
            shadow = [dict(shadow[int(i)]) for i in order]
            _check(layer, p, shadow)
            continue
        width = max(p["lengths"]) if call == "prefill" else 1
        real = torch.ones(batch, width, dtype=torch.bool)
        if call == "prefill":
            for row, length in enumerate(p["lengths"]):
                real[row, : width - length] = False  # left padding
        else:
            real[:, 0] = torch.rand(batch, generator=g) > 0.2  # a padded decode column now and then
        q = torch.randn(batch, HEADS, width, DIM, generator=g)
        k = torch.randn(batch, HEADS, width, DIM, generator=g) + 0.5
        v = torch.randn(batch, HEADS, width, DIM, generator=g)
        seen = store.seen.clone() if store.seen is not None else torch.zeros(batch, dtype=torch.long)
        layer.store.step(q, k, v, real, scaling=0.5)
        for row in range(batch):
            position = int(seen[row])
            for col in range(width):
                if real[row, col]:
                    shadow[row][position] = k[row, :, col]
                    position += 1
        _check(layer, p, shadow)
