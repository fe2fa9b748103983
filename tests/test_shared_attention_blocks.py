"""One attention module serving several cache layers: Zamba's block shared by its hybrid layers (told its
cache layer at each call) and Dory's looped section (each later pass writes to copies of the section's cache
layers, appended to the cache). The attention function attends over the cache layer the call's update staged.

References: the unmodified model (``conformance``: logits and greedy tokens of a left-padded batch with nothing
evicted) and, under an H2O budget, every cache layer holding at most its budget and having seen every token
of its row (a call that attended over another layer's cache would leave one layer short and another over)."""

from __future__ import annotations

import pytest
import torch

import evictlayers as el
from evictlayers.hf.support import model_support

from architecture_sweep import BUDGET, LENGTHS, NEW_TOKENS, conformance, tiny_model
from tiny_models import greedy, left_padded


@pytest.mark.parametrize("model_type", ["zamba", "zamba2", "dory"])
def test_a_module_serving_several_cache_layers_matches_the_unmodified_model(model_type):
    assert conformance(model_type, el).status == "works"


@pytest.mark.parametrize("model_type", ["zamba", "zamba2"])
def test_a_shared_block_is_patched_once_and_every_layer_it_serves_holds_its_own_tokens(model_type):
    model = tiny_model(model_type)
    support = model_support(model)
    blocks = support.shared_blocks
    assert blocks and len(support.modules) == len({id(m) for m in support.modules})
    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=BUDGET)
    ids, mask = left_padded(LENGTHS)
    with el.apply(model, policy) as run:
        assert all(type(block).__name__.startswith("Evicting") for block in blocks)
        greedy(model, ids, mask, NEW_TOKENS)
        stats = run.stats()
    assert all(type(block).__name__ == getattr(block, "_evictlayers_original_class", type(block)).__name__
               for block in blocks), "the block's class is restored"
    served = [layer.index for layer in support.attention]
    assert len(served) >= (2 if model_type == "zamba" else 1)  # the tiny Zamba 2 has one hybrid layer
    for index in served:
        layer = stats["layers"][index]
        assert layer["retained_tokens"] <= BUDGET and layer["seen_tokens"] == max(LENGTHS) + NEW_TOKENS - 1


def test_induction_on_a_shared_block_is_refused():
    model = tiny_model("zamba")
    with pytest.raises(ValueError, match="one attention block serves several"):
        el.apply(model, el.Policy(budget=BUDGET, allocation=el.Induction()))
    assert getattr(model, "_evictlayers_run", None) is None


def test_a_loop_that_reads_the_cache_without_writing_it_is_refused():
    # Dory's `last_loop` mode: the earlier passes attend over the last pass's cached keys plus their own, and
    # hand nothing to the cache, so the keys they attend over are not ones evictlayers holds
    model = tiny_model("dory", recurrent_kv_cache_mode="last_loop")
    ids, mask = left_padded(LENGTHS)
    reference = model(input_ids=ids, attention_mask=mask).logits
    with pytest.raises(el.UnsupportedModelError, match="without handing its new keys to the cache"):
        with el.apply(model, el.Policy(budget=None)):
            model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, reference, rtol=0, atol=0)
