"""``decode``: tokens/s of greedy decoding after a long PG-19 prompt, batch 1 and 8.

Configurations (baseline: the unmodified model on transformers' default path, SDPA attention):

- ``hf-eager``, ``hf-sdpa``: transformers' DynamicCache with its eager / SDPA attention;
- ``hf-static-compiled``: transformers' StaticCache with the forward compiled by
  ``model.get_compiled_call`` (what ``generate(cache_implementation="static")`` runs on GPUs; on a CPU
  generate only compiles with ``CompileConfig(_compile_all_devices=True)``, so the loop here calls it
  directly);
- ``el-full``, ``el-h2o``, ``el-h2o-int4`` (``evictlayers/recipes/full.yaml``, ``h2o.yaml`` at 20%,
  ``h2o_int4.yaml``: the same on int4 codes): evictlayers, eager and ``-compiled``
  (``evictlayers.apply(..., compile=True)``, the model's linear layers left to BLAS): the eviction comparison;
- ``el-full-compiled+cpu_linear``, ``el-h2o-compiled+cpu_linear``, ``el-h2o-int4-compiled+cpu_linear``: the same with
  ``evictlayers.apply(..., compile=True, cpu_linear=True)``, every weight product of a step in the C++ op
  ``evictlayers::few_rows_linear``, a speedup of the products that is not eviction's; ``vs_without_cpu_linear``
  is the row's tokens/s over the same configuration without the op. Skipped, with the reason, where the op
  cannot run (below the ``avx512`` instruction-set level, or where it cannot be built);
- only when ``--configs`` names them (each compiles for minutes): ``hf-static-max-autotune``, the static cache's
  compiled forward with inductor's ``max_autotune`` and the weights frozen into the graph (``freezing``),
  and ``el-full-max-autotune``, ``el-h2o-max-autotune``, ``el-h2o-int4-max-autotune``
  (``evictlayers.apply(..., compile="max-autotune")``, which does the same to its whole-model graph).

Each family (HF, full, h2o, h2o_int4) prefills once per prompt at batch 1; every configuration decodes from a
copy tiled to its batch. A measurement is ``warmup`` steps (compilation happens there), then
``repeats`` blocks of ``steps`` steps; the value is the median block's tokens/s over all rows.
Beside it:

- ``ideal_ratio``: the speedup that bytes read per step alone predict against the baseline,
  ``(W + KV_baseline) / (W + KV_config)``, ``W`` the parameter bytes and ``KV`` the key/value bytes the
  cache holds (all of which the step reads; codes, scales and zero points for int4);
- ``limit_tokens_per_s``: the physical limit, ``batch * bandwidth / (W + KV)``, with the bandwidth
  measured in the same run on the same threads (``read_bandwidth``), and ``of_limit``, the share of it
  the row reaches;
- ``weights_matmul_ms``: what the model's own weight products take for one step of the batch, measured in
  the same run on the same threads (``weights_matmul_seconds``: BLAS's products, also beside a ``+cpu_linear``
  row), and ``weights_matmul_share``, their share of the row's step: a floor under every configuration that
  the bytes alone do not show (at batch 8 on a CPU the products can be bound by the multiply-adds rather than
  by reading the weights);
- ``vs_fastest_hf``: tokens/s over the fastest transformers configuration of the same prompt and batch
  in the run (``hf-*`` rows), what a user would otherwise run at its best;
- with ``--interleave``, ``vs_hf_sdpa_beside``: the row's blocks alternate with blocks of ``hf-sdpa``
  decoding beside it from its own cache, and this is the median over those pairs of the row's tokens/s
  over the baseline's (``beside_range`` their range). Rows timed one after the other carry whatever the
  shared host did meanwhile; a pair's two blocks see the same host. ``--interleave CONFIG`` pairs every
  other row with ``CONFIG`` instead (``vs_<CONFIG>_beside``, e.g. ``vs_el_h2o_compiled_beside``: int4 H2O
  against the dense H2O it is meant to beat).
"""

from __future__ import annotations

import statistics
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import CompileConfig

from benchmarks.common import (
    COMPILE_S,
    Case,
    Context,
    estimate_prefill_s,
    estimate_step_s,
    median_seconds,
    metric,
    row,
    skipped,
    timed_blocks,
)
from benchmarks.cpu_linear import skip_reason as op_skip_reason
from benchmarks.loop import (
    DecodeLoop,
    Prefilled,
    PrefillMemo,
    attention_implementation,
    kv_resident_bytes,
    prefill_family,
    static_copy,
    tiled,
)

NAME = "decode"
USES_MODEL = True
BASELINE = "hf-sdpa"
DEFAULT_REPEATS = 3
EL_STEP_OVERHEAD_S = 1e-3  # per layer: the eager slot store's Python and small ops, for the estimate only


@dataclass(frozen=True)
class Plan:
    prompts: tuple[int, ...]
    batches: tuple[int, ...]
    warmup: int
    steps: int
    repeats: int

    @property
    def total(self) -> int:
        return self.warmup + self.steps * self.repeats


def make_plan(context: Context) -> Plan:
    """Sizes of the full suite, or tiny ones with ``--quick``; ``--prompts`` replaces the prompt lengths."""
    settings = context.settings
    repeats = settings.repeats_for(DEFAULT_REPEATS)
    if settings.quick:
        return Plan(prompts=settings.prompts or (64, 128), batches=(1, 8), warmup=2, steps=2, repeats=repeats)
    return Plan(prompts=settings.prompts or (4096, 8192), batches=(1, 8), warmup=3, steps=4, repeats=repeats)


# (config, family, compile: False, True or "max-autotune"); each family's first config is measured first for
# every prompt and batch
CONFIGS = [
    ("hf-sdpa", "hf", False),
    ("hf-eager", "hf", False),
    ("hf-static-compiled", "hf", True),
    ("hf-static-max-autotune", "hf", "max-autotune"),
    ("el-full", "full", False),
    ("el-full-compiled", "full", True),
    ("el-full-compiled+cpu_linear", "full", True),
    ("el-full-max-autotune", "full", "max-autotune"),
    ("el-h2o", "h2o", False),
    ("el-h2o-compiled", "h2o", True),
    ("el-h2o-compiled+cpu_linear", "h2o", True),
    ("el-h2o-max-autotune", "h2o", "max-autotune"),
    ("el-h2o-int4", "h2o_int4", False),
    ("el-h2o-int4-compiled", "h2o_int4", True),
    ("el-h2o-int4-compiled+cpu_linear", "h2o_int4", True),
    ("el-h2o-int4-max-autotune", "h2o_int4", "max-autotune"),
]
# the first compile of a max-autotune graph takes minutes (about six for SmolLM2's whole forward at 8k tokens,
# batch 8, on two cores): these run only when --configs names them
OPT_IN = {config for config, _, compile in CONFIGS if compile == "max-autotune"}
COMPILE = {config: compile for config, _, compile in CONFIGS}
# the configurations run with evictlayers.apply(cpu_linear=True), each with the one it is compared to (without the op)
CPU_LINEAR = {config: config.removesuffix("+cpu_linear") for config, _, _ in CONFIGS if config.endswith("+cpu_linear")}
FAMILY = {config: family for config, family, _ in CONFIGS}
# fraction of the prompt each family keeps (estimate only)
BUDGET = {"hf": 1.0, "full": 1.0, "h2o": 0.2, "h2o_int4": 0.2}


def skip_reason(context: Context) -> str | None:
    return None


def cpu_linear_unavailable(context: Context) -> str | None:
    """Why a ``+cpu_linear`` configuration cannot run here: the model is off the CPU, or the op cannot run (the
    ``cpu_linear`` benchmark's reason: no loops at this instruction-set level, or no build); ``None`` where it can."""
    model = context.subject.model
    if model.device.type != "cpu":
        return f"evictlayers.apply(cpu_linear=True) runs a CPU op; the model is on {model.device}"
    return op_skip_reason(context)


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s this process reads from memory on its current threads: the median of ``repeats`` sums of a
    ``megabytes`` float32 tensor (larger than any cache level, so every byte comes from DRAM)."""
    data = torch.ones(megabytes * 2**20 // 4)
    return data.nbytes / median_seconds(data.sum, repeats)


def weights_matmul_seconds(model: torch.nn.Module, rows: int, repeats: int = 5) -> float:
    """Seconds the model's weight products take for one token of ``rows`` sequences: every ``nn.Linear``
    (the output head included) applied to ``rows`` input rows, one weight after another as a step reads
    them (each from memory, the model being larger than the caches), the median of ``repeats`` passes."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
              for m in linears}

    def one_pass():
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight)

    with torch.inference_mode():
        return median_seconds(one_pass, repeats)


@contextmanager
def frozen(inner: AbstractContextManager):
    """``inner`` with inductor's ``freezing`` on (weights folded into the graph as constants): dynamo reads it
    from the global config when it traces, so it must be in force around the compiled call."""
    with inner, torch._inductor.config.patch(freezing=True):
        yield


@dataclass
class Side:
    """One configuration ready to decode: ``enter()`` the context its steps run in (the attention
    implementation, or ``evictlayers.apply``), its loop and its cache."""

    enter: Callable[[], AbstractContextManager]
    loop: DecodeLoop
    cache: object


def prepare(context: Context, config: str, source: Prefilled, batch: int, plan: Plan) -> Side:
    """The decode loop of ``config`` from a copy of ``source`` tiled to ``batch`` rows."""
    model = context.subject.model
    if config in ("hf-eager", "hf-sdpa"):
        enter, forward = lambda: attention_implementation(model, config.removeprefix("hf-")), model
        cache = tiled(source.cache, batch)
    elif config == "hf-static-compiled":
        enter = lambda: attention_implementation(model, "sdpa")  # noqa: E731
        forward = model.get_compiled_call(None)  # generate()'s compiled forward for a static cache
        cache = static_copy(model, source.cache, batch, source.prompt + plan.total)
    elif config == "hf-static-max-autotune":
        enter = lambda: frozen(attention_implementation(model, "sdpa"))  # noqa: E731
        # dynamo keeps graphs per code object: without the reset, hf-static-compiled's graph of the same
        # __call__ would serve this row where its guards pass
        torch._dynamo.reset()
        forward = model.get_compiled_call(CompileConfig(mode="max-autotune-no-cudagraphs"))
        cache = static_copy(model, source.cache, batch, source.prompt + plan.total)
    else:
        import evictlayers as el

        compile, cpu_linear = COMPILE[config], config in CPU_LINEAR
        enter, forward = lambda: el.apply(model, source.policy, compile=compile, cpu_linear=cpu_linear), model
        cache = tiled(source.cache, batch, keep=[source.policy])
        for layer in cache.layers:
            # the shared prefill ran eagerly (prefill always does); decode the copy as configured
            layer.store.compile = bool(compile)
    return Side(enter, DecodeLoop(model, forward, cache, source.token.expand(batch, 1), source.prompt, plan.total), cache)


def decode(context: Context, config: str, source: Prefilled, batch: int, plan: Plan):
    """Time the decode loop of one configuration; returns ``(seconds per step per block, graphs compiled
    while timed, cache)`` or a string saying why the configuration cannot run."""
    with torch.inference_mode(), ExitStack() as stack:
        side = prepare(context, config, source, batch, plan)
        try:
            stack.enter_context(side.enter())
        except TypeError as error:
            return f"evictlayers.apply(compile=...) is not available: {error}"
        return *timed_blocks(side.loop, plan.warmup, plan.steps, plan.repeats), side.cache


def decode_beside(context: Context, config: str, source: Prefilled, beside: str, baseline: Prefilled, batch: int,
                  plan: Plan):
    """``decode`` with each block of ``config`` followed by a block of ``beside`` from its own cache (each
    side warmed up first, each block inside its own context); returns ``(seconds per step per block,
    the other side's, graphs compiled while timed, cache)``."""
    with torch.inference_mode():
        mine = prepare(context, config, source, batch, plan)
        theirs = prepare(context, beside, baseline, batch, plan)
        compiles = 0
        for side in (mine, theirs):
            with side.enter():
                timed_blocks(side.loop, plan.warmup, 0, 0)
        ours, base = [], []
        for _ in range(plan.repeats):
            for side, blocks in ((mine, ours), (theirs, base)):
                with side.enter():
                    seconds, graphs = timed_blocks(side.loop, 0, plan.steps, 1)
                blocks += seconds
                compiles += graphs
        return ours, base, compiles, mine.cache


def cases(context: Context) -> list[Case]:
    settings, plan = context.settings, make_plan(context)
    beside = settings.interleave  # --interleave: the configuration every other row is timed beside
    memo = PrefillMemo(context)
    baselines: dict[int, Prefilled] = {}  # beside's prefill per prompt, for every other family
    baseline_bytes: dict[tuple[int, int], int] = {}
    fastest_hf: dict[tuple[int, int], float] = {}  # the hf family is measured first for every prompt
    bandwidth: list[float] = []  # measured once, at the first measurement (after the model is loaded)
    weights_matmul: dict[int, float] = {}  # per batch, measured at its first measurement
    medians: dict[tuple[str, int, int], float] = {}  # tokens/s per (config, prompt, batch): vs_without_cpu_linear
    out = []

    def measure(config: str, family: str, prompt: int, batch: int) -> dict:
        params = {"prompt": prompt, "batch": batch}
        if COMPILE[config] and not settings.compile:
            return skipped(config, params, "--no-compile")
        if CPU_LINEAR.keys() & {config, beside}:  # the row, or the one it is timed beside, asks for the op
            reason = cpu_linear_unavailable(context)
            if reason is not None:
                return skipped(config, params, reason)
        source = memo.get(family, prompt)
        pairs = None
        if beside and config != beside:
            if family != FAMILY[beside] and prompt not in baselines:
                baselines[prompt] = prefill_family(context, FAMILY[beside], prompt)
            baseline = source if family == FAMILY[beside] else baselines[prompt]
            seconds, base_seconds, timed_compiles, cache = decode_beside(context, config, source, beside, baseline,
                                                                         batch, plan)
            pairs = [b / s for s, b in zip(seconds, base_seconds)]  # tokens/s over the other side's, per pair
        else:
            result = decode(context, config, source, batch, plan)
            if isinstance(result, str):
                return skipped(config, params, result)
            seconds, timed_compiles, cache = result
        kv = kv_resident_bytes(cache)
        step_bytes = context.subject.geometry["weight_bytes"] + kv
        if config == BASELINE:
            baseline_bytes[(prompt, batch)] = step_bytes
        ideal = baseline_bytes[(prompt, batch)] / step_bytes if (prompt, batch) in baseline_bytes else None
        if not bandwidth:
            bandwidth.append(read_bandwidth())
        if batch not in weights_matmul:
            weights_matmul[batch] = weights_matmul_seconds(context.subject.model, batch)
        tokens_per_s = [batch / s for s in seconds]
        median = medians[(config, prompt, batch)] = statistics.median(tokens_per_s)
        limit = batch * bandwidth[0] / step_bytes
        if family == "hf":
            fastest_hf[(prompt, batch)] = max(fastest_hf.get((prompt, batch), 0.0), median)
        info = {
            "ideal_ratio": ideal, "kv_mib": kv / 2**20, "step_mib": step_bytes / 2**20,
            "limit_tokens_per_s": limit, "of_limit": median / limit,
            "vs_fastest_hf": median / fastest_hf[(prompt, batch)] if family != "hf" and (prompt, batch) in fastest_hf else None,
            "bandwidth_gb_s": bandwidth[0] / 1e9,
            "weights_matmul_ms": weights_matmul[batch] * 1e3,
            "weights_matmul_share": weights_matmul[batch] * median / batch,
        }
        if config in CPU_LINEAR:
            without = medians.get((CPU_LINEAR[config], prompt, batch))
            info["vs_without_cpu_linear"] = median / without if without is not None else None
        if pairs is not None:
            info[f"vs_{beside.replace('-', '_')}_beside"] = statistics.median(pairs)
            info["beside_range"] = f"{min(pairs):.2f}-{max(pairs):.2f}"
        if COMPILE[config]:
            info["timed_compiles"] = timed_compiles
        return row(config, params, {"tokens_per_s": metric(tokens_per_s, "tokens/s", BASELINE, True)}, info)

    for family in ("hf", "full", "h2o", "h2o_int4"):
        for prompt in plan.prompts:
            wanted = [(c, k) for c, f, k in CONFIGS  # --configs, and the opt-in ones only where it names them
                      if f == family and settings.wants(c) and (c not in OPT_IN or settings.configs is not None)]
            for index, (config, compiled) in enumerate(wanted):
                for batch in plan.batches:
                    first = index == 0 and batch == plan.batches[0]
                    out.append(Case(
                        NAME, config, {"prompt": prompt, "batch": batch},
                        estimate_case(context, plan, family, prompt, batch, compiled, prefills=first)
                        + (estimate_case(context, plan, FAMILY[beside], prompt, batch, COMPILE[beside],
                                         prefills=False)
                           if beside and config != beside else 0.0),
                        lambda c=config, f=family, p=prompt, b=batch: measure(c, f, p, b),
                    ))
    return out


def estimate_case(
    context: Context, plan: Plan, family: str, prompt: int, batch: int, compiled: bool | str, prefills: bool
) -> float:
    """Seconds: the family's prefill (first case of a prompt), compilation, and the decode steps."""
    settings, geometry = context.settings, context.subject.geometry
    if compiled and not settings.compile:
        return 0.0
    seconds = estimate_prefill_s(geometry, prompt, family != "hf", context.cores) if prefills else 0.0
    if compiled == "max-autotune":
        seconds += COMPILE_S["max_autotune"]
    elif compiled:
        seconds += COMPILE_S["hf_per_layer"] * geometry["layers"] if family == "hf" else COMPILE_S["el"]
    step_bytes = geometry["weight_bytes"] + context.subject.kv_bytes_per_token(batch) * prompt * BUDGET[family]
    step_s = estimate_step_s(step_bytes) + (EL_STEP_OVERHEAD_S * geometry["layers"] if family != "hf" else 0.0)
    return seconds + plan.total * step_s
