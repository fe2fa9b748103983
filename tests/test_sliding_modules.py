"""``Policy(sliding_modules=...)``: a model's sliding-window layers run modules of their own, every other
setting shared. Checked on a tiny Gemma 2 whose first layer attends to everything and whose second slides:
the first layer sees the same inputs as under the plain policy, so it must keep exactly what the plain
policy keeps there; the second must keep what its own modules say (a recent window: the newest ``budget``
positions, a formula). The recipe key round-trips and its mistakes are reported like ``modules``'."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import FAMILIES, PAD, left_padded, single_thread  # noqa: F401 (autouse fixture)

import evictlayers as el
from evictlayers.compose.recipes import RecipeError, policy_from_dict, policy_to_dict

BUDGET = 6


def full_then_sliding() -> transformers.PreTrainedModel:
    """Tiny Gemma 2 with a full-attention layer first and a sliding-window one second, its window (64) wider
    than the test's 24 tokens, so that the window itself decides nothing."""
    config = FAMILIES["gemma2"].config()
    config.layer_types = ["full_attention", "sliding_attention"]
    config.sliding_window = 64
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).float().eval()
    model.generation_config.pad_token_id = PAD
    return model


def h2o(**changes) -> el.Policy:
    return el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.Cumulative()), budget=BUDGET, **changes)


def held_positions(model, policy, compile: bool = False) -> tuple[list, list]:
    """Each layer's held positions ``[B, H, N]`` (sorted per head) after a 20-token prompt and 4 decode steps, and
    the policy each layer ran."""
    with torch.no_grad(), el.apply(model, policy, compile=compile) as run:
        cache = run.new_cache()
        ids, mask = left_padded([20, 20])
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for token in (3, 4, 5, 6):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            model(input_ids=torch.full((2, 1), token), attention_mask=mask, past_key_values=cache, use_cache=True)
        held = [layer.store.pos.sort(-1).values for layer in cache.layers]
        return held, [layer.store.policy for layer in cache.layers]


def test_the_sliding_window_layer_runs_its_own_modules_and_the_other_the_policys():
    model = full_then_sliding()
    policy = h2o(sliding_modules=[el.RecentWindow()])
    (full, sliding), (full_policy, sliding_policy) = held_positions(model, policy)
    assert full_policy is policy and sliding_policy is policy.sliding
    assert sliding_policy.budget == BUDGET and sliding_policy.allocation == policy.allocation
    # 24 tokens seen (positions 0-23): a recent window keeps the newest 6 in every head
    newest = torch.arange(24 - BUDGET, 24).expand_as(sliding[..., -BUDGET:])
    assert torch.equal(sliding[..., -BUDGET:], newest) and (sliding[..., :-BUDGET] < 0).all()
    # the full-attention layer comes first, so its inputs and what it keeps are the plain policy's
    (plain_full, plain_sliding), _ = held_positions(model, h2o())
    assert torch.equal(full, plain_full)
    assert not torch.equal(sliding, plain_sliding)  # H2O's heavy hitters are not all among the newest
    # the compiled decode step (one graph per policy) keeps the same
    compiled, _ = held_positions(model, policy, compile=True)
    assert all(torch.equal(a, b) for a, b in zip(compiled, (full, sliding), strict=True))


def test_a_model_without_sliding_window_layers_never_uses_them():
    from tiny_models import build

    model = build("llama")
    policy = h2o(sliding_modules=[el.RecentWindow()])
    got, policies = held_positions(model, policy)
    want, _ = held_positions(model, h2o())
    assert all(p is policy for p in policies)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_recipe_key_round_trips_and_is_left_out_when_not_given():
    recipe = {
        "budget": 0.2,
        "modules": [{"_component_": "SinkTokens", "count": 4}, {"_component_": "RecentWindow", "size": 0.5},
                    {"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Windowed", "rows": 1}}],
        "allocation": {"_component_": "ByLayerKind", "sliding": 0.25},
        "sliding_modules": [{"_component_": "RecentWindow", "size": 0.5},
                            {"_component_": "HeavyHitterSelector", "accumulator": {"_component_": "Cumulative"}}],
    }
    policy = policy_from_dict(recipe)
    assert policy_from_dict(policy_to_dict(policy)) == policy
    dumped = policy_to_dict(policy)["sliding_modules"]
    assert [node["_component_"] for node in dumped] == ["RecentWindow", "HeavyHitterSelector"]
    assert dumped[0]["size"] == 0.5 and dumped[1]["accumulator"] == {"_component_": "Cumulative"}
    assert policy.sliding.allocation == policy.allocation and policy.sliding.budget == 0.2
    without = policy_from_dict({key: value for key, value in recipe.items() if key != "sliding_modules"})
    assert "sliding_modules" not in policy_to_dict(without) and without != policy and without.sliding is None
    assert policy.replace(budget=0.5).sliding.budget == 0.5


@pytest.mark.parametrize(
    "sliding_modules,message",
    [
        (3, "sliding_modules: expected a list of components"),
        ([{"_component_": "Nope"}], r"sliding_modules\[0\]._component_: unknown component 'Nope'"),
        ([{"_component_": "RecentWindow", "size": 2}, {"_component_": "RecentWindow", "size": 3}],
         r"policy: Policy\(sliding_modules=...\): Policy has 2 RecentWindow modules"),
    ],
    ids=["not-a-list", "unknown-component", "invalid-policy"],
)
def test_mistakes_in_the_key_are_reported_with_where_they_are(sliding_modules, message):
    with pytest.raises(RecipeError, match=message):
        policy_from_dict({"budget": 8, "modules": [{"_component_": "RecentWindow"}],
                          "sliding_modules": sliding_modules})
