"""``gpu_decode`` (CUDA; a tiny shape on CPU with ``--quick``): end-to-end greedy decoding of Llama-shaped
models, evictlayers against transformers at its best.

Random-weight Llamas built from ``LlamaConfig`` straight on the GPU in bfloat16 (nothing downloaded): the 1B
shape (Llama 3.2 1B: 16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads of 64, vocab 128,256, tied
embeddings) and the 8B shape (Llama 3.1 8B: 32 layers, hidden 4096, MLP 14336, 32 / 8 heads of 128). Each
row prefills random token ids in one forward, then runs one-token forwards as ``generate()`` does
(``prepare_inputs_for_generation``, the 2-D attention mask one column longer each step, explicit position
ids, the argmax fed back): ``WARMUP`` untimed steps, where compilation and CUDA-graph recording happen, then
``STEPS`` timed ones, each between two CUDA events, with one synchronisation before the block and one after.

Configurations (each row builds its own cache and compiles from scratch: ``torch._dynamo.reset()`` first):

- ``hf-sdpa`` (baseline): unmodified transformers, SDPA, its default ``DynamicCache``;
- ``hf-static-compiled``: transformers' fastest path, what ``generate(cache_implementation="static")`` runs
  on a GPU: a ``StaticCache`` sized once for the prompt and every step, the prefill eager, each step through
  ``model.get_compiled_call(None)`` (``torch.compile`` of the model's ``__call__`` with ``CompileConfig()``:
  inductor, ``mode="reduce-overhead"``, i.e. CUDA graphs);
- ``el-<recipe>`` and ``el-<recipe>-compiled`` for ``full``, ``h2o``, ``streaming_llm`` and
  ``tova_keydiff_chunked`` (the shipped recipes, 20% of the prompt for the evicting ones):
  ``evictlayers.apply(model, policy, compile=False / True)``;
- ``el-h2o-chunked``: a long prompt (131,072 tokens, batch 1, 1B shape) through ``h2o`` with an int budget of
  8,192 tokens, fed in chunks of 4,096 as ``generate(prefill_chunk_size=4096)`` does (the 2-D mask sliced to
  the chunk's end): the prefill time, its peak memory and the cache it leaves. Where the first 65,536 tokens
  take more than their share of a 40 s limit (``Chunked.limit_s``) it stops there and says so.

The plan runs the most important rows first (1B, 8k x 8), and skips, with the reason, a row that its
estimate says would end past ``TIME_BUDGET_S`` (compile estimates follow the compiles measured so far).
``--prompts`` replaces the decode sizes by the 1B shape at those prompt lengths (batch ``65536 // prompt``,
1 to 8, every configuration), ``--configs`` picks configurations, ``--repeats`` the timed steps.
The results go to ``<machine>-e2e.json`` / ``.md`` (``suite.py``), written after every row.
"""

from __future__ import annotations

import gc
import inspect
import os
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch

from benchmarks.common import Case, Context, metric, recipe, row, skipped
from benchmarks.loop import kv_resident_bytes
from benchmarks.report import fmt, ratio_text

NAME = "gpu_decode"
USES_MODEL = False  # it builds its own Llamas (SHAPES), not the suite's model under test
RESULTS_SUFFIX = "e2e"  # suite.py writes this family to <machine>-e2e.json/.md, beside the kernel results
BASELINE = "hf-sdpa"
RECIPES = ("full", "h2o", "streaming_llm", "tova_keydiff_chunked")
# configuration -> (cache family, compiled): "hf" the DynamicCache, "hf-static" the StaticCache, else a recipe
CONFIGS = {
    "hf-sdpa": ("hf", False),
    "hf-static-compiled": ("hf-static", True),
    **{f"el-{name}{suffix}": (name, suffix != "") for name in RECIPES for suffix in ("", "-compiled")},
}
CHUNKED = "el-h2o-chunked"

MODEL_NAMES = {"1B": "Llama 1B", "8B": "Llama 8B", "tiny": "tiny Llama"}
SHAPES = {
    "1B": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8B": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # --quick: the same code paths in seconds on a CPU
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Size:
    """Decode rows of one model shape, prompt length and batch."""

    shape: str
    prompt: int
    batch: int
    configs: tuple[str, ...]


@dataclass(frozen=True)
class Chunked:
    """The chunked long-prompt row: ``fallback`` tokens instead of ``prompt`` when the first ``fallback`` took
    more than their share of ``limit_s`` (``None``: no limit)."""

    shape: str
    prompt: int
    chunk: int
    budget: int  # tokens per head: an int, which chunking resolves without the prompt's length
    fallback: int | None
    limit_s: float | None


# within a size the cheap rows first, then the comparison that matters most, so a row the time budget drops is
# the least informative one
PLAN = (
    Size("1B", 8192, 8, tuple(CONFIGS)),
    Size("1B", 32768, 4, ("hf-sdpa", "el-h2o-compiled", "hf-static-compiled", "el-full-compiled")),
    Size("1B", 4096, 1, ("hf-sdpa", "el-h2o", "el-h2o-compiled", "hf-static-compiled")),
    Size("8B", 4096, 1, ("hf-sdpa", "el-h2o-compiled", "hf-static-compiled", "el-full-compiled")),
)
CHUNKED_PLAN = Chunked("1B", 131072, 4096, 8192, fallback=65536, limit_s=40.0)
QUICK_PLAN = (Size("tiny", 96, 2, tuple(CONFIGS)),)
QUICK_CHUNKED = Chunked("tiny", 512, 64, 96, fallback=None, limit_s=None)
WARMUP, STEPS = 3, 20
QUICK_WARMUP, QUICK_STEPS = 2, 3
PROMPTS_TOKENS = 65536  # --prompts: batch = this // prompt (1 to 8), the tokens the 8k x 8 rows hold
PREFILL_WARMUP_TOKENS = 512  # the untimed prefill before each timed one
# the family's rows on one H100, model builds and compiles included (5 minutes in all with the start-up)
TIME_BUDGET_S = float(os.environ.get("EVICTLAYERS_GPU_DECODE_BUDGET_S", 270))
COPY_BYTES, COPY_REPEATS = 2**30, 20  # the bandwidth measurement: many times any GPU's L2

# Estimates, for the printed total and the time budget only: a first compile when none has been measured yet
# (then the longest measured at the shape, or 1.5x the longest at another), building a model, what an H100
# sustains, and the Python cost per layer of an eager step.
COMPILE_GUESS_S = {"1B": 40.0, "8B": 70.0, "tiny": 10.0}
BUILD_GUESS_S = {"1B": 5.0, "8B": 15.0, "tiny": 1.0}  # a random model created on the device
FLOP_RATE, BYTE_RATE = 2e14, 2e12
STEP_OVERHEAD_S = {"hf": 3e-4, "el": 2e-3}


def skip_reason(context: Context) -> str | None:
    if torch.cuda.is_available() or context.settings.quick:
        return None
    return "needs CUDA (this machine has none); --quick runs it at a tiny shape on CPU"


def plan(settings) -> tuple[tuple[Size, ...], Chunked]:
    """The decode sizes and the chunked row: ``PLAN``, the 1B shape at ``--prompts``, or the tiny shape with
    ``--quick``."""
    every = tuple(CONFIGS)
    if settings.quick:
        return tuple(Size("tiny", p, 2, every) for p in settings.prompts or ()) or QUICK_PLAN, QUICK_CHUNKED
    if settings.prompts:
        return tuple(Size("1B", p, max(1, min(8, PROMPTS_TOKENS // p)), every) for p in settings.prompts), CHUNKED_PLAN
    return PLAN, CHUNKED_PLAN


def cases(context: Context) -> list[Case]:
    bench = Bench(context)
    sizes, chunked = plan(context.settings)
    out = []
    for index, size in enumerate(sizes):
        for config in size.configs:
            out.append(bench.case(config, size.shape, size.prompt, size.batch,
                                  partial(bench.decode_estimate_s, config, size), partial(bench.decode_row, config, size),
                                  out))
        if index == 0:  # the chunked row is cheap and shares the first size's model: right after its rows
            out.append(bench.case(CHUNKED, chunked.shape, chunked.prompt, 1, partial(bench.chunked_estimate_s, chunked),
                                  partial(bench.chunked_row, chunked), out))
    return out


# ---- the model --------------------------------------------------------------------------------


def build_llama(shape: str, device: torch.device) -> torch.nn.Module:
    """A random-weight Llama of ``shape`` (a key of ``SHAPES``) created on ``device`` (bfloat16 on a GPU; float32
    on a CPU, where bfloat16 matmuls are slow and the tiny model only checks the code paths), SDPA attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # the weights are created where they live: 16 GB never pass through the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def llama_params(shape: str) -> int:
    """Parameters of ``shape`` from its config (tied embeddings counted once), for estimates before it is built."""
    s = SHAPES[shape]
    hidden, heads, kv_heads, dim = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    layer = hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden + 3 * hidden * s["intermediate_size"]
    embeddings = s["vocab_size"] * hidden * (1 if s["tie_word_embeddings"] else 2)
    return s["num_hidden_layers"] * (layer + 2 * hidden) + hidden + embeddings


def kv_bytes_per_token(shape: str, element_bytes: int = 2) -> int:
    """Key + value bytes of one token over every layer of ``shape``."""
    s = SHAPES[shape]
    return s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * element_bytes


def prompt_ids(model, tokens: int, batch: int) -> torch.Tensor:
    """``[batch, tokens]`` seeded random ids on the model's device."""
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, model.config.vocab_size, (batch, tokens), generator=generator)
    return ids.to(model.device)


def forward_inputs(model, ids: torch.Tensor, cache, mask: torch.Tensor, start: int) -> dict:
    """What ``generate()`` hands the model's forward for ``ids`` at positions ``start, start + 1, ...``: built by
    ``prepare_inputs_for_generation``, where a ``StaticCache`` gets its fixed-size 4-D mask, outside the compiled
    forward. Only the last position's logits, as ``generate()`` asks."""
    # transformers 5.24 renames the cache argument to ``cache``
    keyword = "cache" if "cache" in inspect.signature(model.prepare_inputs_for_generation).parameters \
        else "past_key_values"
    batch, length = ids.shape
    positions = torch.arange(start, start + length, device=ids.device).expand(batch, length).contiguous()
    return model.prepare_inputs_for_generation(ids, **{keyword: cache}, attention_mask=mask, position_ids=positions,
                                               use_cache=True, logits_to_keep=1)


class Decoder:
    """One call = one greedy step of every row through ``forward`` (the model, or its compiled call).

    The mask has a column more than the last step reads: a view of all its columns would be contiguous where
    every earlier one is not, which a compiled forward guards on (``loop.DecodeLoop``)."""

    def __init__(self, model, forward, cache, token: torch.Tensor, seen: int, steps: int):
        self.model, self.forward, self.cache, self.token, self.seen = model, forward, cache, token, seen
        self.mask = torch.ones(token.shape[0], seen + steps + 1, dtype=torch.long, device=token.device)

    def __call__(self) -> None:
        inputs = forward_inputs(self.model, self.token, self.cache, self.mask[:, : self.seen + 1], self.seen)
        self.seen += 1
        self.token = self.forward(**inputs).logits[:, -1].argmax(-1, keepdim=True)


# ---- clocks and counters ----------------------------------------------------------------------


class Clock:
    """Wall-clock and per-step timing on the model's device (CUDA events on a GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wall(self, call):
        """``(seconds, result)`` of ``call()``, the device's queued work included."""
        self.sync()
        start = time.perf_counter()
        result = call()
        self.sync()
        return time.perf_counter() - start, result

    def steps(self, step, count: int) -> tuple[list[float], float]:
        """Seconds of each of ``count`` consecutive ``step()`` calls, and of the whole block. On a GPU each step
        lies between two CUDA events (recording one does not wait), with one synchronisation before the block and
        one after; on a CPU the wall clock between calls."""
        self.sync()
        if self.cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
            start = time.perf_counter()
            events[0].record()
            for event in events[1:]:
                step()
                event.record()
            self.sync()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])], time.perf_counter() - start
        marks = [time.perf_counter()]
        for _ in range(count):
            step()
            marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])], marks[-1] - marks[0]


def copy_bandwidth(device: torch.device, clock: Clock) -> float:
    """Bytes/s of a large copy on ``device``, read + written counted: what a memory-bound step can hope for."""
    size = COPY_BYTES if device.type == "cuda" else COPY_BYTES // 16
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)

    def copies():
        for _ in range(COPY_REPEATS):
            target.copy_(source)

    seconds, _ = clock.wall(copies)
    return 2 * size * COPY_REPEATS / seconds


def compile_counters(device: torch.device) -> dict:
    """Dynamo's and inductor's counts so far: compiled frames, graphs, graph breaks, recompiles (guard failures
    since the last ``torch._dynamo.reset()``), CUDA-graph skips, and the CUDA graphs the trees hold."""
    from torch._dynamo.utils import counters

    failures = getattr(torch._dynamo.utils, "guard_failures", {})
    return {
        "frames": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(len(reasons) for reasons in failures.values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraphs": recorded_cudagraphs(device),
    }


def recorded_cudagraphs(device: torch.device) -> int | None:
    """CUDA graphs recorded by inductor's CUDA-graph trees on ``device`` (0 on a CPU; ``None`` where this torch
    does not say)."""
    if device.type != "cuda":
        return 0
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(device.index or 0, create_if_none_exists=False)
        if manager is None:
            return 0
        count, nodes = 0, list(manager.get_roots())
        while nodes:
            node = nodes.pop()
            count += 1
            nodes += [child for children in node.children.values() for child in children]
        return count
    except Exception:  # noqa: BLE001 - private API: a diagnostic, never worth failing the row for
        return None


def quantile(samples: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``samples`` (linear between order statistics)."""
    ordered = sorted(samples)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ---- the rows ---------------------------------------------------------------------------------


class Bench:
    """What the rows share: the model of the current shape (one resident at a time), the device, the clock,
    the copy bandwidth (measured at the first row), and the run's time budget."""

    def __init__(self, context: Context):
        self.settings = context.settings
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.clock = Clock(self.device)
        quick = self.settings.quick
        self.warmup = QUICK_WARMUP if quick else WARMUP
        self.steps = self.settings.repeats or (QUICK_STEPS if quick else STEPS)
        self.budget_s = None if quick else TIME_BUDGET_S
        self.started: float | None = None
        self.shape: str | None = None
        self.model: torch.nn.Module | None = None
        self.bandwidth: float | None = None
        self.compile_s: dict[str, list[float]] = {}  # measured first compiled steps per shape

    def model_of(self, shape: str) -> torch.nn.Module:
        if shape != self.shape:
            self.model = self.shape = None  # free the previous shape's weights (and graphs holding them) first
            self.fresh()
            self.model, self.shape = build_llama(shape, self.device), shape
        return self.model

    def fresh(self) -> int:
        """Start a row clean: no graphs or CUDA-graph pools of earlier rows (so each compiled row compiles its
        own static shapes, as a new process would, and earlier pools do not count in its peak), memory freed, the
        peak counter reset. Returns the bytes allocated now: the weights."""
        torch._dynamo.reset()
        gc.collect()
        if self.device.type != "cuda":
            return 0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_mib(self, weights: int) -> float | None:
        """Peak memory allocated since ``fresh()`` above the weights, MiB (CUDA only)."""
        return (torch.cuda.max_memory_allocated() - weights) / 2**20 if self.device.type == "cuda" else None

    def case(self, config: str, shape: str, prompt: int, batch: int, estimate, measure, before: list[Case]) -> Case:
        """The case of one row after the cases ``before``: ``measure(params)`` behind the time budget
        (``guarded``); ``estimate()`` its seconds, plus building the model where it is the first of its shape, asked
        again when it is due (compiles measured by then make it better)."""
        params = {"layers": SHAPES[shape]["num_hidden_layers"], "prompt": prompt, "batch": batch}
        builds = not before or before[-1].params["layers"] != params["layers"]

        def due_estimate() -> float:
            return estimate() + (BUILD_GUESS_S[shape] if shape != self.shape else 0.0)

        return Case(NAME, config, params, estimate() + (BUILD_GUESS_S[shape] if builds else 0.0),
                    lambda: self.guarded(config, params, due_estimate, lambda: measure(params)))

    def guarded(self, config: str, params: dict, estimate, measure) -> dict:
        """``measure()``'s row, unless the run's time budget would end before it (then a skipped row saying so);
        prints the row's wall time either way."""
        now = time.perf_counter()
        self.started = self.started or now
        spent = now - self.started
        if self.budget_s is not None and spent + estimate() > self.budget_s:
            return skipped(config, params, f"the {self.budget_s:.0f} s time budget: {spent:.0f} s spent, this row "
                           f"is estimated at {estimate():.0f} s (run it alone with --configs {config})")
        try:
            return measure()
        finally:
            print(f"{NAME} {config} {params}: {time.perf_counter() - now:.1f} s "
                  f"(run {time.perf_counter() - self.started:.0f} s)", flush=True)

    # ---- estimates (printed total, time budget) ----

    def compile_guess_s(self, shape: str) -> float:
        if self.compile_s.get(shape):
            return max(self.compile_s[shape])
        measured = [s for seconds in self.compile_s.values() for s in seconds]
        return 1.5 * max(measured) if measured else COMPILE_GUESS_S[shape]

    def prefill_estimate_s(self, shape: str, tokens: int, batch: int) -> float:
        s = SHAPES[shape]
        attention = 4 * s["num_hidden_layers"] * s["num_attention_heads"] * s["head_dim"] * tokens * tokens * batch
        return (2 * llama_params(shape) * tokens * batch + attention) / FLOP_RATE

    def decode_estimate_s(self, config: str, size: Size) -> float:
        family, compiled = CONFIGS[config]
        if compiled and not self.settings.compile:
            return 0.0
        kept = 1.0 if family in ("hf", "hf-static", "full") else 0.2
        step_bytes = 2 * llama_params(size.shape) + kv_bytes_per_token(size.shape) * size.prompt * size.batch * kept
        overhead = 0.0 if compiled else STEP_OVERHEAD_S["hf" if family == "hf" else "el"]
        step = step_bytes / BYTE_RATE + overhead * SHAPES[size.shape]["num_hidden_layers"]
        return (self.prefill_estimate_s(size.shape, size.prompt, size.batch)
                + (self.warmup + self.steps) * step + (self.compile_guess_s(size.shape) if compiled else 0.0))

    def chunked_estimate_s(self, chunked: Chunked) -> float:
        # each chunk attends over the budget, itself, and scores every key (the mass), about 3x a plain chunk
        return 3 * chunked.prompt // chunked.chunk * self.prefill_estimate_s(chunked.shape, chunked.chunk, 1)

    # ---- measurements ----

    def decode_row(self, config: str, size: Size, params: dict) -> dict:
        """One configuration: prefill, ``warmup`` steps, ``steps`` timed steps; the row with its diagnostics."""
        import evictlayers as el
        from transformers import DynamicCache, StaticCache

        family, compiled = CONFIGS[config]
        if compiled and not self.settings.compile:
            return skipped(config, params, "--no-compile")
        started = time.perf_counter()
        model = self.model_of(size.shape)
        if self.bandwidth is None:
            self.bandwidth = copy_bandwidth(self.device, self.clock)
        weights = self.fresh()
        ids = prompt_ids(model, size.prompt, size.batch)
        before = compile_counters(self.device)
        with torch.no_grad(), ExitStack() as stack:  # no_grad, as generate() runs
            run = None
            if family == "hf":
                new_cache, forward = (lambda tokens: DynamicCache(config=model.config)), model
            elif family == "hf-static":
                new_cache = lambda tokens: StaticCache(config=model.config, max_cache_len=tokens)  # noqa: E731
                forward = model.get_compiled_call(None)  # generate()'s per-step call for a static cache on a GPU
            else:
                run = stack.enter_context(el.apply(model, recipe(family), compile=compiled))
                new_cache, forward = (lambda tokens: run.new_cache()), model
            # a short prefill first, so the timed one runs no kernel's first launch or JIT compile (evictlayers'
            # Triton kernels, cuBLAS's set-up), which would say nothing about the prefill itself
            short = ids[:1, :PREFILL_WARMUP_TOKENS]
            model(**forward_inputs(model, short, new_cache(short.shape[1]), torch.ones_like(short), 0))
            cache, mask = new_cache(size.prompt + self.warmup + self.steps + 1), torch.ones_like(ids)
            prefill_s, out = self.clock.wall(lambda: model(**forward_inputs(model, ids, cache, mask, 0)))
            step = Decoder(model, forward, cache, out.logits[:, -1].argmax(-1, keepdim=True), size.prompt,
                           self.warmup + self.steps)
            del out
            warmup_s = [self.clock.wall(step)[0] for _ in range(self.warmup)]
            warm = compile_counters(self.device)
            step_s, block_s = self.clock.steps(step, self.steps)
            after = compile_counters(self.device)
            kv = run.stats()["kv_bytes"] if run is not None else kv_resident_bytes(cache)
            # evictlayers' compiled forward counts the one-token steps its whole-model graph ran and those that
            # fell back to the model's own forward (read if this version keeps the counts)
            steps_through = {name: getattr(model.forward, name, None) for name in ("graph_steps", "eager_steps")}
        peak = self.peak_mib(weights)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied ones once
        median_s = statistics.median(step_s)
        info = {
            "model": MODEL_NAMES[size.shape],
            "p10_ms": quantile(step_s, 0.1) * 1e3, "p90_ms": quantile(step_s, 0.9) * 1e3,
            "block_ms": block_s / self.steps * 1e3,
            "compile_s": warmup_s[0] if compiled else None,
            "warmup_s": [round(s, 4) for s in warmup_s],
            "kv_mib": kv / 2**20,
            "peak_mib": peak,
            "weights_mib": weight_bytes / 2**20,
            "bandwidth_gb_s": self.bandwidth / 1e9,
            # every weight and every held key/value byte is read once per step (a StaticCache's whole buffer: its
            # masked attention reads every slot)
            "of_bandwidth": (weight_bytes + kv) / self.bandwidth / median_s,
        }
        if compiled:
            info.update({name: after[name] - before[name] for name in ("frames", "graphs", "graph_breaks",
                                                                         "cudagraph_skips")})
            info.update(recompiles=after["recompiles"], timed_graphs=after["graphs"] - warm["graphs"],
                        cudagraphs=after["cudagraphs"])
            if run is not None:
                info.update(steps_through)
            self.compile_s.setdefault(size.shape, []).append(sum(warmup_s))  # compiling, recording CUDA graphs
        info["row_s"] = time.perf_counter() - started
        return row(config, params, {
            "ms_per_step": metric([s * 1e3 for s in step_s], "ms", BASELINE, higher_is_better=False),
            "tokens_per_s": metric([size.batch / s for s in step_s], "tokens/s", BASELINE, higher_is_better=True),
            "prefill_ms": metric([prefill_s * 1e3], "ms", BASELINE, higher_is_better=False),
        }, info)

    def chunked_row(self, chunked: Chunked, params: dict) -> dict:
        """The long prompt through ``h2o`` at an int budget, chunk by chunk as ``generate(prefill_chunk_size=...)``
        feeds it: prefill seconds, peak memory, the cache held, and the peak over what ``budget + chunk`` tokens'
        keys and values take (the most a chunked step holds at once)."""
        import evictlayers as el

        started = time.perf_counter()
        model = self.model_of(chunked.shape)
        weights = self.fresh()
        ids = prompt_ids(model, chunked.prompt, 1)
        mask = torch.ones_like(ids)
        fed, note = 0, None
        with torch.no_grad(), el.apply(model, recipe("h2o", budget=chunked.budget)) as run:

            def feed(cache, start: int, end: int) -> None:
                model(**forward_inputs(model, ids[:, start:end], cache, mask[:, :end], start))

            # first a few chunks past the budget on a cache of their own: every kernel's first launch (and JIT
            # compile) happens there, not in the timed prefill
            warm = run.new_cache()
            for start in range(0, chunked.budget + chunked.chunk + 1, chunked.chunk):
                feed(warm, start, start + chunked.chunk)
            del warm
            cache = run.new_cache()
            self.clock.sync()
            start = time.perf_counter()
            while fed < chunked.prompt:
                end = min(fed + chunked.chunk, chunked.prompt)
                feed(cache, fed, end)
                fed = end
                if fed == chunked.fallback and fed < chunked.prompt:
                    self.clock.sync()
                    so_far = time.perf_counter() - start
                    if so_far > chunked.limit_s * fed / chunked.prompt:
                        note = (f"stopped at {fed:,} tokens: they took {so_far:.0f} s, so {chunked.prompt:,} would "
                                f"take about {so_far * chunked.prompt / fed:.0f} s, past {chunked.limit_s:.0f} s")
                        break
            self.clock.sync()
            seconds = time.perf_counter() - start
            kv = run.stats()["kv_bytes"]
        peak = self.peak_mib(weights)
        element_bytes = next(model.parameters()).element_size()
        bound = (chunked.budget + chunked.chunk) * kv_bytes_per_token(chunked.shape, element_bytes)
        info = {
            "model": MODEL_NAMES[chunked.shape],
            "chunk": chunked.chunk, "budget": chunked.budget,
            "prefill_s": seconds, "prefill_tokens_per_s": fed / seconds,
            "kv_mib": kv / 2**20, "peak_mib": peak,
            "budget_chunk_kv_mib": bound / 2**20,
            "peak_over_budget_chunk_kv": peak * 2**20 / bound if peak is not None else None,
            "row_s": time.perf_counter() - started,
        }
        if note:
            info["note"] = note
        return row(CHUNKED, {**params, "prompt": fed}, {}, info)


# ---- the results file ---------------------------------------------------------------------------


COLUMNS = """\
Random-weight Llamas of the 1B and 8B shapes in bfloat16, random prompt ids, greedy one-token steps after one
prefill, as `generate()` runs them; see `benchmarks/README.md` (`gpu_decode`) and `benchmarks/gpu_decode.py`.

- `ms/step`: the median of the timed steps (each between two CUDA events), and the 10th-90th percentile;
  `tokens/s` = batch / median step; `vs hf-sdpa`: its tokens/s over `hf-sdpa`'s at the same size;
- `compile s`: the first step of a compiled row (tracing, compiling), before the timed steps;
- `prefill ms`: the prompt's one forward (evictlayers' includes scoring the prompt and evicting), after an
  untimed short one; in brackets its time over `hf-sdpa`'s;
- `KV MiB`: the key/value bytes held after the steps (`run.stats()["kv_bytes"]`; for transformers the cache's
  tensors, a `StaticCache`'s whole buffer); `peak MiB`: `torch.cuda.max_memory_allocated` during the row
  above the weights (CUDA only);
- `of bw`: (weight bytes + KV bytes) / measured copy bandwidth / median step, the share of the memory-bound
  limit reached;
- `graphs/breaks/recompiles/timed`: dynamo's graphs and graph breaks over the row, its recompiles, and the
  graphs compiled during the timed steps (0: nothing compiled while timed); `CUDA graphs`: graphs recorded
  by inductor's CUDA-graph trees, with the skips inductor reported; `graph/eager steps` (evictlayers): the
  one-token steps its compiled whole-model forward ran, and those that fell back to the model's own forward."""


def table(result: dict) -> str:
    """The decode rows and the chunked row, as two markdown tables."""
    rows = result["rows"]
    model_names = {SHAPES[shape]["num_hidden_layers"]: name for shape, name in MODEL_NAMES.items()}
    head = "| model | prompt | batch | config | ms/step (p10-p90) | tokens/s | vs hf-sdpa | compile s | prefill ms " \
           "(vs hf-sdpa) | KV MiB | peak MiB | of bw | graphs/breaks/recompiles/timed | CUDA graphs " \
           "| graph/eager steps | note |"
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in (r for r in rows if r["config"] != CHUNKED):
        i, p = r["info"], r["params"]
        cells = [model_names.get(p["layers"], f"{p['layers']} layers"), fmt(p["prompt"]), fmt(p["batch"]), r["config"]]
        if r["status"] == "ok":
            m = r["metrics"]
            compiled = "graphs" in i
            cells += [f"{fmt(m['ms_per_step']['value'])} ({fmt(i['p10_ms'])}-{fmt(i['p90_ms'])})",
                      fmt(m["tokens_per_s"]["value"]), ratio_text(m["tokens_per_s"]), fmt(i["compile_s"]),
                      f"{fmt(m['prefill_ms']['value'])} ({ratio_text(m['prefill_ms'])})",
                      fmt(i["kv_mib"]), fmt(i["peak_mib"]), fmt(i["of_bandwidth"]),
                      "/".join(fmt(i[k]) for k in ("graphs", "graph_breaks", "recompiles", "timed_graphs"))
                      if compiled else "-",
                      f"{fmt(i['cudagraphs'])} ({fmt(i['cudagraph_skips'])} skips)" if compiled else "-",
                      f"{fmt(i.get('graph_steps'))}/{fmt(i.get('eager_steps'))}" if "graph_steps" in i else "-", ""]
        else:
            cells += ["-"] * 11 + [f"{r['status']}: {r['reason']}".splitlines()[0].replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    chunked = [r for r in rows if r["config"] == CHUNKED]
    if chunked:
        head = "| model | prompt | chunk | budget | prefill s | tokens/s | KV MiB | peak MiB | (budget+chunk) KV MiB " \
               "| peak / that | note |"
        lines += ["", f"`{CHUNKED}`: the prompt through `h2o` at an int budget, in chunks as "
                  "`generate(prefill_chunk_size=...)` feeds it.", "", head, "|" + "---|" * (head.count(" | ") + 1)]
        for r in chunked:
            i = r["info"]
            if r["status"] == "ok":
                cells = [i["model"], fmt(r["params"]["prompt"]), fmt(i["chunk"]), fmt(i["budget"]),
                         fmt(i["prefill_s"]), fmt(i["prefill_tokens_per_s"]), fmt(i["kv_mib"]), fmt(i["peak_mib"]),
                         fmt(i["budget_chunk_kv_mib"]), fmt(i["peak_over_budget_chunk_kv"]), i.get("note", "")]
            else:
                cells = ["-", fmt(r["params"]["prompt"])] + ["-"] * 8 + [
                    f"{r['status']}: {r['reason']}".splitlines()[0].replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(document: dict) -> str:
    """``<machine>-e2e.md``: what the columns mean, then the tables."""
    result = document["benchmarks"][NAME]
    run_env = result["env"]
    where = run_env.get("cuda") or f"CPU ({run_env['cpu']})"
    parts = [f"# End-to-end decode ({document['machine']})", "",
             f"Generated by `python -m benchmarks --only {NAME}` on {where}, {run_env['date']}: torch "
             f"{run_env['torch']}, transformers {run_env['transformers']}"
             f"{', --quick (tiny shape)' if result['quick'] else ''}.", "", COLUMNS, ""]
    if result["status"] != "ok":
        return "\n".join(parts + [f"Skipped: {result['reason']}."]) + "\n"
    bandwidth = next((r["info"]["bandwidth_gb_s"] for r in result["rows"] if "bandwidth_gb_s" in r["info"]), None)
    parts += [f"Copy bandwidth measured in this run: {fmt(bandwidth)} GB/s (read + write). "
              f"{result['seconds']:.0f} s in all.", "", table(result)]
    return "\n".join(parts) + "\n"
