"""CrossLayer: every layer keeps the tokens the ranking layers' last query attends to most, checked against
the unmodified model's own attention weights and against transformers' cache holding just those tokens."""

import pytest
import torch
import transformers
from transformers import DynamicCache

import evictlayers as el
from evictlayers.compose.cross_layer import CrossLayerBoard
from tiny_models import FAMILIES, left_padded, single_thread  # noqa: F401

LAYERS = 4


def four_layer_llama():
    config = FAMILIES["llama"].config()
    config.num_hidden_layers = LAYERS
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().eval()


def reference_attention(model, ids, mask):
    """``[L]`` of ``[B, H_q, n]``: each layer's last-query attention in the unmodified model, per key column."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    return [weights[:, :, -1].double() for weights in out.attentions]


def top_positions(score: torch.Tensor, count: int, exclude: set[int]) -> set[int]:
    """The ``count`` positions of highest ``score`` ``[n]`` outside ``exclude`` (a full sort)."""
    order = [p for p in score.argsort(descending=True).tolist() if p not in exclude]
    return set(order[:count])


def held_by_layer(cache) -> list[list[set[int]]]:
    """Per layer, per (row, head) of row 0..B-1 flattened, the positions the store holds."""
    return [
        [set(p[p >= 0].tolist()) for p in layer.store.pos.flatten(0, 1)] for layer in cache.layers
    ]


def run_prompt(model, policy, ids, mask):
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    return cache


def test_every_layer_keeps_the_ranking_layers_top_tokens():
    """Sinks, then the budget's rest by the largest last-query attention any query head of layers 1 and 2
    gives a token (gqa_reduce='max': each KV head's group reduced by its max), in every layer and head."""
    model = four_layer_llama()
    lengths = [24, 19]
    ids, mask = left_padded(lengths)
    weights = reference_attention(model, ids, mask)
    policy = el.Policy(el.SinkTokens(2), el.HeavyHitterSelector(el.CrossLayer([1, -2])), budget=8, gqa_reduce="max")
    held = held_by_layer(run_prompt(model, policy, ids, mask))
    kv_heads = model.config.num_key_value_heads
    for row, length in enumerate(lengths):
        columns = slice(ids.shape[1] - length, None)  # left padding: position p is column width - length + p
        score = torch.maximum(weights[1][row, :, columns].amax(0), weights[2][row, :, columns].amax(0))
        expected = {0, 1} | top_positions(score, 6, {0, 1})
        for layer in range(LAYERS):
            for head in range(kv_heads):
                assert held[layer][row * kv_heads + head] == expected, (row, layer, head)


def test_decoding_from_the_kept_tokens_matches_transformers_cache_holding_only_them():
    """The next token's logits equal the unmodified model's over a DynamicCache sliced to the kept positions."""
    model = four_layer_llama()
    ids, mask = left_padded([22])
    policy = el.Policy(el.HeavyHitterSelector(el.CrossLayer([2])), budget=7, gqa_reduce="max")
    nxt = torch.tensor([[5]])
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        kept = cache.layers[0].store.pos[0, 0]
        kept = kept[kept >= 0].sort().values
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[0, -1]
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=reference, use_cache=True)
        for layer in reference.layers:
            layer.keys, layer.values = layer.keys[:, :, kept], layer.values[:, :, kept]
        expected = model(
            input_ids=nxt, past_key_values=reference, position_ids=torch.tensor([[ids.shape[1]]]),
            cache_position=torch.tensor([len(kept)]),
        ).logits[0, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_a_share_beside_each_layers_own_selection():
    """Half the unprotected slots by the ranking layer, the other half by the layer's own last query (TOVA,
    layer scope: the mean over KV heads of each group's max), among the tokens the first half left."""
    model = four_layer_llama()
    ids, mask = left_padded([26])
    weights = reference_attention(model, ids, mask)
    policy = el.Policy(
        el.SinkTokens(2),
        el.HeavyHitterSelector(el.CrossLayer([2]), refine=[el.LayerScope()], share=0.5),
        el.HeavyHitterSelector(el.Windowed(rows=1), refine=[el.LayerScope()], share=0.5),
        budget=10, gqa_reduce="max",
    )
    held = held_by_layer(run_prompt(model, policy, ids, mask))
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    shared = top_positions(weights[2][0].amax(0), 4, {0, 1})
    for layer in range(LAYERS):
        own = weights[layer][0].unflatten(0, (-1, group)).amax(1).mean(0)
        expected = {0, 1} | shared | top_positions(own, 4, {0, 1} | shared)
        assert all(h == expected for h in held[layer]), layer


def test_layers_before_the_ranking_layer_hold_the_whole_prompt_until_it_has_run():
    model = four_layer_llama()
    ids, mask = left_padded([20])
    policy = el.Policy(el.HeavyHitterSelector(el.CrossLayer([2])), budget=5)
    seen = {}
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()

        def before_layer_2(module, args):
            seen["held"] = [int(cache.layers[i].store.retained().max()) for i in (0, 1)]

        handle = model.model.layers[2].register_forward_pre_hook(before_layer_2)
        try:
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        finally:
            handle.remove()
    assert seen["held"] == [20, 20]
    assert [layer["retained_tokens"] for layer in cache.stats()["layers"]] == [5] * LAYERS


def test_a_chunked_prefill_ranks_again_at_each_chunk():
    """Each multi-token step re-ranks: after the second chunk every layer holds the same positions, sinks
    included, and generation goes on."""
    model = four_layer_llama()
    ids, _ = left_padded([30])
    policy = el.Policy(el.SinkTokens(1), el.HeavyHitterSelector(el.CrossLayer([1])), budget=6)
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        model(input_ids=ids[:, :18], past_key_values=cache, use_cache=True)
        first = held_by_layer(cache)
        model(input_ids=ids[:, 18:], past_key_values=cache, use_cache=True)
        second = held_by_layer(cache)
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    for held in (first, second):
        every = [h for layer in held for h in layer]
        assert all(h == every[0] for h in every) and len(every[0]) == 6 and 0 in every[0]
    assert any(p >= 18 for p in second[0][0])


@pytest.mark.parametrize("layers", [[], [1, 1], ["1"], [True], "2"])
def test_bad_ranking_layers_are_refused(layers):
    with pytest.raises(ValueError, match="CrossLayer\\(layers="):
        el.CrossLayer(layers)


def test_a_ranking_layer_outside_the_model_is_refused_when_the_cache_is_made():
    policy = el.Policy(el.HeavyHitterSelector(el.CrossLayer([1, 4])), budget=5)
    with pytest.raises(ValueError, match=r"\[4\] not a layer of a 4-layer model \(allowed: -4..3\)"):
        el.EvictionCache(policy, num_layers=LAYERS)
    policy = el.Policy(el.HeavyHitterSelector(el.CrossLayer([1, -3])), budget=5)
    with pytest.raises(ValueError, match="names a layer twice"):
        el.EvictionCache(policy, num_layers=LAYERS)


def test_a_store_without_the_shared_board_says_how_to_get_one():
    policy = el.Policy(el.HeavyHitterSelector(el.CrossLayer([0])), budget=3)
    store = el.SlotStore(policy)
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="CrossLayerBoard"):
        store.step(q, torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), scaling=0.5)


def test_a_ranking_layer_whose_policy_reads_no_query_row_is_refused():
    with pytest.raises(ValueError, match="layer 1 is a CrossLayer ranking layer"):
        el.SlotStore(el.Policy(el.RecentWindow(), budget=4), layer_idx=1, num_layers=3, board=CrossLayerBoard((1,)))


def test_each_layer_policy_answers_for_its_own_selectors():
    """Only the sliding-window layers rank by other layers here: the full-attention layers never wait."""
    policy = el.Policy(
        el.HeavyHitterSelector(el.Windowed(rows=1)), budget=5,
        sliding_modules=[el.HeavyHitterSelector(el.CrossLayer([1]))],
    )
    assert policy.cross_layer is None and policy.sliding.cross_layer == el.CrossLayer([1])
    assert el.EvictionCache(policy, num_layers=LAYERS).layers[0].store.board.layers == {1}


def test_the_sliding_layers_must_rank_by_the_same_layers():
    with pytest.raises(ValueError, match="different ranking layers"):
        el.Policy(
            el.HeavyHitterSelector(el.CrossLayer([2])), budget=5,
            sliding_modules=[el.HeavyHitterSelector(el.CrossLayer([1]))],
        )


def test_the_recipe_round_trips(tmp_path):
    policy = el.Policy(
        el.SinkTokens(4),
        el.HeavyHitterSelector(el.CrossLayer([-9, -8]), refine=[el.ChunkScores(5), el.LayerScope()], share=0.75),
        el.HeavyHitterSelector(el.Windowed(rows=1), refine=[el.ChunkScores(5), el.LayerScope()], share=0.25),
        budget=0.2,
    )
    path = tmp_path / "cross.yaml"
    el.dump_recipe(policy, path)
    assert el.load_recipe(path) == policy


def test_generated_tokens_outrank_the_prompt_tokens():
    """While generating, each step gives up the lowest-ranked prompt token, never a generated one: after 3
    steps a budget of 8 holds the sink, the ranking layer's top 4 prompt tokens and the 3 generated tokens."""
    model = four_layer_llama()
    ids, mask = left_padded([20])
    weights = reference_attention(model, ids, mask)
    policy = el.Policy(el.SinkTokens(1), el.HeavyHitterSelector(el.CrossLayer([2])), budget=8, gqa_reduce="max")
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for token in (7, 8, 9):
            model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    expected = {0} | top_positions(weights[2][0].amax(0), 4, {0}) | {20, 21, 22}
    assert all(h == expected for layer in held_by_layer(cache) for h in layer)


def test_a_ranking_layer_that_holds_recurrent_state_is_refused():
    """Jamba's layers 0 and 2 are Mamba layers: their cache holds no keys to rank by."""
    from architecture_sweep import tiny_model

    model = tiny_model("jamba")
    policy = el.Policy(el.HeavyHitterSelector(el.CrossLayer([0])), budget=5)
    with el.apply(model, policy) as run, pytest.raises(ValueError, match=r"layers \[0\] of this model hold recurrent"):
        run.new_cache()
    policy = el.Policy(el.SinkTokens(1), el.HeavyHitterSelector(el.CrossLayer([3])), budget=5)
    ids, mask = left_padded([12])
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert [layer["retained_tokens"] for layer in cache.stats()["layers"]] == [0, 5, 0, 5]
