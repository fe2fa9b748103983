"""evictlayers on a CUDA GPU: the Triton kernels inside whole models, eager and compiled.

Skipped without CUDA. The reference is the same policy on the CPU through the naive kernels
(``EVICTLAYERS_KERNELS=reference``, which the rest of the suite pins against the papers' algorithms and the
unmodified model): a tiny float32 model must decode the same logits,
keep the same tokens and hold the same bytes on both devices. TF32 is switched off for these tests, as the
kernels themselves use exact products for float32 caches. A bfloat16 model is held to its float32 self
loosely (it rounds every activation to 8 bits of mantissa), and with a full cache to the unmodified model.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import evictlayers as el
from evictlayers.compose.recipes import SHIPPED_RECIPES
from evictlayers.compose.store import CompileError
from evictlayers.kernels import dispatch
from kernel_inputs import on_device, prefill_inputs, quantized_inputs
from test_captured_decode import positions
from test_compile import LENGTHS, POLICIES
from test_compile import decode_logits as compiled_decode_logits
from tiny_models import build, left_padded

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("exact_float32"),  # conftest.py: the kernels use exact products for float32 caches
]

STEPS = 60


def decode_logits(model, policy, device, *, compile=False, steps=STEPS):
    """``test_compile``'s greedy loop over a left-padded batch of two, ``steps`` long, on ``device``."""
    return compiled_decode_logits(model, policy, compile, steps=steps, device=device)


def unmodified_logits(model, device, steps=STEPS):
    """The same greedy loop through transformers' own cache, no evictlayers."""
    model = model.to(device)
    ids, mask = (t.to(device) for t in left_padded(LENGTHS))
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = out.past_key_values
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float().cpu())
    return torch.stack(logits)


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
@pytest.mark.parametrize("name", ["h2o", "h2o-int4", "scissorhands-ahakv-parts"])
def test_cuda_decodes_as_the_cpu_does(family, name, monkeypatch):
    monkeypatch.setattr(dispatch, "_requested", "reference")
    on_cpu, cpu_stats = decode_logits(build(family), POLICIES[name](), "cpu")
    monkeypatch.setattr(dispatch, "_requested", "auto")
    on_gpu, gpu_stats = decode_logits(build(family), POLICIES[name](), "cuda")
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-4)
    assert gpu_stats == cpu_stats


RECIPES = sorted(path.stem for path in SHIPPED_RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_shipped_recipes_decode_as_on_the_cpu(recipe, monkeypatch):
    """Every shipped recipe (sketches, rolling positions, chunks, per-head state, allocations, int4) on a
    model with a sliding window and soft-capping, at a budget of 40 tokens of a 20-token prompt grown by decoding."""
    policy = el.load_recipe(recipe)
    if policy.budget is not None:
        policy = policy.replace(budget=40)
    if isinstance(policy.storage, el.QuantizedKV):  # groups that divide the tiny model's head dim of 16
        storage = policy.storage
        policy = policy.replace(storage={"_component_": "QuantizedKV", "bits": storage.bits, "group": 8,
                                         "residual": storage.residual})
    monkeypatch.setattr(dispatch, "_requested", "reference")
    on_cpu, cpu_stats = decode_logits(build("gemma2"), policy, "cpu")
    monkeypatch.setattr(dispatch, "_requested", "auto")
    on_gpu, gpu_stats = decode_logits(build("gemma2"), policy, "cuda")
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-4, atol=1e-4)
    assert gpu_stats == cpu_stats


def test_cuda_compiled_step_is_one_graph_with_the_eager_logits():
    eager, eager_stats = stepped(build("llama"), POLICIES["h2o"](), compile=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, stats = stepped(build("llama"), POLICIES["h2o"](), compile=True)
    # the whole decode forward, one graph for every step, captured
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert stats.pop("compiled_decode")["captured"] and stats == eager_stats


def stepped(model, policy, *, compile: bool, steps: int = 30, quiet_from: int | None = None):
    """``[steps, B, vocab]`` logits of a greedy loop on CUDA over a left-padded batch of two, tokens chosen on the
    device and positions passed as ``generate()`` passes them, and ``run.stats()``. From step ``quiet_from`` on,
    any host synchronisation raises (``torch.cuda.set_sync_debug_mode("error")``); the logits are read back
    after the loop."""
    model = model.to("cuda")
    ids, mask = (t.to("cuda") for t in left_padded(LENGTHS))
    logits = []
    with torch.no_grad(), el.apply(model, policy, compile=compile) as run:
        cache = run.new_cache()
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        try:
            for step in range(steps):
                if step == quiet_from:
                    torch.cuda.set_sync_debug_mode("error")
                token = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = model(input_ids=token, attention_mask=mask, position_ids=positions(mask), past_key_values=cache)
                logits.append(out.logits[:, -1].float().clone())  # a replay's outputs are its graph's buffers
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return torch.stack(logits).cpu(), run.stats()


CAPTURED_RECIPES = ["full", "h2o", "streaming_llm", "tova_keydiff_chunked", "snapkv", "scissorhands", "ahakv"]


@pytest.mark.parametrize("recipe", CAPTURED_RECIPES)
def test_cuda_captured_decode_has_the_eager_logits(recipe):
    """Shipped recipes on a model with a sliding window and soft-capping: every step replays one captured graph,
    with the logits of the same steps run eagerly."""
    policy = el.load_recipe(recipe)
    if policy.budget is not None:
        policy = policy.replace(budget=40)
    eager, eager_stats = stepped(build("gemma2"), policy, compile=False)
    torch._dynamo.reset()
    counters.clear()
    captured, stats = stepped(build("gemma2"), policy, compile=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    paths = stats.pop("compiled_decode")
    assert paths == {"graph_steps": 30, "eager_steps": 0, "captured": True, "eager_reason": None}
    torch.testing.assert_close(captured, eager, rtol=1e-4, atol=1e-4)
    assert stats == eager_stats


def test_cuda_captured_steps_do_not_wait_for_the_device():
    """After the graph is recorded, a step neither synchronises nor copies to the host: the host queues
    replays ahead of the device."""
    logits, stats = stepped(build("llama"), POLICIES["h2o"](), compile=True, steps=12, quiet_from=4)
    assert logits.isfinite().all() and stats["compiled_decode"]["captured"]


def test_cuda_captured_decode_survives_generate_beams_and_a_new_prompt():
    """generate()'s own steps, a beam search (which reorders the cache between steps) and a second prompt
    (new buffers: the graph is recorded again, not compiled again) give the eager tokens."""
    model = build("llama").to("cuda")
    policy = POLICIES["h2o"]()
    prompts = [left_padded(LENGTHS, seed=seed) for seed in (1, 2)]
    tokens = {}
    for compile in (False, True):
        torch._dynamo.reset()
        with torch.no_grad(), el.apply(model, policy, compile=compile):
            tokens[compile] = [
                model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12, do_sample=False,
                               num_beams=beams).cpu()
                for ids, mask in prompts for beams in (1, 2)
            ]
    for got, want in zip(tokens[True], tokens[False]):
        assert torch.equal(got, want)


def test_cuda_compiled_quantized_step_is_refused():
    """Inductor's build of the int4 step computed other logits than the eager step on an H200: refused, not run."""
    with pytest.raises(CompileError, match="does not compile the decode step of layer 0 on CUDA with QuantizedKV"):
        decode_logits(build("llama"), POLICIES["h2o-int4"](), "cuda", compile=True, steps=1)


def test_cuda_eager_kernel_calls_launch_without_the_higher_order_op(monkeypatch):
    """An eager decode call launches its Triton kernels directly: through ``wrap_triton``'s higher-order op
    each launch costs more host time than the kernels take at a few thousand slots."""
    from torch._higher_order_ops import triton_kernel_wrap

    from evictlayers.kernels.decode.triton import decode_attention_with_mass_triton
    from evictlayers.kernels.quantized_decode.triton import quantized_decode_attention_with_mass_triton

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call launched a kernel through wrap_triton's higher-order op")

    monkeypatch.setattr(triton_kernel_wrap.TraceableTritonKernelWrapper, "__call__", refuse)
    query, key, value, query_pos, key_pos = on_device(prefill_inputs(0, 40, 1), "cuda")
    dense = decode_attention_with_mass_triton(query[:, :, 0], key, value, query_pos[:, 0], key_pos, scaling=0.2)
    query, packed, *rest = on_device(quantized_inputs(0, 40, 5), "cuda")
    codes = quantized_decode_attention_with_mass_triton(query, packed, *rest, scaling=0.2)
    assert dense.out[0].isfinite().all() and codes.out[0].isfinite().all()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cuda_full_cache_is_the_unmodified_model(family):
    want = unmodified_logits(build(family), "cuda")
    got, _ = decode_logits(build(family), el.Policy(budget=None), "cuda")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cuda_bfloat16_stays_near_float32():
    """Tokens follow each run's own argmax, so only the first step (the same prefix) is compared."""
    full, _ = decode_logits(build("llama"), POLICIES["h2o"](), "cuda", steps=1)
    half, stats = decode_logits(build("llama").to(torch.bfloat16), POLICIES["h2o"](), "cuda", steps=1)
    assert half.isfinite().all()
    assert (half - full).abs().max() <= 0.05 * full.abs().max()
    assert all(layer["retained_tokens"] <= 10 for layer in stats["layers"])
