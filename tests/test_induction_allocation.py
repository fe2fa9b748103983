"""The Induction allocation: its weights against the formula, and the probe ``apply`` runs against the
unmodified model's own attention weights (RazorAttention's repeated random tokens)."""

import pytest
import torch

import evictlayers as el
from evictlayers.hf import induction
from tiny_models import build, left_padded, single_thread  # noqa: F401


def test_weights_follow_floor_plus_score_over_the_largest():
    """Scores 0, 0.5, 1, 0 and floor 0.5: raw weights 0.5, 1, 1.5, 0.5 (sum 3.5), rescaled to mean 1, so a
    budget of 100 per layer is ideally 57.14, 114.29, 171.43, 57.14; the one token left after flooring
    goes to the largest remainder (layer 2)."""
    allocation = el.Induction(0.5, scores=[0.0, 0.5, 1.0, 0.0])
    expected = torch.tensor([0.5, 1.0, 1.5, 0.5], dtype=torch.float64) * 4 / 3.5
    assert torch.allclose(allocation.weights(4), expected)
    assert allocation.layer_budgets(torch.tensor([100]), 4)[:, 0].tolist() == [57, 114, 172, 57]
    # no layer with an induction head: every layer alike
    assert el.Induction(0.5, scores=[0.0] * 3).layer_budgets(torch.tensor([30]), 3)[:, 0].tolist() == [30] * 3


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: el.Induction(0), r"floor must be a number > 0"),
        (lambda: el.Induction(True), r"floor must be a number > 0"),
        (lambda: el.Induction(0.5, scores=[0.1, -0.2]), r"scores must be a non-empty list of numbers >= 0"),
        (lambda: el.Induction(0.5, scores=[]), r"scores must be a non-empty list"),
        (lambda: el.Induction(0.5, scores="high"), r"scores must be a non-empty list"),
        (lambda: el.Induction(0.5).weights(4), r"no induction scores yet; evictlayers.apply measures them"),
        (lambda: el.Induction(0.5, scores=[1.0, 0.0]).weights(3), r"2 scores for a model of 3 layers"),
    ],
    ids=["zero-floor", "bool-floor", "negative-score", "no-scores", "string-scores", "unbound", "wrong-length"],
)
def test_bad_induction_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_recipe_round_trip_keeps_pinned_scores(tmp_path):
    policy = el.Policy(el.RecentWindow(), budget=0.2, allocation=el.Induction(0.25, scores=[0.0, 0.9]))
    path = tmp_path / "recipe.yaml"
    el.dump_recipe(policy, path)
    assert el.load_recipe(path) == policy


def _reference_scores(name: str) -> list[float]:
    """Per layer, the largest over heads of the attention the second copy's token at ``T + i`` pays to key
    ``i + 1``, averaged over ``i`` in ``[0, T - 1)`` and the sequences, from the unmodified model's
    ``output_attentions`` (eager), for the probe the docstring describes."""
    model = build(name, attn_implementation="eager")
    vocab = model.config.vocab_size
    length = induction.PROBE_LENGTH
    generator = torch.Generator().manual_seed(induction.PROBE_SEED)
    first = torch.randint(vocab // 8, vocab // 2, (induction.PROBE_SEQUENCES, length), generator=generator)
    with torch.no_grad():
        attentions = model(input_ids=torch.cat([first, first], 1), output_attentions=True).attentions
    scores = []
    for weights in attentions:  # [B, H, 2T, 2T]
        per_head = torch.stack([weights[:, :, length + i, i + 1] for i in range(length - 1)], dim=-1)
        scores.append(float(per_head.double().mean(dim=(0, 2)).max()))
    return scores


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_apply_measures_the_scores_and_splits_the_budget_by_them(name):
    """``apply`` on an sdpa model: the scores match the eager reference, the user's policy is untouched, the
    model's attention implementation comes back, and each layer holds the budget the formula gives."""
    expected = _reference_scores(name)
    model = build(name, attn_implementation="sdpa") if name == "llama" else build(name)
    implementation = model.config._attn_implementation
    policy = el.Policy(el.RecentWindow(), budget=6, allocation=el.Induction(0.5))
    with torch.no_grad(), el.apply(model, policy) as run:
        scores = run.policy.allocation.scores
        assert scores == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert policy.allocation.scores is None
        cache = run.new_cache()
        ids, mask = left_padded([20, 20])
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        held = [layer["retained_tokens"] for layer in cache.stats()["layers"]]
    budgets = el.Induction(0.5, scores=expected).layer_budgets(torch.tensor([6]), len(expected))[:, 0]
    windows = [getattr(model.config, "sliding_window", None) if kind == "sliding_attention" else None
               for kind in getattr(model.config, "layer_types", ["full_attention"] * len(expected))]
    # a sliding-window layer holds at most window - 1 tokens (SlotStore caps it)
    assert held == [min(b, w - 1) if w else b for b, w in zip(budgets.tolist(), windows)]
    assert model.config._attn_implementation == implementation
    if name == "gemma2":
        # the probe's copies lie 127 tokens apart, beyond the sliding layer's window: nothing to retrieve there
        assert [s for s, w in zip(scores, windows) if w] == [0.0] * sum(1 for w in windows if w)


def test_scores_are_measured_once_per_model_and_again_after_an_in_place_change(monkeypatch):
    model = build("llama", attn_implementation="sdpa")
    calls = []
    measure = induction._measure
    monkeypatch.setattr(induction, "_measure", lambda *args: calls.append(1) or measure(*args))
    policy = el.Policy(el.RecentWindow(), budget=6, allocation=el.Induction(0.5))
    for _ in range(2):
        with el.apply(model, policy):
            pass
    assert len(calls) == 1
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    with el.apply(model, policy):
        pass
    assert len(calls) == 2


def test_a_model_built_under_inference_mode_is_measured():
    """Inference tensors keep no version counter: the scores are still measured (and match a model built
    normally from the same seed)."""
    with torch.inference_mode():
        model = build("llama", attn_implementation="sdpa")
        policy = el.Policy(el.RecentWindow(), budget=6, allocation=el.Induction(0.5))
        with el.apply(model, policy) as run:
            scores = run.policy.allocation.scores
    assert scores == pytest.approx(_reference_scores("llama"), rel=1e-5, abs=1e-7)


def test_a_layer_without_attention_weights_is_refused_and_the_model_restored():
    """A layer whose output carries no attention weights under eager attention (here a user's hook drops
    them) cannot be probed: ``apply`` names the layer and the way out, and the attention implementation,
    the hooks and the classes are as before."""
    model = build("llama", attn_implementation="sdpa")
    attention = model.model.layers[1].self_attn
    attention.register_forward_hook(lambda module, args, output: (output[0], None))
    hooks = {id(m): len(m._forward_hooks) for m in model.modules()}
    classes = [type(m) for m in model.modules()]
    with pytest.raises(el.UnsupportedModelError, match=r"layer 1\).*Induction\(scores=\[\.\.\.\]\)"):
        el.apply(model, el.Policy(el.RecentWindow(), budget=6, allocation=el.Induction(0.5)))
    assert model.config._attn_implementation == attention.config._attn_implementation == "sdpa"
    assert {id(m): len(m._forward_hooks) for m in model.modules()} == hooks
    assert [type(m) for m in model.modules()] == classes
    assert not hasattr(model, "_evictlayers_run")
