"""Soak (slow): 20,000 decode steps of a tiny model under eviction. Memory stays flat after
warm-up, no logit is NaN, and every layer holds at most its budget throughout."""

from __future__ import annotations

import pytest
import torch

import evictlayers as el
from tiny_models import build, single_thread  # noqa: F401

STEPS, CHECK_EVERY, BUDGET = 20_000, 1_000, 24


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["h2o", "tova_keydiff"])
def test_twenty_thousand_steps_flat_memory_no_nan_within_budget(recipe):
    model = build("llama")
    policy = el.load_recipe(recipe)
    policy = el.Policy(*policy.modules_in_order, budget=BUDGET)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    generator = torch.Generator().manual_seed(1)
    rss = []
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache()
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for step in range(1, STEPS + 1):
            # sample, so the sequence does not settle into a loop that keeps the cache content fixed
            token = torch.multinomial(out.logits[:, -1].softmax(-1), 1, generator=generator)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            if step % CHECK_EVERY == 0:
                assert torch.isfinite(out.logits).all(), f"NaN/inf logits at step {step}"
                layers = run.stats()["layers"]
                assert all(layer["retained_tokens"] <= BUDGET for layer in layers), (step, layers)
                assert all(layer["seen_tokens"] == 40 + step for layer in layers)
                rss.append(_rss_mib())
    after_warmup = rss[2:]  # the first checks include allocator and dispatcher warm-up
    # the 2-D mask grows by 16 bytes a step (320 KB over the run); the cache must not grow at all
    assert max(after_warmup) - min(after_warmup) < 16, f"RSS drifted: {after_warmup}"
