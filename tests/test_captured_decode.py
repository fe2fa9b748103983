"""The compiled decode forward is capturable as one CUDA graph per step (``hf/compiled_forward.py``).

A CUDA graph replays fixed kernels on fixed addresses, so what a captured step may not hold is checked here on
the CPU, with the capture switched on as on CUDA (``captures``): one graph serves every step (nothing that
grows or counts with the sequence is a value of the graph: a step that needed one would be traced again),
every tensor the step writes is a static input (marked at a fixed address; inductor declines to capture a
graph that writes any other input), and the logits are those of the same steps run eagerly. On a GPU,
``tests/test_cuda.py`` replays the captured graph itself.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.output_code as output_code
from torch._dynamo.utils import counters

import evictlayers as el
from evictlayers.hf import compiled_forward
from test_compiled_forward import POLICIES
from tiny_models import build, greedy, left_padded, single_thread  # noqa: F401

STEPS = 24


@pytest.fixture
def graphs(monkeypatch) -> list[dict]:
    """The capture as on CUDA, and for each graph inductor builds: its inputs written in place and which of
    them are static."""
    monkeypatch.setattr(compiled_forward, "captures", lambda device: True)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # a cached graph is not built again
    built: list[dict] = []
    init = output_code.CompiledFxGraph.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append({"mutated": set(self.mutated_input_idxs), "static": set(self.fx_kwargs["static_input_idxs"])})

    monkeypatch.setattr(output_code.CompiledFxGraph, "__init__", recorded)
    return built


def decoded(model, policy, compile: bool):
    ids, mask = left_padded([40, 31])
    with torch.no_grad(), el.apply(model, policy, compile=compile) as run:
        out = greedy(model, ids, mask, STEPS + 1)
        stats = run.stats()
    return torch.stack(out.logits), stats


@pytest.mark.parametrize("name", ["h2o", "streaming_llm-rolling", "tova_keydiff_chunked", "full"])
def test_every_step_replays_one_graph_that_writes_only_static_buffers(name, graphs):
    model = build("llama")
    policy = el.load_recipe("full") if name == "full" else POLICIES[name]()
    eager, _ = decoded(model, policy, compile=False)
    torch._dynamo.reset()
    counters.clear()
    logits, stats = decoded(model, policy, compile=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert len(graphs) == 1
    written = graphs[0]["mutated"]
    # each layer's slots, positions, state and tokens seen, every one at a fixed address
    assert len(written) >= 4 * model.config.num_hidden_layers and written <= graphs[0]["static"]
    # not captured on the CPU: inductor skips CUDA graphs there, which the run reports
    assert stats["compiled_decode"] == {"graph_steps": STEPS, "eager_steps": 0, "captured": False, "eager_reason": None}
    torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


def test_a_full_cache_that_grows_keeps_one_graph_per_size(graphs):
    # a full cache grows between steps (outside the graph): a new size is a new graph, the same size none
    model, policy = build("llama"), el.load_recipe("full")
    ids, mask = left_padded([40, 31])
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), el.apply(model, policy, compile=True) as run:
        cache = run.new_cache()
        out = model(ids, attention_mask=mask, past_key_values=cache)
        capacities = set()
        for _ in range(150):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, position_ids=positions(mask),
                        past_key_values=cache)
            capacities.add(cache.layers[0].store.capacity)
    assert len(capacities) == 3
    # the first graph holds its buffers' size, the second is generic over it: none after
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_a_step_that_cannot_be_one_graph_says_why_once(graphs):
    model = build("llama")
    policy = el.load_recipe("clustergen").replace(budget=12)
    with pytest.warns(UserWarning, match="holds a ClusterSketch") as caught:
        _, stats = decoded(model, policy, compile=True)
    assert sum("layer by layer" in str(w.message) for w in caught) == 1
    paths = stats["compiled_decode"]
    assert paths["graph_steps"] == 0 and paths["eager_steps"] == STEPS
    assert "ClusterSketch" in paths["eager_reason"]


def positions(mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the position of each row's newest token, as ``generate()`` counts it (real tokens only)."""
    return mask.long().cumsum(-1)[:, -1:] - 1


@pytest.mark.parametrize("given", [True, False], ids=["positions-given", "no-positions"])
def test_the_mask_is_no_argument_of_the_graph_where_the_positions_are(given, monkeypatch):
    """What the graph is called with at a step: with the positions given (as ``generate()`` gives them) no mask,
    whose length grows; without them the mask, from which some models (OPT) count the positions. The step's
    padding column is handed to the attention either way."""
    model = build("llama")
    calls = []
    with torch.no_grad(), el.apply(model, POLICIES["h2o"](), compile=True) as run:
        forward = model.forward
        graph = torch.compile(forward.eager, fullgraph=True)

        def spy(*args, **kwargs):
            calls.append((kwargs, run.step_real))
            return graph(*args, **kwargs)

        monkeypatch.setattr(forward, "compiled", spy)
        ids, mask = left_padded([12, 9])
        cache = run.new_cache()
        out = model(ids, attention_mask=mask, past_key_values=cache)
        for _ in range(2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            extra = {"position_ids": positions(mask)} if given else {}
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache, **extra)
    assert len(calls) == 2
    for step, (kwargs, real) in enumerate(calls):
        if given:
            assert kwargs["attention_mask"] is None
            assert kwargs["position_ids"].tolist() == [[12 + step], [9 + step]]
        else:
            assert kwargs["attention_mask"].shape == (2, 13 + step) and kwargs.get("position_ids") is None
        assert real.dtype == torch.bool and real.tolist() == [[True], [True]]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_a_model_that_counts_positions_from_the_mask_decodes_as_eagerly(family):
    """Without positions in the call, a model that counts them from the mask (OPT: its cumulative sum, so left
    padding shifts each row's) gets its mask in the graph and the eager logits."""
    model = build(family)
    logits = {}
    for compile in (False, True):
        torch._dynamo.reset()
        ids, mask = left_padded([12, 9])
        with torch.no_grad(), el.apply(model, POLICIES["h2o"](), compile=compile) as run:
            cache = run.new_cache()
            out = model(ids, attention_mask=mask, past_key_values=cache)
            steps = []
            for _ in range(6):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache)
                steps.append(out.logits[:, -1])
        logits[compile] = torch.stack(steps)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
