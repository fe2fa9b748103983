"""evictlayers on a model sharded by transformers' tensor parallelism, two CPU processes under ``torchrun``.

``from_pretrained(..., tp_plan="auto")`` splits each attention layer's query and K/V heads over the ranks (gloo
on CPU), so each rank's cache holds its own KV heads and evicts among them; nothing evictlayers does crosses
heads. The reference: the unmodified sharded model for a full cache, and the same policy on the unsharded model
in this process for an evicting one (eviction per head does not depend on where the head lives).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evictlayers as el
from tiny_models import build
from tensor_parallel_worker import BUDGET, decoded

WORLD = 2
WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], torch.nn.Module]:
    """Each rank's results, and the unsharded model they were loaded from."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    model = build("llama")
    model.save_pretrained(root / "checkpoint")
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               str(WORKER), str(root / "checkpoint"), str(root)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(WORLD)], model


def test_a_full_cache_decodes_as_the_unmodified_sharded_model(ranks):
    results, _ = ranks
    for result in results:
        assert result["world"] == WORLD
        assert result["full"]["tokens"] == result["unmodified"]["tokens"]
        torch.testing.assert_close(torch.tensor(result["full"]["logits"]), torch.tensor(result["unmodified"]["logits"]),
                                   rtol=1e-4, atol=1e-4)


def test_each_rank_evicts_among_its_own_heads_within_budget(ranks):
    results, model = ranks
    local_heads = model.config.num_key_value_heads // WORLD
    for result in results:
        for layer in result["h2o"]["layers"]:
            assert layer["heads"] == local_heads
            assert all(held <= BUDGET for held in layer["held"])
    # every rank ran the same sequence: the ranks agree on each step's token
    assert results[0]["h2o"]["tokens"] == results[1]["h2o"]["tokens"]


def test_sharded_eviction_gives_the_unsharded_models_tokens(ranks):
    results, model = ranks
    h2o = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=BUDGET, min_budget=1)
    unsharded = decoded(model.eval(), h2o)
    assert results[0]["h2o"]["tokens"] == unsharded["tokens"]
    torch.testing.assert_close(torch.tensor(results[0]["h2o"]["logits"]), torch.tensor(unsharded["logits"]),
                               rtol=1e-4, atol=1e-4)
