"""A long prompt in chunks holds bounded memory (slow: SmolLM2-135M, an 8,192-token PG-19 prompt, on CPU).

Fed through ``run.prefill(..., chunk=1024)`` with a float budget, every layer holds at most its budget per head
after each chunk (``budget + chunk`` while a chunk attends), the budget is the fraction of the whole prompt, the
prompt ends with what one forward of it leaves, and the process's peak RSS grows less than for that one forward
(each measured in a process of its own, after the model is loaded).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from evictlayers.eval.tasks import documents

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not documents.default_data_dir().is_dir(), reason="shared/data/pg19-sample not present"),
]

TOKENS, CHUNK, BUDGET = 8192, 1024, 0.1

MEASURE = textwrap.dedent('''
    import json, resource, sys, torch
    import evictlayers as el
    from evictlayers.eval.tasks import documents
    from evictlayers.models import load_default

    chunk = int(sys.argv[1])
    model, tokenizer = load_default()
    text = " ".join(body for _, body in documents.read_texts())
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :{tokens}]
    policy = el.load_recipe("h2o").replace(budget={budget})
    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = []
    with torch.no_grad(), el.apply(model, policy) as run:
        cache = run.new_cache(prompt_len=ids.shape[1])
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start:start + chunk], past_key_values=cache)
            held.append([int((layer.store.pos >= 0).sum(-1).max()) for layer in cache.layers])
        budget = int(cache.layers[0].store.budget[0])
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({{"held": held, "budget": budget, "peak_growth_mib": grown}}))
''').format(tokens=TOKENS, budget=BUDGET)


def measured(chunk: int) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(chunk)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_chunked_prompt_holds_its_budget_at_every_chunk_and_peaks_below_one_forward():
    one_shot, chunked = measured(TOKENS), measured(CHUNK)
    assert chunked["budget"] == one_shot["budget"] == round(BUDGET * TOKENS)
    assert len(chunked["held"]) == TOKENS // CHUNK
    assert all(max(layers) <= chunked["budget"] for layers in chunked["held"])
    assert chunked["held"][-1] == one_shot["held"][-1]
    print(f"peak RSS growth: one forward {one_shot['peak_growth_mib']:.0f} MiB, chunks of {CHUNK} "
          f"{chunked['peak_growth_mib']:.0f} MiB")
    assert chunked["peak_growth_mib"] < one_shot["peak_growth_mib"]
