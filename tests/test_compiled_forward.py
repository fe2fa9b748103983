"""``apply(compile=True)``: a cache's one-token forwards run as one compiled graph of the whole model.

The reference is the same model and policy run eagerly (``compile=False``), whose decode the rest of the
suite pins against the unmodified model and the papers' algorithms, or for a full cache the unmodified model.
Each test also checks which path ran: the whole forward when every layer decodes in place, each layer's own
step otherwise.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import evictlayers as el
from evictlayers.compose import store as store_module
from evictlayers.hf.compiled_forward import CompiledDecodeForward
from evictlayers.hf.weights import weights_signature
from evictlayers.kernels import linear_cpu
from tiny_models import build, greedy, left_padded, single_thread  # noqa: F401

POLICIES = {
    "h2o": lambda: el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=10),
    # keys held un-rotated and rotated to their rank inside the step
    "streaming_llm-rolling": lambda: el.load_recipe("streaming_llm").replace(budget=10, positions="rolling"),
    "tova_keydiff_chunked": lambda: el.load_recipe("tova_keydiff_chunked").replace(budget=0.5, min_budget=1),
    "h2o_int4": lambda: el.Policy(
        el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=12,
        storage=el.QuantizedKV(bits=4, group=8, residual=4),
    ),
}


@pytest.fixture
def paths(monkeypatch) -> list[bool]:
    """Whether each forward took the whole compiled graph (``CompiledDecodeForward.stores_in_place``)."""
    taken: list[bool] = []
    stores_in_place = CompiledDecodeForward.stores_in_place

    def recorded(self):
        stores = stores_in_place(self)
        taken.append(stores is not None)
        return stores

    monkeypatch.setattr(CompiledDecodeForward, "stores_in_place", recorded)
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


def test_a_full_cache_in_position_order_decodes_as_one_graph_with_the_models_logits(paths, monkeypatch):
    # unpadded prompts: the full cache keeps its slots in position order and grows between steps (40 slots
    # after the prefill, 64 more at the first step and again at the 64th), outside the graph
    model, policy = build("llama"), el.load_recipe("full")
    ids, mask = left_padded([40, 40])
    unmodified = greedy(model, ids, mask, 80)
    grown = []
    make_room = store_module.SlotStore.make_room

    def recorded(store):
        before = store.capacity
        make_room(store)
        if not torch.compiler.is_compiling():  # the step's own call inside the graph (a list append would guard)
            grown.append(store.capacity > before)

    monkeypatch.setattr(store_module.SlotStore, "make_room", recorded)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), el.apply(model, policy, compile=True):
        out = greedy(model, ids, mask, 80)
    steps = 79
    assert paths[-steps:] == [True] * steps and not any(paths[:-steps])
    assert sum(grown) == 2 * model.config.num_hidden_layers  # every layer grew twice
    # the first graph holds the step count and the buffers' size as constants, the second is generic over
    # the step count, the third over the size too (after the second growth); none after
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(unmodified.logits), rtol=1e-4, atol=1e-4)
    assert torch.equal(out.sequences, unmodified.sequences)


def test_a_padded_full_cache_decodes_as_one_graph_over_all_its_slots(paths):
    # a padded prompt leaves the slots out of position order: the graph attends over every slot, the empty
    # ones masked by position, as a bounded cache does
    model, policy = build("llama"), el.load_recipe("full")
    eager_tokens, eager_logits = generated(model, policy, compile=False, new_tokens=12)
    torch._dynamo.reset()
    tokens, logits = generated(model, policy, compile=True, new_tokens=12)
    assert paths == [False] + [True] * 11
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, eager_tokens)


def test_a_padded_step_ends_the_full_caches_graph(paths):
    # a step whose token is padding in one row cannot keep that row's slots in order: the forward reads the
    # mask before taking the graph, and runs that step layer by layer
    model, policy = build("llama"), el.load_recipe("full")
    ids, mask = left_padded([40, 40])
    torch.manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 4))
    real = torch.ones(2, 4, dtype=torch.long)
    real[1, 1] = 0
    logits = {}
    for compile in (False, True):
        torch._dynamo.reset()
        paths.clear()
        with torch.no_grad(), el.apply(model, policy, compile=compile) as run:
            cache = run.new_cache()
            model(ids, attention_mask=mask, past_key_values=cache)
            steps = []
            for i in range(4):
                seen = torch.cat([mask, real[:, : i + 1]], dim=1)
                steps.append(model(tokens[:, i : i + 1], attention_mask=seen, past_key_values=cache).logits)
        logits[compile] = torch.cat(steps, dim=1)
    # in order until the padded step, which runs layer by layer; after it the graph attends over every slot
    assert paths == [False, True, False, True, True]
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["h2o", "full"])
def test_a_mask_shorter_than_the_tokens_so_far_is_refused_with_its_message(name):
    """The whole-forward graph reads the mask eagerly first: a step whose mask misses a column gets the
    eager path's ``ValueError``, not a ``CompileError`` from tracing the refusal."""
    model = build("llama")
    policy = POLICIES["h2o"]() if name == "h2o" else el.load_recipe("full")
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 30, dtype=torch.long)
    torch._dynamo.reset()
    with torch.no_grad(), el.apply(model, policy, compile=True) as run:
        cache = run.new_cache()
        model(ids, attention_mask=mask, past_key_values=cache)
        model(ids[:, :1], attention_mask=torch.ones(2, 31, dtype=torch.long), past_key_values=cache)
        with pytest.raises(ValueError, match="attention_mask has 31 columns, but the cache has seen 31 tokens"):
            model(ids[:, :1], attention_mask=torch.ones(2, 31, dtype=torch.long), past_key_values=cache)


def test_the_patch_puts_forward_back_as_it_was():
    model = build("llama")
    policy = POLICIES["h2o"]()
    hooked = model.model.layers[0].mlp.up_proj
    hooked.forward = hook = lambda input: torch.nn.functional.linear(input, hooked.weight)  # a hook's forward
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not hooked]
    with el.apply(model, policy, compile=True) as run:  # the linear layers untouched unless asked
        assert isinstance(model.forward, CompiledDecodeForward)
        assert not run.cpu_linear and not any("forward" in m.__dict__ for m in linears)
        assert hooked.forward is hook
    assert "forward" not in model.__dict__ and model.forward.__func__ is type(model).forward
    with el.apply(model, policy, compile=True, cpu_linear=True) as run:
        assert run.cpu_linear == linear_cpu.available()
        assert all("forward" in m.__dict__ for m in linears) == linear_cpu.available()
        assert hooked.forward is hook
    assert "forward" not in model.__dict__ and model.forward.__func__ is type(model).forward
    assert not any("forward" in m.__dict__ for m in linears) and hooked.forward is hook
    with el.apply(model, policy, compile="max-autotune"):  # the products left to inductor's own kernels
        assert not any("forward" in m.__dict__ for m in linears)
    own = model.forward  # an instance forward of the model's own (accelerate's hooks install one)
    model.forward = lambda *args, **kwargs: own(*args, **kwargs)
    installed = model.forward
    with el.apply(model, policy, compile=True):
        assert model.forward.eager is installed
    assert model.forward is installed
    with el.apply(model, policy):  # compile=False touches no forward
        assert model.forward is installed


def test_max_autotune_decodes_with_eager_logits_and_compiles_again_after_the_weights_change(paths):
    # the graph holds the weights as constants: after an in-place change, within the patch or before the next
    # one, it must be rebuilt, or the logits would still be the old weights'
    model, policy = build("llama"), POLICIES["h2o"]()
    ids, mask = left_padded([30, 24])
    weight = model.model.layers[0].mlp.down_proj.weight
    original = weight.detach().clone()
    results = {}
    for compile in (False, "max-autotune"):
        torch._dynamo.reset()
        paths.clear()
        with torch.no_grad():
            with el.apply(model, policy, compile=compile):
                before = greedy(model, ids, mask, 6)
                weight.mul_(-2.0)
                changed = greedy(model, ids, mask, 6)
            weight.copy_(original)
            with el.apply(model, policy, compile=compile):
                restored = greedy(model, ids, mask, 6)
        results[compile] = before, changed, restored
    assert paths == ([False] + [True] * 5) * 3
    for eager, compiled in zip(results[False], results["max-autotune"]):
        torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=1e-4, atol=1e-4)
        assert torch.equal(compiled.sequences, eager.sequences)
    before, changed, _ = results[False]
    assert not torch.allclose(torch.stack(before.logits), torch.stack(changed.logits))


def test_the_weights_signature_changes_with_any_parameter_replaced_repointed_or_written_in_place():
    model = build("llama")
    modules = list(model.modules())
    first = weights_signature(modules)
    assert weights_signature(modules) == first and weights_signature(model.modules()) == first
    layer = model.model.layers[1].self_attn.q_proj
    changes = [
        lambda: layer.weight.add_(0.0),  # written in place, even to the same values
        lambda: setattr(layer.weight, "data", layer.weight.detach().clone()),
        lambda: setattr(layer, "weight", torch.nn.Parameter(layer.weight.detach().clone())),
    ]
    with torch.no_grad():
        for change in changes:
            before = weights_signature(modules)
            change()
            assert weights_signature(modules) != before


@pytest.mark.parametrize("compile", ["max_autotune", "reduce-overhead", 1, None])
def test_an_unknown_compile_mode_is_refused_with_the_allowed_ones(compile):
    with pytest.raises(ValueError, match=r"compile=.*expected False, True or 'max-autotune'"):
        el.apply(build("llama"), POLICIES["h2o"](), compile=compile)


@pytest.mark.parametrize("compile", [False, "max-autotune"])
def test_cpu_linear_without_compile_true_is_refused_naming_what_is_allowed(compile):
    model = build("llama")
    with pytest.raises(ValueError, match=rf"cpu_linear=True, compile={compile!r}\).*use it with compile=True"):
        el.apply(model, POLICIES["h2o"](), compile=compile, cpu_linear=True)
    assert getattr(model, "_evictlayers_run", None) is None


def test_cpu_linear_on_a_model_off_the_cpu_is_refused_and_a_non_bool_is_a_type_error():
    model = build("llama").to("meta")
    with pytest.raises(ValueError, match=r"the model is on meta.*cpu_linear=True on a CPU model only"):
        el.apply(model, POLICIES["h2o"](), compile=True, cpu_linear=True)
    with pytest.raises(TypeError, match=r"cpu_linear='yes'\): expected True or False"):
        el.apply(build("llama"), POLICIES["h2o"](), compile=True, cpu_linear="yes")


def test_cpu_linear_where_the_op_cannot_run_warns_and_touches_no_linear(monkeypatch):
    # as where the op failed to build, or below AVX-512 (capping the instruction set, EVICTLAYERS_CPU_ISA=avx2,
    # would rebuild every other kernel of the patch for that level first)
    monkeypatch.setattr(linear_cpu, "unavailable_reason", lambda: "could not be built here (see the warning above)")
    model = build("llama")
    why = r"(could not be built|has loops only at the avx512 instruction-set level and above; this run's: \w+)"
    with pytest.warns(UserWarning, match=rf"cpu_linear=True\): the few-rows op {why}.*same logits"):
        run = el.apply(model, POLICIES["h2o"](), compile=True, cpu_linear=True)
    with run:
        assert not run.cpu_linear
        assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def recorded_graphs(monkeypatch) -> list[list]:
    """From here on (dynamo reset), each graph ``torch.compile`` traces runs as traced, and its call targets are
    appended to the returned list."""
    graphs = []
    compile = torch.compile

    def recording(graph, example_inputs):
        graphs.append([node.target for node in graph.graph.nodes if node.op == "call_function"])
        return graph.forward

    monkeypatch.setattr(torch, "compile", lambda function, **options: compile(function, backend=recording,
                                                                               fullgraph=True))
    torch._dynamo.reset()
    return graphs


def linear_calls(targets: list) -> int:
    """How many of a graph's call targets are BLAS's linear (``F.linear``, as dynamo records it)."""
    return sum(target in (torch.nn.functional.linear, torch._C._nn.linear) for target in targets)


def test_by_default_the_graph_computes_every_weight_product_with_blas_even_after_a_graph_with_the_op(monkeypatch):
    """``compile=True`` alone leaves the linear layers as they are: the graph holds ``F.linear`` for each and no
    ``few_rows_linear``, also when a graph traced under ``cpu_linear=True`` sits in dynamo's cache (no reset
    between the two patches): the guards on the layers' forwards make the second patch trace its own."""
    model, policy = build("llama"), POLICIES["h2o"]()
    graphs = recorded_graphs(monkeypatch)
    ids, mask = left_padded([30, 24])
    linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    with torch.no_grad():
        if linear_cpu.available():
            with el.apply(model, policy, compile=True, cpu_linear=True):
                greedy(model, ids, mask, 4)
            assert graphs and all(targets.count(linear_cpu.few_rows_linear) == linears for targets in graphs)
        with_op = len(graphs)
        with el.apply(model, policy, compile=True):
            compiled = greedy(model, ids, mask, 4)
        with el.apply(model, policy):
            eager = greedy(model, ids, mask, 4)
    assert len(graphs) > with_op
    for targets in graphs[with_op:]:
        assert linear_cpu.few_rows_linear not in targets and linear_calls(targets) == linears
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=1e-4, atol=1e-4)
    assert torch.equal(compiled.sequences, eager.sequences)


@pytest.mark.skipif(not linear_cpu.available(), reason="the AVX-512 linear kernel is not built here")
def test_the_graph_computes_every_weight_product_with_the_few_rows_op_and_reads_the_weights_in_place(monkeypatch):
    # cpu_linear=True does not freeze the weights: few_rows_linear reads each where it stands, so a weight changed
    # between steps is read as changed, in the same graph
    model, policy = build("llama"), POLICIES["h2o"]()
    graphs = recorded_graphs(monkeypatch)
    counters.clear()
    weight = model.model.layers[1].mlp.up_proj.weight
    original = weight.detach().clone()
    ids, mask = left_padded([30, 24])
    with torch.no_grad():
        with el.apply(model, policy, compile=True, cpu_linear=True):
            before = greedy(model, ids, mask, 6)
            weight.mul_(-2.0)
            changed = greedy(model, ids, mask, 6)
        with el.apply(model, policy):
            eager_changed = greedy(model, ids, mask, 6)
        weight.copy_(original)
    linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    # the first step's graph holds its step count as a constant, the second is generic over it; none after
    assert 1 <= len(graphs) <= 2
    for targets in graphs:
        assert targets.count(linear_cpu.few_rows_linear) == linears and linear_calls(targets) == 0
    torch.testing.assert_close(torch.stack(changed.logits), torch.stack(eager_changed.logits), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(torch.stack(before.logits), torch.stack(changed.logits))


@pytest.mark.skipif(torch.bfloat16 not in linear_cpu.served_dtypes(), reason="the machine has no AVX512-BF16")
def test_a_bfloat16_model_computes_its_weight_products_with_the_few_rows_op(monkeypatch):
    """A model loaded in bfloat16: the graph sends every weight product to the op's bfloat16 loops, and the first
    step's logits are the eager model's (BLAS's bfloat16 products) to bfloat16's precision; later steps follow
    each run's own argmax."""
    model, policy = build("llama").to(torch.bfloat16), POLICIES["h2o"]()
    graphs = recorded_graphs(monkeypatch)
    ids, mask = left_padded([30, 24])
    with torch.no_grad():
        with el.apply(model, policy, compile=True, cpu_linear=True):
            compiled = greedy(model, ids, mask, 3)
        with el.apply(model, policy):
            eager = greedy(model, ids, mask, 3)
    linears = sum(isinstance(module, torch.nn.Linear) for module in model.modules())
    assert graphs and all(targets.count(linear_cpu.few_rows_linear) == linears for targets in graphs)
    torch.testing.assert_close(compiled.logits[0].float(), eager.logits[0].float(), rtol=2e-2, atol=2e-2)
