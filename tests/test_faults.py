"""A failure inside a policy component: the error names the layer and the component, and
leaving ``el.apply`` restores the model whatever happened inside."""

import pytest
import torch

import evictlayers as el
from tiny_models import build, left_padded, single_thread  # noqa: F401


class BrokenAfter(el.Cumulative):
    """A scorer whose state goes bad at the 4th update (as a component bug would)."""

    calls = 0

    def update(self, state, observation, view):
        BrokenAfter.calls += 1
        if BrokenAfter.calls == 4:
            raise IndexError("slot 99 is out of range")
        super().update(state, observation, view)


def _greedy(model):
    ids, mask = left_padded([12])
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)


def test_component_error_names_layer_and_component_and_the_model_is_restored():
    model = build("llama")
    want = _greedy(model)
    attention_classes = [type(layer.self_attn) for layer in model.model.layers]
    BrokenAfter.calls = 0
    policy = el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(BrokenAfter()), budget=6)
    with pytest.raises(el.PolicyError, match=r"layer 1: BrokenAfter\(\) failed \(IndexError: slot 99 is out of range\); policy: Policy\(") as caught:
        with el.apply(model, policy):
            _greedy(model)
    assert isinstance(caught.value.__cause__, IndexError)
    assert [type(layer.self_attn) for layer in model.model.layers] == attention_classes
    assert torch.equal(_greedy(model), want)  # unpatched: the unmodified model's output again


def test_configuration_errors_keep_their_type_and_name_the_layer():
    model = build("llama")
    policy = el.Policy(el.RecentWindow(4), el.HeavyHitterSelector(el.Cumulative()), budget=0.1, min_budget=1)  # 1 of 12
    with pytest.raises(ValueError, match="cannot hold the protected slots") as caught:
        with el.apply(model, policy):
            _greedy(model)
    assert any(note.startswith("(in layer 0") for note in caught.value.__notes__)
