"""``el.apply`` on a model dispatched by accelerate (``device_map`` with layers offloaded to disk).

accelerate wraps each module's forward in a hook that loads offloaded weights just in time; the
patched attention and the slot stores must work under those hooks, with each store allocated where its
layer's keys are computed. On a CPU-only machine the offloaded layers exercise the hooks (weights on
the meta device until their forward); the reference is the same model undispatched.
"""

import pytest
import torch

import evictlayers as el
from tiny_models import build, left_padded, single_thread  # noqa: F401

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    model = build("llama")
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for index in range(model.config.num_hidden_layers):
        device_map[f"model.layers.{index}"] = "disk" if index % 2 else "cpu"
    model = accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path_factory.mktemp("offload")))
    assert hasattr(model.model.layers[1], "_hf_hook")
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    return model


def test_dispatched_model_with_nothing_evicted_equals_the_plain_model(dispatched):
    reference = build("llama")
    ids, mask = left_padded([20, 13])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        with el.apply(dispatched, el.Policy(budget=None)) as run:
            got = dispatched(input_ids=ids, attention_mask=mask, past_key_values=run.new_cache(), use_cache=True).logits
        real = mask.bool()  # padding positions' logits are arbitrary
        torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)
        want_tokens = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        with el.apply(dispatched, el.Policy(budget=None)):
            tokens = dispatched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, want_tokens)


def test_dispatched_model_evicts_and_is_restored(dispatched):
    ids, mask = left_padded([20, 13])
    attention_class = type(dispatched.model.layers[1].self_attn)
    with torch.no_grad(), el.apply(dispatched, el.Policy(el.RecentWindow(2), el.HeavyHitterSelector(el.Cumulative()), budget=6)) as run:
        dispatched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        stats = run.stats()
    assert all(layer["retained_tokens"] <= 6 for layer in stats["layers"])
    assert type(dispatched.model.layers[1].self_attn) is attention_class
    assert hasattr(dispatched.model.layers[1], "_hf_hook")  # accelerate's hooks survive the restore
