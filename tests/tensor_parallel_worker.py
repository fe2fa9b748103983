"""One rank of ``tests/test_tensor_parallel.py``, run under ``torchrun``: a checkpoint loaded with transformers'
tensor parallelism (``tp_plan="auto"``: each rank holds a slice of the attention heads, K/V heads included),
decoded greedily with and without evictlayers. Writes ``rank<r>.json`` into the directory given, with each run's
new tokens, last-step logits and every layer's slot-store shape and held tokens per head.

    torchrun --nproc-per-node 2 tests/tensor_parallel_worker.py CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import evictlayers as el

PROMPT, NEW_TOKENS, BUDGET = 40, 8, 10


def load_sharded(checkpoint: str):
    """The checkpoint with transformers' own tensor-parallel plan over every rank (gloo on CPU)."""
    config = getattr(transformers, "DistributedConfig", None)
    if config is not None and "tp_plan" in inspect.signature(config).parameters:
        options = {"distributed_config": config(tp_plan="auto")}
    else:
        options = {"tp_plan": "auto"}
    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager", **options
    )


def decoded(model, policy: el.Policy | None) -> dict:
    ids = (torch.arange(PROMPT)[None] * 7 + 3) % model.config.vocab_size
    with torch.no_grad():
        if policy is None:
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            layers = []
        else:
            with el.apply(model, policy) as run:
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
                layers = [
                    {"heads": layer.store.pos.shape[1], "held": (layer.store.pos >= 0).sum(-1).flatten().tolist()}
                    for layer in run.cache.layers
                ]
    return {"tokens": out.sequences[0, PROMPT:].tolist(), "logits": out.logits[-1][0].tolist(), "layers": layers}


def main(checkpoint: str, out_dir: str) -> None:
    model = load_sharded(checkpoint)
    h2o = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=BUDGET, min_budget=1)
    result = {
        "world": dist.get_world_size(),
        "unmodified": decoded(model, None),
        "full": decoded(model, el.Policy()),
        "h2o": decoded(model, h2o),
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
