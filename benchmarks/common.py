"""What every benchmark family shares: settings, cases and rows, timing, the model under test.

A benchmark family is a module with ``NAME``, ``DEFAULT_REPEATS``, ``skip_reason(context)`` and
``cases(context)``. Each case measures one configuration at one set of parameters and returns a row;
the suite (``benchmarks.suite``) runs the cases, computes every ratio against the baseline row of the
same run and writes the results (``benchmarks.report``).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from evictlayers.compose.recipes import SHIPPED_RECIPES

RECIPES = SHIPPED_RECIPES
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# ``--model``: the name the suite takes -> the name ``evictlayers.models.load`` takes and what the results call it
MODELS = {
    "default": ("default", "SmolLM2-135M-Instruct"),
    "gemma-3-270m": ("gemma-3-270m", "Gemma 3 270M"),
}
DEFAULT_MODEL = "default"

# Rough throughput of the embedded model on one core of the 2-core machine it was calibrated on
# (1,024- and 2,048-token prefills, a 512-token decode), for the printed time estimate only.
FLOPS = 7.0e10  # fp32 matmuls of a prefill, per core
SCORED_ATTENTION = 1.3  # evictlayers' prefill attention with per-key mass (the C++ kernel): ~1.05-1.3x plain SDPA's
SCORED_LINEAR = 1.1  # and ~10% more per token for its bookkeeping
BYTES_PER_S = 5.0e9  # what a decode step reads and copies (a DynamicCache copies itself every step)
# one torch.compile (or recompile for a new shape) of one evictlayers decode step, or of the HF forward
# per decoder layer it holds
COMPILE_S = {"el": 10.0, "hf_per_layer": 3.0, "max_autotune": 300.0}


@dataclass(frozen=True)
class Settings:
    """The command line, parsed: ``repeats=None`` means each family's own default."""

    quick: bool = False
    repeats: int | None = None
    threads: int = 1
    compile: bool = True
    out: Path | None = None
    model: str = DEFAULT_MODEL  # a key of MODELS
    prompts: tuple[int, ...] | None = None  # ``--prompts``: decode/prefill prompt lengths instead of their own
    configs: tuple[str, ...] | None = None  # ``--configs``: run only these configurations
    # ``--interleave [CONFIG]``: the decode configuration each row's blocks alternate with (None: not interleaved)
    interleave: str | None = None

    def wants(self, config: str) -> bool:
        """Whether ``--configs`` (if given) lets configuration ``config`` run."""
        return self.configs is None or config in self.configs

    def repeats_for(self, default: int) -> int:
        """``--repeats`` if given, else 2 in ``--quick``, else the family's ``default``."""
        return self.repeats or (2 if self.quick else default)


@dataclass
class Case:
    """One measurement: ``run()`` returns its row; ``estimate_s`` feeds the printed time estimate."""

    benchmark: str
    config: str
    params: dict
    estimate_s: float
    run: Callable[[], dict]

    @property
    def label(self) -> str:
        return " ".join([self.benchmark, self.config, *(f"{k}={v}" for k, v in self.params.items())])


@dataclass
class Context:
    """Settings plus the model under test, loaded on first use (``overhead`` and ``kernel`` never need it)."""

    settings: Settings
    _subject: Subject | None = field(default=None, repr=False)

    @functools.cached_property
    def cores(self) -> float:
        """Free cores at planning time, for the estimate (``free_cores``)."""
        return free_cores(self.settings.threads)

    @property
    def subject(self) -> Subject:
        if self._subject is None:
            self._subject = load_subject(self.settings.quick, self.settings.model)
        return self._subject


# ---- rows --------------------------------------------------------------------------------------


def metric(samples: list[float], unit: str, baseline: str, higher_is_better: bool) -> dict:
    """A measured quantity: the median of its samples (one per repeat); the suite adds ``ratio``."""
    return {
        "value": statistics.median(samples),
        "samples": list(samples),
        "unit": unit,
        "higher_is_better": higher_is_better,
        "baseline": baseline,
    }


def row(config: str, params: dict, metrics: dict, info: dict | None = None) -> dict:
    """A finished measurement: ``metrics`` are ratioed against their baselines, ``info`` is context."""
    return {"config": config, "params": params, "status": "ok", "metrics": metrics, "info": info or {}}


def kernel_row(config: str, params: dict, seconds: list[float], moved: int, time_baseline: str,
               bandwidth_baseline: str, info: dict | None = None) -> dict:
    """A kernel measurement: ``time_us`` per call (lower is better, against ``time_baseline``) and
    ``gb_per_s``, the ``moved`` bytes per call over its time (against ``bandwidth_baseline``)."""
    return row(config, params, {
        "time_us": metric([s * 1e6 for s in seconds], "us", time_baseline, higher_is_better=False),
        "gb_per_s": metric([moved / s / 1e9 for s in seconds], "GB/s", bandwidth_baseline, higher_is_better=True),
    }, info)


def kernel_cases(benchmark: str, configs, slot_counts, batches, estimate_s: float, measure) -> list[Case]:
    """One case per (slot count, batch, configuration), in that order, each running ``measure(config, slots,
    batch)``."""
    return [
        Case(benchmark, config, {"slots": slots, "batch": batch}, estimate_s,
             lambda c=config, s=slots, b=batch: measure(c, s, b))
        for slots in slot_counts for batch in batches for config in configs
    ]


def skipped(config: str, params: dict, reason: str) -> dict:
    """A configuration that could not run here, and why."""
    return {"config": config, "params": params, "status": "skipped", "reason": reason, "metrics": {}, "info": {}}


# ---- timing ------------------------------------------------------------------------------------


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``call`` after one untimed call (first touch, thread start-up)."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def timed_blocks(
    step: Callable[[], None], warmup: int, steps: int, repeats: int, sync=None
) -> tuple[list[float], int]:
    """Seconds per step of ``repeats`` consecutive blocks of ``steps`` calls, after ``warmup`` calls
    (where compilation happens), and how many graphs torch.compile built while the clock ran (a
    measurement that includes a recompile is not a steady state: more warmup is needed). ``sync`` waits
    for queued device work (CUDA) before reading the clock."""
    from torch._dynamo.utils import counters

    sync = sync or (lambda: None)
    for _ in range(warmup):
        step()
    graphs = counters["stats"]["unique_graphs"]
    blocks = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        blocks.append((time.perf_counter() - start) / steps)
    return blocks, counters["stats"]["unique_graphs"] - graphs


# ---- the model under test ----------------------------------------------------------------------


@dataclass
class Subject:
    """The model under test and where its prompts come from."""

    name: str
    model: torch.nn.Module
    tokenizer: object | None  # None: the tiny random model, prompted with random ids

    @functools.cached_property
    def geometry(self) -> dict:
        """Layers, heads, head dim, KV element size and parameter bytes (tied weights counted once)."""
        config = self.model.config
        heads = config.num_attention_heads
        return {
            "layers": config.num_hidden_layers,
            "q_heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "kv_element_bytes": self.model.dtype.itemsize,
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "params": sum(p.numel() for p in self.model.parameters()),
        }

    @functools.cached_property
    def layer_windows(self) -> list[int | None]:
        """Per decoder layer, the sliding window it attends over (``None``: every token). A sliding
        layer's cache keeps at most ``window - 1`` tokens (transformers' and evictlayers' alike)."""
        config = self.model.config
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        return [window if kind == "sliding_attention" and window else None for kind in types]

    def kv_bytes(self, slots: int, batch: int = 1, spare: int = 0) -> int:
        """Key + value bytes of a cache holding ``slots`` tokens per head in every layer, a sliding layer at most
        ``window - 1``, and ``spare`` empty slots beside them: ``sum over layers of 2 * B * Hkv * (min(slots,
        window - 1) + spare) * D * bytes``."""
        g = self.geometry
        per_token = 2 * batch * g["kv_heads"] * g["head_dim"] * g["kv_element_bytes"]
        return sum(per_token * ((slots if window is None else min(slots, window - 1)) + spare)
                   for window in self.layer_windows)

    def kv_bytes_per_token(self, batch: int = 1) -> int:
        """Key + value bytes of one cached token over all layers: ``layers * 2 * B * Hkv * D * bytes``."""
        g = self.geometry
        return g["layers"] * 2 * batch * g["kv_heads"] * g["head_dim"] * g["kv_element_bytes"]

    def prompt(self, tokens: int) -> torch.Tensor:
        """``[1, tokens]`` prompt ids: PG-19 text for the real model, seeded random ids for the tiny one."""
        if self.tokenizer is None:
            generator = torch.Generator().manual_seed(tokens)
            return torch.randint(3, self.model.config.vocab_size, (1, tokens), generator=generator)
        from evictlayers.eval.tasks.documents import document_windows, read_texts

        window = document_windows(self.tokenizer, read_texts(), n_docs=1, doc_tokens=tokens)[0]
        return torch.tensor([window["input_ids"]])


def tiny_llama() -> torch.nn.Module:
    """A 2-layer random Llama with SmolLM2's GQA ratio (3 query heads per KV head), for ``--quick``; head dim
    32, so the int4 recipes' groups of 32 channels fit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


def tiny_gemma3() -> torch.nn.Module:
    """A 3-layer random Gemma 3 (two 32-token sliding-window layers, then a global one; 4 query heads
    per KV head as Gemma 3 270M), for ``--quick --model gemma-3-270m``: the quick prompts (64/128 tokens)
    are longer than its window, so sliding layers drop tokens as the real model's do past 512."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, sliding_window=32, max_position_embeddings=4096,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).float().eval()


TINY_MODELS = {"default": ("tiny-random-llama", tiny_llama), "gemma-3-270m": ("tiny-random-gemma3", tiny_gemma3)}


def load_subject(quick: bool, model: str = DEFAULT_MODEL) -> Subject:
    """The model under test: ``model`` a key of :data:`MODELS` (``default``: the embedded
    SmolLM2-135M-Instruct; ``gemma-3-270m``: Gemma 3 270M, offline through ``evictlayers.models.load``),
    with its tokenizer; with ``quick`` a tiny random model of the same family (no tokenizer)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; allowed are {sorted(MODELS)}")
    if quick:
        name, build = TINY_MODELS[model]
        return Subject(name, build(), None)
    from evictlayers.models import load

    load_name, name = MODELS[model]
    loaded, tokenizer = load(load_name)
    return Subject(name, loaded, tokenizer)


def recipe(name: str, budget: int | float | None = ..., **changes):
    """The shipped recipe ``<name>`` as a Policy, optionally with another budget and other recipe keys
    (``positions="rolling"``), everything else equal."""
    from evictlayers import load_recipe

    policy = load_recipe(RECIPES / f"{name}.yaml")
    if budget is not ...:
        changes = {"budget": budget, **changes}
    return policy.replace(**changes) if changes else policy


# ---- time estimate -----------------------------------------------------------------------------


def free_cores(threads: int) -> float:
    """Cores the run can count on: its threads, less what other processes keep busy (load average);
    on a shared machine two threads ran no faster than one."""
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1.0, min(threads, cpu_count() - busy))


def estimate_prefill_s(geometry: dict, tokens: int, scored: bool, cores: float) -> float:
    """Dense matmuls plus causal attention (2 matmuls over half the n x n pairs); ``scored``: evictlayers'
    prefill, which also computes every key's attention mass."""
    dense = 2 * geometry["params"] * tokens
    attention = geometry["layers"] * geometry["q_heads"] * geometry["head_dim"] * 2 * tokens * tokens
    if scored:
        return (dense * SCORED_LINEAR + attention * SCORED_ATTENTION) / (FLOPS * cores)
    return (dense + attention) / (FLOPS * cores)


def estimate_step_s(bytes_read: float) -> float:
    return bytes_read / BYTES_PER_S


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def cpu_count() -> int:
    """Cores this process may run on (the container's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
