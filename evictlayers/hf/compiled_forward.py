"""One compiled graph for a whole decode forward, embedding to logits, under ``evictlayers.apply(compile=True)``.

Compiling each layer's decode step alone leaves, at every layer of every step, transformers' eager module
stack around it (norms, projections, rotary embedding, MLP, a few dozen Python calls) and the compiled
graph's own call (dynamo's guards, ~0.4 ms). On a small model they cost about as much as reading the weights.
``CompiledDecodeForward`` stands in for the model's ``forward`` while the patch is active and sends each
one-token forward whose cache decodes in place at every layer (``SlotStore.decodes_in_place``: a budget
or a window bounds the layer, so its buffers never grow, or a full layer keeps its slots in position order
and was given room for the token before the graph runs) through one
``torch.compile(fullgraph=True)`` of the model's own ``forward``: the slot stores' decode steps
(``compose/decode_step.py``) are traced inline, so a step pays the guards and a graph call once.

Everything else takes the model's ``forward`` eagerly, with each layer's decode step compiled as before:
prefill (its shapes change with every prompt), the steps of a full cache out of position order (a padded
prompt or step, or on CUDA: its buffers may grow inside the step) or of one that holds a ClusterSketch, a
hybrid model's recurrent layers (transformers' own code, not evictlayers'), and a storage that does not
compile on CUDA (the store refuses it with ``CompileError``).

The model's linear layers are traced as they stand: ``F.linear`` (BLAS on CPU), or under
``apply(compile=True, cpu_linear=True)`` the forwards ``EvictionRun`` gave them, which call
``evictlayers::few_rows_linear``. Dynamo guards on those forwards, so a graph traced with them never serves a
forward without them, nor the reverse.

``apply(compile="max-autotune")`` traces the same forward with the weights frozen into the graph and its
products' kernels chosen by timing (``MAX_AUTOTUNE``): on a CPU, inductor's C++ GEMM template with the weights
packed for the batch's few rows, where BLAS runs a matrix of one to eight rows far below its rate.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable

import torch
from torch._dynamo.utils import counters

from evictlayers.compose.decode_step import raise_recompile_limit
from evictlayers.compose.store import CompileError
from evictlayers.hf.cache import EvictionCache, EvictionLayer
from evictlayers.hf.weights import weights_signature


#: Inductor settings in force around each call of the graph under ``apply(compile="max-autotune")``, while it
#: may be traced and compiled: the weights folded into the graph as constants (``freezing``, which takes effect
#: under ``torch.no_grad`` or ``torch.inference_mode``; dynamo reads it from the global config when it traces,
#: not from ``torch.compile``'s ``options``), so inductor may lay them out for its own GEMM kernels (on CPU its
#: C++ template, packed for the batch's few rows), and the candidate kernels of each product timed.
MAX_AUTOTUNE = {"freezing": True, "max_autotune": True}


class CompiledDecodeForward:
    """``model.forward`` while ``apply(model, policy, compile=True or "max-autotune")`` is active (``EvictionRun``
    installs it).

    ``eager`` is the model's own bound ``forward``; ``run`` the ``EvictionRun``, whose forward pre-hook has
    already handed this forward its cache and counted its tokens when this is called; ``mode`` ``True`` or
    ``"max-autotune"``. Under ``"max-autotune"`` the graph holds the weights it was compiled with: a forward after any
    parameter was replaced or changed in place (``weights_signature``) compiles it again, as the first did."""

    def __init__(self, run, eager: Callable, mode: bool | str = True):
        self.run, self.eager, self.mode = run, eager, mode
        self.compiled: Callable | None = None
        self.weights: tuple | None = None  # the signature of the weights a "max-autotune" graph holds
        self.modules = list(run.model.modules())  # whose parameters the signature reads, listed once
        self.graph_steps = self.eager_steps = 0  # one-token forwards through the graph / the model's own forward
        self.eager_reason: str | None = None
        self.warned: set[str] = set()
        self.captured = self.capture_skipped = False  # CUDA graphs asked for / inductor declined them
        # generate() reads forward's signature to choose what it passes (position_ids, for one): keep the model's
        functools.update_wrapper(self, eager)

    def __call__(self, *args, **kwargs):
        stores = self.stores_in_place()
        if stores is None:
            self.eager_steps += self.run.step_tokens == 1
            return self.eager(*args, **kwargs)
        if self.mode == "max-autotune":
            weights = weights_signature(self.modules)
            if weights != self.weights:
                self.compiled, self.weights = None, weights
        captured = self.captured = captures(stores[0].pos.device)
        if self.compiled is None:
            raise_recompile_limit()
            traced = self.eager if self.mode is True else _own_code(self.eager)
            options = {"emulate_precision_casts": True, "triton.cudagraphs": captured}
            self.compiled = torch.compile(traced, fullgraph=True, dynamic=None, options=options)
        if captured:
            for store in stores:
                mark_static_buffers(store)
        kwargs = self.fixed_shape_arguments(kwargs)
        self.run.in_compiled_forward = True
        for store in stores:  # stores_in_place read the step's mask
            store.unpadded_step = True
        try:
            # compile=True patches nothing: even an empty patch costs ~20 us a step
            settings = contextlib.nullcontext() if self.mode is True else torch._inductor.config.patch(MAX_AUTOTUNE)
            skips = counters["inductor"]["cudagraph_skips"]
            with settings:
                out = self.compiled(*args, **kwargs)
            if captured and counters["inductor"]["cudagraph_skips"] > skips:
                self.capture_skipped = True
                warnings.warn(
                    "evictlayers: inductor did not capture the compiled decode forward as a CUDA graph (its "
                    "'skipping cudagraphs due to ...' log line says why); the steps run uncaptured", stacklevel=2,
                )
            for store in stores:
                store.seq_len += 1  # counted here, not in the graph (``SlotStore.count_step``)
            self.graph_steps += 1
            return out
        except torch._dynamo.exc.TorchDynamoException as error:
            raise CompileError(
                f"evictlayers could not compile the decode forward of {type(self.run.model).__name__} under "
                f"{' '.join(repr(self.run.policy).split())}: something in the model or the policy cannot be traced "
                f"by torch.compile(fullgraph=True) ({error}). Run it with compile=False"
            ) from error
        finally:
            self.run.in_compiled_forward = False
            self.run.step_real = None
            for store in stores:
                store.unpadded_step = False

    @staticmethod
    def fixed_shape_arguments(kwargs: dict) -> dict:
        """The forward's keyword arguments with nothing in them that grows with the sequence where that is safe,
        so that one graph (and on CUDA one captured graph) serves every step: the step's column of the padding
        mask was read eagerly (``stores_in_place``) and is handed to the attention as ``run.step_real`` (the
        slot stores mask by position), so where the call passes its positions (``generate()`` does) the mask
        itself is not passed: nothing else of the model reads it then. A call without positions keeps its mask,
        from which some models (OPT, BioGPT) count them; the graph then takes the mask's growing length as a
        value, which costs a second compile and, on CUDA, a recording per step, never other logits."""
        if kwargs.get("position_ids") is not None and "attention_mask" in kwargs:
            return {**kwargs, "attention_mask": None}
        return kwargs

    def stores_in_place(self) -> list | None:
        """Every layer's slot store when this forward is a one-token step of a cache every layer of which is an
        evictlayers attention layer decoding in place, else ``None``. Grows first, eagerly, each full layer with
        no free slot left (as its own step would: ``SlotStore.make_room``), and reads whether the step's tokens
        are real where a full layer keeps its slots in position order (a padded token ends that order, which
        the graph cannot branch on); a mask with fewer columns than the tokens so far raises ``ValueError``.
        For the graph it sets ``run.step_real``, the step's column of the mask (``None`` on any other path)."""
        self.run.step_real = None
        cache = self.run.cache
        if self.run.step_tokens != 1 or not isinstance(cache, EvictionCache):
            return None
        stores = [layer.store for layer in cache.layers if type(layer) is EvictionLayer]
        if cache.reusing:
            return self.eager_because("the model shares keys and values between layers (KV sharing): a source "
                                      "layer's step keeps what it attended over for its reusing layers")
        if len(stores) != len(cache.layers):
            return self.eager_because("the model has layers whose cache is transformers' own (recurrent state, or "
                                      "no attention cache), which the compiled decode forward does not trace")
        for store in stores:
            store.make_room()
        for store in stores:
            if not store.decodes_in_place():
                return self.eager_because(_why_not_in_place(store))
        # read eagerly for every cache: a mask shorter than the tokens so far is refused here, with its message,
        # where inside the graph the refusal could not be traced and would surface as a CompileError
        real = self.run.real_tokens(stores[0].seq_len, 1)
        in_order = any(store.filled is not None for store in stores)
        if in_order and real is not None and not bool(real.all()):
            return self.eager_because("a padded step ends the position order of a full cache")
        self.run.step_real = real  # what the graph's attention reads instead of slicing the growing mask
        return stores

    def eager_because(self, reason: str) -> None:
        """Record (and warn once per reason) why a one-token step runs eagerly, layer by layer; ``None``."""
        self.eager_reason = reason
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(
                f"evictlayers: compile={self.mode!r} runs this model's decode steps layer by layer, not as one "
                f"graph: {reason}. run.stats()['compiled_decode'] counts the steps of each path",
                stacklevel=3,
            )
        return None

    def path_counts(self) -> dict:
        """``graph_steps``/``eager_steps``: one-token forwards through the whole-model graph / layer by layer;
        ``captured``: whether the graph is replayed as a CUDA graph (on CUDA, unless inductor logged a
        'skipping cudagraphs' reason); ``eager_reason``: why the last eager step was one (``None``: none was)."""
        return {
            "graph_steps": self.graph_steps, "eager_steps": self.eager_steps,
            "captured": self.captured and not self.capture_skipped, "eager_reason": self.eager_reason,
        }


def _why_not_in_place(store) -> str:
    """Why ``store.decodes_in_place()`` is false (``SlotStore.decodes_in_place`` gives the rules)."""
    if store.kv is None:
        return f"layer {store.layer_idx} holds nothing yet"
    if store.sketch is not None:
        return f"layer {store.layer_idx} holds a ClusterSketch, whose coin table is remade every few steps"
    if store.probing or store.deferred:
        return f"layer {store.layer_idx} runs a probe or defers eviction (EvictionRun.compress_context)"
    if store.filled is not None:
        return f"layer {store.layer_idx} keeps its slots in position order and has no free slot"
    return (f"layer {store.layer_idx}'s storage {store.policy.storage!r} does not compile on CUDA (inductor's build "
            "gives other logits than the step run eagerly)")


def captures(device: torch.device) -> bool:
    """Whether the whole-forward graph is captured and replayed as a CUDA graph on ``device`` (inductor's
    ``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets): on CUDA, where a step is otherwise many small
    kernel launches the host issues one by one."""
    return device.type == "cuda"


def mark_static_buffers(store) -> None:
    """Mark every tensor a slot store holds (its storage's slots, positions, ranks, per-slot and per-head state,
    tokens seen, budget) as a static input of the captured graph: the step writes them in place, and a
    captured graph may write only inputs at fixed addresses (any other input is copied into the graph's own
    buffer before each replay, which for the slots would copy the cache every step). ``guard=False``: a new
    buffer of the same shape (a new prompt, a beam reorder) re-records the CUDA graph rather than recompiling."""
    for tensor in held_tensors(store):
        if getattr(tensor, "_dynamo_static_input_type", None) is None:
            torch._dynamo.mark_static_address(tensor, guard=False)


def held_tensors(store) -> list[torch.Tensor]:
    """The tensors of ``store``, of its storage (``store.kv``) and its rotary tables, dicts of tensors included."""
    found = []
    for owner in (store, store.kv):
        for value in vars(owner).values():
            values = value.values() if isinstance(value, dict) else (value,)
            found += [tensor for tensor in values if isinstance(tensor, torch.Tensor)]
    if store.rotary is not None:
        found += [tensor for table in store.rotary.tables() for tensor in table]
    return found


def _own_code(function: Callable) -> Callable:
    """``function`` behind a trampoline with a code object of its own. Dynamo keeps its graphs per code object
    and guards a frozen graph's weights by identity only, so a graph traced from the model's ``forward`` would
    serve a later compile of the same model after its weights changed in place; a fresh code object starts
    with no graphs, and its graphs (and the weights they hold) go when it does."""

    def trampoline(*args, **kwargs):
        return function(*args, **kwargs)

    trampoline.__code__ = trampoline.__code__.replace()
    return trampoline
