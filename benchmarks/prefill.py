"""``prefill``: seconds and peak resident memory of one batch-1 prefill of a long PG-19 prompt.

``hf-sdpa`` (baseline) is the unmodified model with SDPA attention; ``el-h2o`` runs the same prompt
under ``evictlayers/recipes/h2o.yaml`` (20%), whose prefill also computes every key's attention mass and
keeps 20% of the tokens; ``el-ahakv`` scores the prompt by its last 32 rows under AhaKV's SG-softmax;
``el-streaming_llm`` (no scorer) and ``el-keydiff`` (keys only) read no attention rows at all. The last three
read no summed mass, so every other row goes through the fused flash pass (plus KeyDiff's cosines).
All compute the last position's logits only, as ``generate()``.

Every measurement runs in a fresh process (forked from a fork server that has imported torch,
transformers and evictlayers, so a process costs no import time): it loads the model, builds the
prompt, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``) and records the resident set
as the baseline, prefills, and reports ``VmHWM - baseline``: the extra memory the prefill needed at
its peak, the cache it leaves behind included. Where the counter cannot be reset the peak of the
whole process after model load is used (``info.hwm_reset`` is false then).
"""

from __future__ import annotations

import gc
import multiprocessing
import re
import time
from pathlib import Path

import torch

from benchmarks.common import Case, Context, estimate_prefill_s, load_subject, metric, recipe, row

NAME = "prefill"
USES_MODEL = True
BASELINE = "hf-sdpa"
DEFAULT_REPEATS = 1  # a 16k prefill takes minutes on 2 cores; --repeats N runs N processes per config
CONFIGS = ("hf-sdpa", "el-h2o", "el-ahakv", "el-streaming_llm", "el-keydiff")
SCORED = ("el-h2o",)  # the configurations whose prefill computes every key's attention mass
LOAD_S = 5.0  # loading the model in a fresh process, for the estimate only


def prompts(quick: bool, chosen: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """``chosen`` (``--prompts``), else the suite's own lengths."""
    return chosen or ((192, 256) if quick else (8192, 16384))  # quick: long enough for ahakv's 32-token window at 20%


def skip_reason(context: Context) -> str | None:
    return None


def _status_kib(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    found = re.search(rf"^{field}:\s+(\d+)\s+kB", status.read_text(), re.MULTILINE)
    return int(found.group(1)) if found else None


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); ``False`` where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure_in_child(quick: bool, threads: int, config: str, tokens: int, model: str) -> dict:
    """Runs in the fresh process: ``{'seconds', 'peak_mib', 'hwm_reset'}`` of one prefill of ``model``."""
    torch.set_num_threads(threads)
    subject = load_subject(quick, model)
    model, ids = subject.model, subject.prompt(tokens)
    mask = torch.ones_like(ids)
    if config.startswith("el-"):
        import evictlayers as el

        el.apply(model, recipe(config.removeprefix("el-")))  # stays applied: the process ends after this prefill
    else:
        model.set_attn_implementation("sdpa")
    gc.collect()
    hwm_reset = _reset_peak()
    before = _status_kib("VmRSS")
    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    peak_mib = (peak - before) / 1024 if peak is not None and before is not None else None
    return {"seconds": seconds, "peak_mib": peak_mib, "hwm_reset": hwm_reset}


_POOL_CONTEXT = None


def fresh_process_context():
    """A fork-server multiprocessing context that has imported this module (and with it torch,
    transformers and evictlayers) once; every worker it starts is a new process."""
    global _POOL_CONTEXT
    if _POOL_CONTEXT is None:
        _POOL_CONTEXT = multiprocessing.get_context("forkserver")
        _POOL_CONTEXT.set_forkserver_preload([__name__, "evictlayers", "transformers"])
    return _POOL_CONTEXT


def run_fresh(quick: bool, threads: int, config: str, tokens: int, model: str) -> dict:
    with fresh_process_context().Pool(processes=1, maxtasksperchild=1) as pool:
        return pool.apply(measure_in_child, (quick, threads, config, tokens, model))


def cases(context: Context) -> list[Case]:
    settings = context.settings
    repeats = settings.repeats_for(DEFAULT_REPEATS)

    def measure(config: str, tokens: int) -> dict:
        results = [run_fresh(settings.quick, settings.threads, config, tokens, settings.model) for _ in range(repeats)]
        metrics = {"seconds": metric([r["seconds"] for r in results], "s", BASELINE, higher_is_better=False)}
        if all(r["peak_mib"] is not None for r in results):
            metrics["peak_rss_mib"] = metric([r["peak_mib"] for r in results], "MiB", BASELINE, False)
        return row(config, {"prompt": tokens}, metrics, {"hwm_reset": all(r["hwm_reset"] for r in results)})

    out = []
    for tokens in prompts(settings.quick, settings.prompts):
        for config in CONFIGS:
            prefill_s = estimate_prefill_s(context.subject.geometry, tokens, config in SCORED, context.cores)
            estimate = repeats * (LOAD_S + prefill_s)
            out.append(Case(NAME, config, {"prompt": tokens}, estimate, lambda c=config, t=tokens: measure(c, t)))
    return out
