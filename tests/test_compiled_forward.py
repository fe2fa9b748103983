"""``apply(compile=True)``: a bounded cache's one-token forwards run as one compiled graph of the whole model.

The reference is the same model and policy run eagerly (``compile=False``), whose decode the rest of the
suite pins against the unmodified model and the papers' algorithms. Each test also checks which path ran:
the whole forward when every layer decodes in place, each layer's own step otherwise.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import evictlayers as el
from evictlayers.compose import store as store_module
from evictlayers.hf.compiled_forward import CompiledDecodeForward
from tiny_models import build, greedy, left_padded, single_thread  # noqa: F401

POLICIES = {
    "h2o": lambda: el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=10),
    # keys held un-rotated and rotated to their rank inside the step
    "streaming_llm-rolling": lambda: el.load_recipe("streaming_llm").replace(budget=10, positions="rolling"),
    "tova_keydiff_chunked": lambda: el.load_recipe("tova_keydiff_chunked").replace(budget=0.5),
    "h2o_int4": lambda: el.Policy(
        el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=12,
        storage=el.QuantizedKV(bits=4, group=8, residual=4),
    ),
}


@pytest.fixture
def paths(monkeypatch) -> list[bool]:
    """Whether each forward took the whole compiled graph (``CompiledDecodeForward.in_place``)."""
    taken: list[bool] = []
    in_place = CompiledDecodeForward.in_place

    def recorded(self):
        taken.append(in_place(self))
        return taken[-1]

    monkeypatch.setattr(CompiledDecodeForward, "in_place", recorded)
    return taken


def generated(model, policy, compile: bool, new_tokens: int = 40):
    ids, mask = left_padded([60, 48])
    with torch.no_grad(), el.apply(model, policy, compile=compile):
        out = greedy(model, ids, mask, new_tokens)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("family, name", [("llama", n) for n in POLICIES] + [("gemma2", "tova_keydiff_chunked"),
                                                                            ("gpt2", "h2o")])
def test_bounded_cache_decodes_as_one_graph_with_eager_logits(family, name, paths, monkeypatch):
    model, policy = build(family), POLICIES[name]()
    eager_tokens, eager_logits = generated(model, policy, compile=False)

    def per_layer_step():
        raise AssertionError("a layer's own compiled step ran inside a whole-forward decode")

    torch._dynamo.reset()
    counters.clear()
    paths.clear()
    monkeypatch.setattr(store_module, "compiled_decode_step", per_layer_step)
    tokens, logits = generated(model, policy, compile=True)
    # the prefill (and the rolling positions' probe at apply time) runs eagerly, every one-token step through
    # the whole graph
    steps = 39
    assert paths[-steps:] == [True] * steps and not any(paths[:-steps])
    # the first step's graph holds its step count as a constant, the second is generic over it; none after
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, eager_tokens)


def test_a_full_cache_decodes_layer_by_layer(paths):
    model, policy = build("llama"), el.load_recipe("full")
    eager_tokens, eager_logits = generated(model, policy, compile=False, new_tokens=12)
    torch._dynamo.reset()
    tokens, logits = generated(model, policy, compile=True, new_tokens=12)
    assert not any(paths)  # an unbounded layer may grow between steps: never the whole graph
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, eager_tokens)


def test_the_patch_puts_forward_back_as_it_was():
    model = build("llama")
    policy = POLICIES["h2o"]()
    with el.apply(model, policy, compile=True):
        assert isinstance(model.forward, CompiledDecodeForward)
    assert "forward" not in model.__dict__ and model.forward.__func__ is type(model).forward
    own = model.forward  # an instance forward of the model's own (accelerate's hooks install one)
    model.forward = lambda *args, **kwargs: own(*args, **kwargs)
    installed = model.forward
    with el.apply(model, policy, compile=True):
        assert model.forward.eager is installed
    assert model.forward is installed
    with el.apply(model, policy):  # compile=False touches no forward
        assert model.forward is installed
