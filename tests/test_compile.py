"""The compiled decode: no recompiles as the sequence grows, the same numbers as eager.

The reference is the eager decode step (the same function run without ``torch.compile``), whose
behaviour the rest of the suite pins against the unmodified model and the papers' algorithms; the
eviction guard makes sure the 300 steps really evict. Compiling a step takes ~20 s on one core, so
the default suite compiles six policies (one-at-a-time eviction, the same on int4 codes attended
blockwise, the sort path with every scorer kind, key scorers sharing the budget, fixed chunks and sentence
chunks); the other shipped recipes compile in the slow suite.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import evictlayers as el
from evictlayers.compose.store import CompileError
from evictlayers.scoring import Cumulative
from tiny_models import CharTokenizer, build, left_padded, single_thread  # noqa: F401

STEPS = 300
LENGTHS = [20, 13]


def decode_logits(model, policy, compile: bool, steps: int = STEPS, device: str = "cpu") -> tuple[torch.Tensor, dict]:
    """``[steps, B, vocab]`` float32 CPU logits of a greedy manual loop over a left-padded batch of two on
    ``device``, and the run's stats."""
    model = model.to(device)
    ids, mask = (t.to(device) for t in left_padded(LENGTHS))
    logits = []
    with torch.no_grad(), el.apply(model, policy, compile=compile, tokenizer=CharTokenizer()) as run:
        if policy.requires_probes:  # KVzip: the prompt but its last token compressed, then that token
            cache = run.compress_context(ids[:, :-1], mask[:, :-1], repeat_prompt=[5, 6, 7], chunk=8)
            out = model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True)
        else:
            cache = run.new_cache()
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float().cpu())
        stats = run.cache.stats()  # the cache's, which must not depend on compile (run.stats() adds the path)
    return torch.stack(logits), stats


def full_logits(model, steps: int) -> torch.Tensor:
    return decode_logits(model, el.Policy(budget=None), compile=False, steps=steps)[0]


POLICIES = {
    "h2o": lambda: el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=10),
    # attention straight from the packed codes (kernels/quantized_decode/cpu.py), the residual aging into codes
    "h2o-int4": lambda: el.Policy(
        el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=10,
        storage=el.QuantizedKV(bits=4, group=8, residual=4),
    ),
    "scissorhands-ahakv-parts": lambda: el.Policy(
        el.SinkTokens(2), el.RecentWindow(3),
        el.HeavyHitterSelector(el.Windowed(8), el.StepGainSoftmax(), el.ValuePrior()),
        budget=0.5, min_budget=1, drop=0.25,
    ),
    # per-head state (KeyDiff's anchor), pooling, layer scope (its max and its mean over the heads) and a
    # budget split between two selectors
    "shared-budget-key-scorers": lambda: el.Policy(
        el.SinkTokens(1),
        el.HeavyHitterSelector(el.Windowed(4), refine=[el.PooledScores(3), el.LayerScope("max")], share=0.5),
        el.HeavyHitterSelector(el.KeyDiff(), refine=[el.LayerScope()], share=0.5),
        budget=0.5, min_budget=1,
    ),
    # ChunkKV's chunk sums (a sort, cumulative sums and run ends in the graph)
    "chunks": lambda: el.Policy(
        el.RecentWindow(2), el.HeavyHitterSelector(el.Windowed(4), refine=[el.ChunkScores(3)]),
        budget=0.5, min_budget=1,
    ),
    # sentence chunks: each new token's sentence start written into the selector's state in the graph
    "sentences": lambda: el.Policy(
        el.RecentWindow(2), el.HeavyHitterSelector(el.Windowed(4), refine=[el.SentenceScores(4)]), budget=0.5,
        min_budget=1,
    ),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_one_graph_no_recompiles_same_logits_as_eager(name):
    model = build("llama")
    policy = POLICIES[name]()
    eager, eager_stats = decode_logits(model, policy, compile=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, stats = decode_logits(model, policy, compile=True)
    # the whole decode forward (hf/compiled_forward.py): a loop that passes no positions hands the graph its
    # mask, so the first step's graph holds the mask's length as a constant, the second is generic over it,
    # and no step after compiles another (tests/test_captured_decode.py: one graph where positions are passed)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert stats == eager_stats
    budget_rows = [10, 10] if name.startswith("h2o") else [10, 7]  # 0.5 of each row's prompt, rounded half up
    assert all(layer["retained_tokens"] <= max(budget_rows) for layer in stats["layers"])
    assert (eager - full_logits(model, STEPS)).abs().max() > 1e-3, "nothing was evicted"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["scissorhands", "ahakv", "h2o_averaged", "streaming_llm", "full", "keydiff", "knorm",
                                    "snapkv", "tova", "expected_attention", "kvzip"])
def test_shipped_recipes_compile_without_recompiles(recipe):
    model = build("llama")
    policy = el.load_recipe(recipe)
    if policy.budget is not None:  # 20% of a 13-token prompt cannot hold ahakv's RecentWindow(32)
        policy = policy.replace(budget=40)
    eager, _ = decode_logits(model, policy, compile=False, steps=100)
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = decode_logits(model, policy, compile=True, steps=100)
    # a bounded cache decodes through the whole forward's graph (a first one specialised on the step count,
    # then a generic one); a full cache grows between steps, and automatic dynamic shapes give its layers'
    # steps one more, shape-generic graph: never one per size
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


class BranchingCumulative(Cumulative):
    """A scorer that branches in Python on tensor data every step: not traceable into one graph."""

    def update(self, state, observation, view):
        if bool((observation.mass > 0.5).any()):
            state["score"] += observation.mass


def test_untraceable_component_names_itself():
    model = build("llama")
    policy = el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(BranchingCumulative()), budget=8)
    torch._dynamo.reset()
    with pytest.raises(CompileError, match=r"(?s)decode forward of LlamaForCausalLM .*BranchingCumulative"):
        decode_logits(model, policy, compile=True, steps=2)
