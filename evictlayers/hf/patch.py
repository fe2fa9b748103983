"""``evictlayers.apply``: replace a model's attention modules for the duration of a ``with`` block.

Module replacement, Liger-style: each attention module's class is swapped for a subclass that routes
attention through the slot store, every config's attention implementation points at the registered
evictlayers function, and a forward pre-hook gives each forward an ``EvictionCache`` (and keeps a float
budget a fraction of the whole prompt when the prompt comes in chunks: ``EvictionRun._govern_prompt``);
``model.generate`` is wrapped so the run knows each call's prompt. Nothing else of the model changes unless
asked: ``cpu_linear=True`` (with ``compile=True``, on a CPU model) also gives each ``nn.Linear`` a forward that
runs a step's few-row products with ``kernels/linear_cpu.py``'s op. Exiting restores classes, configs, hooks,
forwards and ``generate``; parameters and ``state_dict`` keys are never touched.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from evictlayers.compose import Induction, Policy
from evictlayers.compose.positions import RotaryTable
from evictlayers.hf import attention, reconstruction, versions
from evictlayers.hf.cache import EvictionCache, EvictionLayer
from evictlayers.hf.compiled_forward import CompiledDecodeForward
from evictlayers.hf.prompt import (
    GeneratePrompt,
    check_prefill_arguments,
    feed_in_chunks,
    prompt_cache,
    generate_prompt,
    govern_prompt,
    refuse_rollback,
)
from evictlayers.hf.induction import induction_scores
from evictlayers.hf.rotary import model_rotary_tables
from evictlayers.hf.sentences import sentence_end_table
from evictlayers.hf.support import ModelSupport, UnsupportedModelError, attention_implementation, model_support
from evictlayers.kernels import linear_cpu
from evictlayers.kernels.decode import slots_cpu
from evictlayers.kernels.prefill import mass_cpu

_EVICTING_CLASSES: dict[type, type] = {}
_ABSENT = object()  # the model had no forward of its own (instance attribute) before the patch


def _evicting_class(cls: type) -> type:
    """``Evicting<cls>``: the same module, marked as routed through evictlayers."""
    if cls not in _EVICTING_CLASSES:
        _EVICTING_CLASSES[cls] = type(f"Evicting{cls.__name__}", (cls,), {"_evictlayers_original_class": cls})
    return _EVICTING_CLASSES[cls]


class EvictionRun:
    """The patched state of one model; ``with apply(model, policy) as run`` yields it. ``cpu_linear``: whether its
    linear layers run ``kernels/linear_cpu.py``'s op (asked for, and available here). ``run.new_cache()`` makes a
    cache, ``run.prefill(ids, mask, chunk=N)`` runs a long prompt into one in bounded memory,
    ``run.compress_context(ids, mask)`` compresses a context for any later question (KVzip)."""

    def __init__(self, model: nn.Module, policy: Policy, compile: bool | str = False, tokenizer=None,
                 cpu_linear: bool = False):
        versions.check_transformers_version()
        if not isinstance(policy, Policy):
            raise TypeError(f"evictlayers.apply expects a Policy, got {type(policy).__name__}")
        if not (isinstance(compile, bool) or compile == "max-autotune"):
            raise ValueError(f"evictlayers.apply(compile={compile!r}): expected False, True or 'max-autotune'")
        if not isinstance(cpu_linear, bool):
            raise TypeError(f"evictlayers.apply(cpu_linear={cpu_linear!r}): expected True or False")
        if cpu_linear and compile is not True:
            raise ValueError(
                f"evictlayers.apply(cpu_linear=True, compile={compile!r}): the few-rows op serves the weight "
                "products of the compiled decode forward; use it with compile=True (compile='max-autotune' has "
                "inductor choose its own kernels for the weights it freezes)"
            )
        if cpu_linear and model.device.type != "cpu":
            raise ValueError(
                f"evictlayers.apply(cpu_linear=True): the model is on {model.device}, and the few-rows op is a CPU "
                "op; use cpu_linear=True on a CPU model only"
            )
        if getattr(model, "_evictlayers_run", None) is not None:
            raise RuntimeError(
                f"evictlayers.apply was already applied to this {type(model).__name__}; exit the first "
                "`with` block (or call run.remove()) before applying another policy"
            )
        self.model, self.policy, self.compile = model, policy, compile
        self.tokenizer = tokenizer  # read by compress_context (KVzip's repeat prompts) and sentence marks
        # built (or loaded) here, not inside the first step someone times; where it cannot run, the linear layers
        # keep BLAS, which computes the same logits
        why_not = linear_cpu.unavailable_reason() if cpu_linear else None
        self.cpu_linear = cpu_linear and why_not is None
        if why_not is not None:
            warnings.warn(
                f"evictlayers.apply(cpu_linear=True): the few-rows op {why_not}; the linear layers keep their own "
                "forward (BLAS), with the same logits",
                stacklevel=3,
            )
        self.support = model_support(model)
        if isinstance(policy.allocation, Induction) and policy.allocation.scores is None:
            if self.support.shared_blocks:
                raise ValueError(
                    f"model_type={self.support.model_type!r}: Induction measures each layer's attention module, but "
                    "one attention block serves several of this model's layers; give Induction(scores=...) measured "
                    "another way, or another allocation"
                )
            # measured on the unmodified model, before any module is swapped
            scores = induction_scores(model, self.support)
            measured = {"_component_": "Induction", "floor": policy.allocation.floor, "scores": scores}
            self.policy = policy.replace(allocation=measured)
        layer_policies = self.policy.layer_policies
        if any(p.reads_mass for p in layer_policies) and model.device.type == "cpu":
            # the C++ prefill-with-mass kernel is built (once per machine, cached after) or loaded here, not
            # inside the first prefill someone times
            mass_cpu.extension()
        if model.device.type == "cpu":
            # likewise the decode's slot ops: its matmuls over the slots (for the steps that read the mass) and
            # the search for each head's first free slot (every step that goes through the slot store)
            slots_cpu.extension()
        # a policy that ranks sentences: which token ids end one, and the current forward's marks [B, Q]
        self._sentence_table: torch.Tensor | None = None
        self.sentence_ends: torch.Tensor | None = None
        if any(p.reads_sentences for p in layer_policies):
            if tokenizer is None:
                raise ValueError(
                    "this policy ranks the text's sentences (a SentenceScores refinement): pass the model's "
                    "tokenizer, evictlayers.apply(model, policy, tokenizer=tokenizer), so evictlayers knows which "
                    "tokens end a sentence"
                )
            vocab = model.config.get_text_config(decoder=True).vocab_size
            self._sentence_table = sentence_end_table(tokenizer, vocab)
        # the attention implementation evictlayers stands in for (what the unmodified model runs)
        self.replaced_implementation = getattr(model.config, "_attn_implementation", None)
        self._attention = self.support.modules
        if self.support.reusing:
            _check_kv_sharing(self.support, self.policy)
        self.num_layers = self.support.num_layers
        self.rotary: dict[int, RotaryTable] | None = None  # rolling positions: the hook then zeroes position_ids
        # a scorer that rotates queries to future positions (ExpectedAttention): the same tables, positions untouched
        self.query_rotary: dict[int, RotaryTable] | None = None
        self.cache: EvictionCache | None = None
        self._padding: torch.Tensor | None = None
        # tokens per row of the current forward (its input's second dim); None for a chunk of a declared prompt,
        # which a one-token chunk too runs as prefill, never as the compiled decode forward
        self.step_tokens: int | None = None
        self.in_compiled_forward = False  # set by CompiledDecodeForward while its graph runs
        self._generating: GeneratePrompt | None = None  # the prompt of the generate() call under way
        # a float budget is a fraction of the prompt: a second prompt chunk without the prompt's length is refused
        self._fraction_budget = any(isinstance(p.budget, float) for p in layer_policies)
        # the step's [B, 1] real-token column while the compiled decode forward runs (read before the graph)
        self.step_real: torch.Tensor | None = None
        self._implementation = attention_implementation(model, self.support, attention.ATTENTION_NAME)
        self._hooks = []
        self._captured: dict | None = None  # set while the rolling probe records what each layer attends with
        self._patch()
        if policy.positions == "rolling":
            # keys arrive un-rotated (every token at position 0) and the stores rotate them by these tables
            try:
                self.rotary = model_rotary_tables(model, self.support, self._capture)
            except BaseException:
                self.remove()
                raise
        elif any(p.reads_queries for p in layer_policies):
            readers = sorted({
                type(getattr(member, "accumulator", member)).__name__
                for p in layer_policies if p.selectors is not None for member in p.selectors.members
                if member.reads_queries
            })
            try:
                self.query_rotary = model_rotary_tables(model, self.support, self._capture, user=", ".join(readers))
            except BaseException:
                self.remove()
                raise

    # ---- patching ------------------------------------------------------------------------------

    def _patch(self) -> None:
        attention.register()
        for module in self._attention:
            module.__class__ = _evicting_class(type(module))
            module._evictlayers_run = self
        self._implementation.__enter__()
        for module in self.model.modules():
            if isinstance(module, PreTrainedModel):
                signature = inspect.signature(module.forward)
                hook = module.register_forward_pre_hook(self._hook(signature), with_kwargs=True)
                self._hooks.append(hook)
        if self.compile:
            # an instance attribute shadows the class's forward; whatever stood there before (accelerate's
            # hooks put one) is put back by remove()
            self._own_forward = self.model.__dict__.get("forward", _ABSENT)
            self.model.forward = CompiledDecodeForward(self, self.model.forward, mode=self.compile)
        self._linears = self._route_linears() if self.cpu_linear else []
        self._own_generate, self._generate = self.model.__dict__.get("generate", _ABSENT), None
        if callable(getattr(self.model, "generate", None)):
            self._generate = self._generate_knowing_the_prompt(self.model.generate)
            self.model.generate = self._generate
        self.model._evictlayers_run = self

    def _generate_knowing_the_prompt(self, generate):
        """``model.generate`` while the patch is active: the model's own, with the run knowing the call's prompt
        (``GeneratePrompt``), so that a prompt ``generate(..., prefill_chunk_size=N)`` feeds in chunks
        resolves a float budget from all of it (``_govern_prompt``)."""

        @functools.wraps(generate)
        def generate_knowing_the_prompt(*args, **kwargs):
            refuse_rollback(kwargs)
            outer, self._generating = self._generating, generate_prompt(self.model, args, kwargs)
            try:
                return generate(*args, **kwargs)
            finally:
                self._generating = outer

        return generate_knowing_the_prompt

    def _route_linears(self) -> list[tuple[nn.Linear, object]]:
        """Give each plain ``nn.Linear`` ``few_rows_forward`` (``cpu_linear=True``: a decode step's products of one
        row per sequence, which BLAS runs far below its rate); a layer that already has an instance forward (a
        hook's) keeps it. The linears given one, each with it."""
        routed = [m for m in self.model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
        for module in routed:
            module.forward = linear_cpu.few_rows_forward(module)
        return [(module, module.forward) for module in routed]

    def remove(self) -> None:
        """Restore the model exactly as it was."""
        if getattr(self.model, "_evictlayers_run", None) is not self:
            return
        for hook in self._hooks:
            hook.remove()
        for module, forward in self._linears:
            if module.__dict__.get("forward") is forward:  # not replaced by someone else since
                del module.forward
        if self.compile:
            if self._own_forward is _ABSENT:
                del self.model.forward
            else:
                self.model.forward = self._own_forward
        if self._generate is not None and self.model.__dict__.get("generate") is self._generate:
            if self._own_generate is _ABSENT:
                del self.model.generate
            else:
                self.model.generate = self._own_generate
        self._implementation.__exit__(None, None, None)
        for module in self._attention:
            module.__class__ = module._evictlayers_original_class
            del module._evictlayers_run
        del self.model._evictlayers_run

    def __enter__(self) -> EvictionRun:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _capture(self, position_ids: torch.Tensor) -> dict:
        """``{layer_idx: (query, key)}`` each attention layer received for a probe sequence at
        ``position_ids`` ``[1, T]``, run without a cache (nothing is stored)."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        tokens = (torch.arange(position_ids.shape[1], device=position_ids.device) * 7 + 3) % vocab
        self._captured = {}
        try:
            with torch.no_grad():
                self.model(input_ids=tokens[None], position_ids=position_ids, use_cache=False)
            return self._captured
        finally:
            self._captured = None

    @property
    def recording(self) -> bool:
        """Whether the rolling probe is running (the attention function then records and returns zeros)."""
        return self._captured is not None

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Keep what a layer attends with while the probe runs."""
        self._captured[layer_idx] = (query.detach(), key.detach())

    # ---- per forward ---------------------------------------------------------------------------

    def new_cache(self, prompt_len: int | torch.Tensor | None = None) -> EvictionCache:
        """An empty cache for this model and policy (pass it as ``past_key_values``). ``prompt_len``: the real
        tokens of each row's whole prompt (an ``int``, or ``attention_mask.sum(1)``), for a prompt you feed in
        chunks yourself: a float budget is then a fraction of all of it (``EvictionCache.declare_prompt``)."""
        return EvictionCache(
            self.policy, self.num_layers, compile=bool(self.compile),
            rotary=self.rotary if self.rotary is not None else self.query_rotary, support=self.support,
            prompt_len=prompt_len,
        )

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, chunk: int,
                cache: EvictionCache | None = None, position_ids: torch.Tensor | None = None):
        """Run a prompt through the patched model ``chunk`` tokens at a time, under ``torch.no_grad``, with its
        length known, so that memory stays bounded by ``budget + chunk`` tokens per head while a float budget is
        still that fraction of the whole prompt: after it every layer holds what one forward of the prompt
        leaves (the same budget per row, the same number of tokens per head).

        ``attention_mask``: ``[B, T]`` padding mask of the prompt (left padding as ``generate()`` takes it);
        ``position_ids``: ``[B, T]`` positions, sliced per chunk (without them the model derives each chunk's
        from the cache, as one forward of the prompt would); ``cache``: an empty evictlayers cache to fill
        (default: ``new_cache()``). Returns the last chunk's model output: ``out.logits[:, -1]`` are the next
        token's logits and ``out.past_key_values`` the cache, ready to decode one token per forward. (``generate``
        chunks a prompt itself: ``model.generate(..., prefill_chunk_size=N)``; given a cache that holds the
        whole prompt it would feed the prompt again.)"""
        if getattr(self.model, "_evictlayers_run", None) is not self:
            raise RuntimeError("run.prefill: this run's patch was removed; call it inside the `with` block")
        prompt_len = check_prefill_arguments(input_ids, attention_mask, chunk, position_ids)
        cache = prompt_cache(self, "run.prefill", cache, prompt_len)
        return feed_in_chunks(self.model, cache, input_ids, attention_mask, chunk, position_ids)

    def compress_context(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, repeat_prompt=None,
        chunk: int = reconstruction.DEFAULT_CHUNK, prefill_chunk: int | None = None, room: int = 0,
        cache: EvictionCache | None = None,
    ) -> EvictionCache:
        """KVzip's query-agnostic compression (Kim et al. 2025, arXiv:2505.23416): prefill the context, score each
        cached token by the attention it gets while the model repeats the context, keep each head's best
        ``budget``; returns the cache, ready to answer any question after the context.

        The policy must score by probes (``ContextReconstruction``, ``evictlayers/recipes/kvzip.yaml``). Steps:

        1. the context runs into a new cache (or ``cache``, empty) declared ``attention_mask.sum(1)`` long (a float
           budget is that fraction of each row's context), every layer holding every token (``defer_eviction``),
           in forwards of ``prefill_chunk`` tokens (``None``: one);
        2. in chunks of ``chunk`` context tokens, ``<repeat prompt> + <chunk>`` runs over the cache as a probe
           (``EvictionCache.probing``): it attends over the whole context and, causally, itself, at the positions
           after the context's, the scorers take the most attention any of its rows gives each context token, and
           nothing of it is stored;
        3. each layer's heads keep their ``budget`` best context tokens (``evict_deferred``).

        ``repeat_prompt``: the ids before every chunk; ``None`` (the default) takes KVzip's prompts in the ids of the
        tokenizer given to ``evictlayers.apply(..., tokenizer=)`` ("Repeat the previous context exactly.", before a
        later chunk "Repeat the part of the previous context exactly, starting with " and the previous chunk's
        last 8 tokens, then the chat template's opening of the assistant's answer: ``hf/reconstruction.py``). As
        in KVzip the context is expected as the start of a user turn and each question as its continuation: for a
        chat model, the template's text before the user's message, then the context; a question is then
        ``"\n\n" + question`` and the template's generation prompt (KVzip's layout; a plain context works too).

        Then ask: ``model.generate(question_ids, attention_mask=torch.cat([context_mask, question_mask], 1),
        past_key_values=cache)``: the mask covers the context's columns and the question's (without it
        transformers takes ``question_ids`` for the whole sequence); passing the context's and the question's ids
        with the same mask works too. The budget keeps binding while the question and answer are written: they
        score above every context token, so the lowest-scored context tokens leave first, one per token written.
        ``room`` (tokens per head, default 0) raises every budgeted layer's budget by that much after the
        eviction (``EvictionCache.add_room``), so that a question and answer of up to ``room`` tokens leave the
        compressed context whole, as KVzip's appended question and answer do, at ``budget + room`` tokens per
        head. Generation writes into the cache; ask each of several questions of a copy (``copy.deepcopy(cache)``).

        Batches: left-padded rows (``attention_mask``) are served, each reconstructed after its own context
        (positions passed per row; a row whose context has no chunk left runs padding). Refused (``ValueError``,
        before any forward): a policy whose scorers do not observe probes, a model with recurrent layers, bad
        arguments.

        Cost: the context's prefill, then one more forward over the context (the teacher-forced reconstruction)
        plus a repeat prompt per chunk (about 10 to 30 tokens), each chunk attending over the whole context and
        computing every row's probabilities (the kernels' scored-rows path, where a plain prefill takes the flash
        path): KVzip reports about twice a prefill. Memory: the whole context's cache until the eviction, and one
        block of probe rows' probabilities at a time (``compose/probe_step.py``, 64 MiB). Measured once on the CPU
        with tiny random Llamas and a 2,048-token context (docs/recipes.md): 3.7-4.6x a plain prefill's time at
        hidden size 256, 2.7-2.9x at 1024, where attention weighs less.
        """
        if getattr(self.model, "_evictlayers_run", None) is not self:
            raise RuntimeError("run.compress_context: this run's patch was removed; call it inside the `with` block")
        return reconstruction.compress_context(
            self, input_ids, attention_mask, repeat_prompt=repeat_prompt, chunk=chunk, prefill_chunk=prefill_chunk,
            room=room, cache=cache,
        )

    def _hook(self, signature: inspect.Signature):
        names = list(signature.parameters)
        cache_name = "cache" if "cache" in names else "past_key_values"  # transformers >= 5.24 names it cache

        def replaced(args: tuple, kwargs: dict, name: str, value) -> tuple[tuple, dict]:
            slot = names.index(name) if name in names else len(args)
            if slot < len(args):
                return (*args[:slot], value, *args[slot + 1 :]), kwargs
            return args, {**kwargs, name: value}

        def before_forward(module, args, kwargs):
            if self.in_compiled_forward:
                # an inner model called by the compiled decode forward: the outer model's hook already ran,
                # eagerly, on the same cache, mask and tokens
                return args, kwargs
            arguments = signature.bind_partial(*args, **kwargs).arguments
            arguments.update(arguments.pop("kwargs", {}))
            mask, use_cache = arguments.get("attention_mask"), arguments.get("use_cache")
            # a caller may still pass the old name to a forward that takes `cache` (a deprecated alias there)
            cache = arguments.get(cache_name, arguments.get("past_key_values"))
            if cache_name != "past_key_values" and "past_key_values" in kwargs:
                kwargs = {name: value for name, value in kwargs.items() if name != "past_key_values"}
            if use_cache is None:
                use_cache = getattr(module.config, "use_cache", True)
            if isinstance(mask, dict):
                # an inner model called with the outer model's prepared masks (one per layer type, as
                # multimodal wrappers do): the outer call already handed over the padding and the cache
                return args, kwargs
            if mask is not None and mask.dim() != 2:
                raise ValueError(
                    f"evictlayers needs a 2-D padding attention_mask [batch, tokens]; got shape {tuple(mask.shape)}"
                )
            if use_cache:
                if cache is None or (
                    isinstance(cache, Cache) and not isinstance(cache, EvictionCache) and cache.get_seq_length() == 0
                ):
                    cache = self.new_cache()
                elif not isinstance(cache, EvictionCache):
                    raise TypeError(
                        f"past_key_values is a {type(cache).__name__} holding {cache.get_seq_length()} tokens; "
                        "under evictlayers.apply pass an evictlayers cache (run.new_cache()) or none"
                    )
                args, kwargs = replaced(args, kwargs, cache_name, cache)
            inputs = next((arguments[n] for n in ("input_ids", "inputs_embeds") if arguments.get(n) is not None), None)
            self.step_tokens = None if inputs is None else inputs.shape[1]
            if use_cache and isinstance(cache, EvictionCache) and inputs is not None:
                if self._govern_prompt(cache, mask, inputs.shape[0], inputs.shape[1]):
                    self.step_tokens = None  # a chunk of a declared prompt, even one token long: never decoded
            if self.rotary is not None:
                # position 0 everywhere makes the model's rotary embedding the identity: queries and keys
                # reach the attention function un-rotated, and the slot store rotates them to their ranks
                zeros = torch.zeros(1, inputs.shape[1], dtype=torch.long, device=inputs.device)
                args, kwargs = replaced(args, kwargs, "position_ids", zeros)
            self.cache = cache if use_cache else None
            self._padding = mask
            if self._sentence_table is not None:
                self._mark_sentence_ends(arguments.get("input_ids"))
            return args, kwargs

        return before_forward

    def _govern_prompt(self, cache: EvictionCache, mask: torch.Tensor | None, batch: int, tokens: int) -> bool:
        """Whether a forward of ``tokens`` tokens per row on ``cache`` is a chunk of a declared prompt, declaring
        ``generate()``'s prompt or refusing a chunk whose float budget would shrink (``prompt.govern_prompt``)."""
        return govern_prompt(cache, mask, batch, tokens, self._generating, self._fraction_budget, self.policy.budget)

    def _mark_sentence_ends(self, input_ids: torch.Tensor | None) -> None:
        """Keep which of this forward's tokens end a sentence, for a policy that ranks sentences (``None``
        for a forward fed inputs_embeds: its slot stores then say they need the ids)."""
        if input_ids is None:
            self.sentence_ends = None
            return
        if self._sentence_table.device != input_ids.device:
            self._sentence_table = self._sentence_table.to(input_ids.device)
        self.sentence_ends = self._sentence_table[input_ids]

    def staged_layer(self, layer_idx: int | None) -> EvictionLayer | None:
        """The cache layer holding this step's staged keys, or ``None`` when running without a cache.

        A module's keys are staged in its own cache layer (``layer_idx``), or, where one module serves several
        cache layers, in the one its call's ``cache.update`` named: Zamba's attention block, shared by several
        layers and told its layer at each call, and Dory's looped section, whose every pass keeps copies of the
        section's cache layers appended to the cache. The model updates the cache and attends right after, so
        exactly one layer holds staged keys then; the attention function still checks that the keys it was
        handed are that layer's."""
        if self.cache is None:
            return None
        own = self.cache.layers[layer_idx] if isinstance(layer_idx, int) and 0 <= layer_idx < len(self.cache.layers) else None
        if getattr(own, "staged", None) is not None:
            return own
        staged = [layer for layer in self.cache.layers if getattr(layer, "staged", None) is not None]
        if len(staged) == 1:
            return staged[0]
        raise UnsupportedModelError(self._unstaged_reason(layer_idx, len(staged)))

    def _unstaged_reason(self, layer_idx: int | None, staged: int) -> str:
        """Why an attention call found no staged keys to attend over: the model attended over keys it did not
        hand to the cache (a looped pass that reads the cache's keys without writing, two attention calls over
        one update), or several layers hold staged keys at once."""
        module = next((layer.module for layer in self.support.attention if layer.index == layer_idx), None)
        name = getattr(module, "_evictlayers_original_class", type(module)).__name__
        where = f"model_type={self.support.model_type!r}, {name} (layer {layer_idx})"
        if staged:
            return (
                f"{where}: {staged} cache layers hold new keys that no attention call has read yet, so evictlayers "
                "cannot tell which of them this call attends over"
            )
        return (
            f"{where} attended without handing its new keys to the cache first (no cache.update before the attention "
            "call, or two attention calls over one update): the keys it attends over are not the ones evictlayers "
            "holds (a looped pass that reads the cache's keys without writing them, say), so it cannot serve it"
        )

    def real_tokens(self, start: int, count: int) -> torch.Tensor | None:
        """``[B, count]`` bool: which of the step's tokens are real (not padding), from the 2-D mask."""
        if self.step_real is not None:
            return self.step_real
        if self._padding is None:
            return None
        if self._padding.shape[1] < start + count:
            raise ValueError(
                f"attention_mask has {self._padding.shape[1]} columns, but the cache has seen {start} tokens and "
                f"this step adds {count}: pass a mask over every token so far (as generate() does)"
            )
        return self._padding[:, start : start + count].bool()

    # ---- reporting -----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Memory and token counts of the cache of the last forward (see ``EvictionCache.stats``); under
        ``compile=True`` also ``compiled_decode``, which path the one-token steps took
        (``CompiledDecodeForward.path_counts``)."""
        if self.cache is None:
            stats = {"kv_bytes": 0, "state_bytes": 0, "sketch_bytes": 0, "layers": []}
        else:
            stats = self.cache.stats()
        forward = self.model.__dict__.get("forward")
        if isinstance(forward, CompiledDecodeForward):
            stats["compiled_decode"] = forward.path_counts()
        return stats


def _check_kv_sharing(support: ModelSupport, policy: Policy) -> None:
    """Refuse what a KV-sharing layer could not follow: it attends over its source layer's slots as they are,
    so neither keys rotated to their ranks at each step nor a sketch merged into the source's output."""
    reusing = ", ".join(f"{layer.index} <- {layer.source}" for layer in support.reusing)
    if policy.positions == "rolling":
        raise UnsupportedModelError(
            f"model_type={support.model_type!r} shares keys and values between layers (layers {reusing}); "
            "Policy(positions='rolling') rotates each layer's keys at its own step, which a reusing layer does not "
            "see: use positions='original' (the default) for this model"
        )
    if any(p.sketch is not None for p in policy.layer_policies):
        raise ValueError(
            f"model_type={support.model_type!r} shares keys and values between layers (layers {reusing}); a "
            "ClusterSketch merges its evicted tokens into its own layer's output only, so a reusing layer would "
            "attend without them: use a policy without the sketch for this model"
        )


def apply(model: nn.Module, policy: Policy, compile: bool | str = False, tokenizer=None,
          cpu_linear: bool = False) -> EvictionRun:
    """Patch ``model`` to generate with ``policy``'s bounded cache; use as a context manager.

    ``tokenizer``: the model's tokenizer, needed by a policy that ranks the text's sentences
    (``HeavyHitterSelector(..., refine=[SentenceScores()])``; an error names it when missing), and read by
    ``run.compress_context`` for KVzip's repeat prompts; ignored otherwise.

    ``compile=True`` compiles the decode steps (insert, attention with mass, scoring, eviction) over fixed
    slot buffers with ``torch.compile(fullgraph=True)``: a one-token forward of a bounded cache, or of a full
    cache kept in position order (unpadded prompts, on CPU), as one graph of the whole model
    (``hf/compiled_forward.py``), any other step (a padded full cache, a hybrid model, a ClusterSketch)
    layer by layer; prefill stays eager. A policy whose per-step code cannot be traced raises
    ``CompileError``, never falls back. The model's linear layers keep their own forward (BLAS on CPU).

    ``cpu_linear=True`` (with ``compile=True``, on a CPU model; anything else raises ``ValueError``) is an
    opt-in beside eviction: for as long as the patch is active each plain ``nn.Linear`` (lm_head included; one
    with an instance forward of its own, a hook's, keeps it) runs a step's products of at most
    ``linear_cpu.MAX_ROWS`` rows with ``kernels/linear_cpu.py``'s C++ op, which reads the weights in place, and
    every other call (a prefill) with ``F.linear``; exiting gives the layers back their own forward. It is a
    keyword of the patch, not a context of its own: the forwards it sets are traced into the compiled decode
    graph this patch owns, and leave with it. Where the op cannot be built or the CPU has no AVX-512 it warns and
    changes nothing (the logits are BLAS's, as without it). ``python -m benchmarks --only decode`` times the
    compiled rows with and without it (``el-h2o-compiled``, ``el-h2o-compiled+cpu_linear``), so eviction's gain
    and the op's are read apart.

    ``compile="max-autotune"`` compiles the same graphs, and in the whole model's graph also freezes the
    weights (inductor's ``freezing``: under ``torch.no_grad`` or ``torch.inference_mode``, the weights become
    constants, laid out for the kernels inductor picks by timing them; on CPU its C++ GEMM template). The
    first compile takes minutes instead of tens of seconds, the graph holds a second, repacked copy of the
    weights (the model's own stay for prefill), and a step after any parameter was replaced or changed in
    place compiles the graph again (a write through ``.data`` is not seen: exit the patch first).
    ``docs/benchmarks.md`` has what it buys.
    """
    return EvictionRun(model, policy, compile=compile, tokenizer=tokenizer, cpu_linear=cpu_linear)
