"""Prefill once, tile the cache to a batch, decode step by step as ``generate()`` does.

Prefilling 8 x 8k tokens for every configuration would take far too long on a CPU, so each cache
family is prefilled once at batch 1 and tiled with the cache's own ``reorder_cache`` (every row a copy
of row 0). The decode loop feeds one token per row with the attention mask over every token so far and
explicit position ids, through ``prepare_inputs_for_generation`` like ``generate()``: that is where a
static cache gets its fixed-size 4-D mask, outside the compiled forward.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from benchmarks.common import Context, recipe


@contextmanager
def attention_implementation(model, name: str):
    """Run the unmodified model with attention ``name`` (``eager``/``sdpa``), restoring the previous one."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def prefill(model, ids: torch.Tensor, cache=None):
    """Run the prompt through ``model``; returns ``(cache, next token [1, 1])``.

    Only the last position's logits are computed (``logits_to_keep=1``), as ``generate()`` does:
    full-vocabulary logits of an 8k prompt alone would take 1.6 GB.
    """
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def tiled(cache, batch: int, keep=()):
    """A copy of a batch-1 ``cache`` holding ``batch`` identical rows; the source is left untouched.

    ``keep`` are objects the copy must share rather than duplicate (an evictlayers policy, with the policy
    its sliding-window layers run: a compiled decode step is specialised on the policy object, so a
    duplicate would recompile).
    """
    shared = [obj for kept in keep for obj in getattr(kept, "layer_policies", (kept,))]
    duplicate = copy.deepcopy(cache, memo={id(obj): obj for obj in shared})
    if batch > 1:
        duplicate.reorder_cache(torch.zeros(batch, dtype=torch.long))
    return duplicate


def static_copy(model, source, batch: int, max_cache_len: int):
    """A ``StaticCache`` of ``max_cache_len`` slots holding ``source``'s tokens (a batch-1 DynamicCache)
    in each of ``batch`` rows: the keys/values written into the static buffers, which keep their
    addresses (``mark_static_address``) for the compiled forward.

    A sliding-window layer (Gemma 3) holds the last ``window - 1`` tokens in the dynamic cache and the
    last ``window`` in order in the static one, which, once full, rolls its first slot out before it
    writes the next token: the held tokens go right-aligned, and the first slot is dropped unread."""
    from transformers import StaticCache

    first = source.layers[0].keys
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    cache.early_initialization(batch, first.shape[1], first.shape[-1], first.dtype, first.device)
    seen = source.get_seq_length()
    for layer, filled in zip(cache.layers, source.layers, strict=True):
        held, slots = filled.keys.shape[-2], layer.keys.shape[-2]
        start = slots - held if seen >= slots else 0  # seen < slots: every token, from slot 0
        layer.keys[:, :, start : start + held].copy_(filled.keys.expand(batch, -1, -1, -1))
        layer.values[:, :, start : start + held].copy_(filled.values.expand(batch, -1, -1, -1))
        layer.cumulative_length.fill_(seen)
        if hasattr(layer, "cumulative_length_int"):  # StaticSlidingWindowLayer's Python-side count
            layer.cumulative_length_int = seen
    return cache


def kv_resident_bytes(cache) -> int:
    """Bytes of the key/value tensors a cache holds, which is what a decode step reads: every token of
    a DynamicCache, every slot of a StaticCache or of an evictlayers slot store (as its storage holds
    them: codes, scales and zero points for int4, not the dense copy ``layer.keys`` dequantises)."""
    return sum(
        layer.store.kv_bytes() if hasattr(layer, "store") else layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers if layer.keys is not None
    )


class DecodeLoop:
    """One call = one greedy decode step of every row, as ``generate()`` would run it.

    Args:
        forward: the model's ``__call__`` or its compiled version.
        token: ``[B, 1]`` the first token to feed; seen: prompt tokens already in the cache.
        total_steps: how many steps will run (sizes the attention mask once; each step takes a view).

    The mask has one column more than the last step reads: a view of all its columns would be contiguous
    where every earlier one is not, and a compiled forward guards on that (at batch > 1) and compiles again
    at the last step.
    """

    def __init__(self, model, forward, cache, token: torch.Tensor, seen: int, total_steps: int):
        self.model, self.forward, self.cache = model, forward, cache
        self.token, self.seen = token, seen
        self.mask = torch.ones(token.shape[0], seen + total_steps + 1, dtype=torch.long)

    def __call__(self) -> None:
        self.seen += 1
        inputs = self.model.prepare_inputs_for_generation(
            self.token,
            next_sequence_length=1,
            past_key_values=self.cache,
            attention_mask=self.mask[:, : self.seen],
            position_ids=torch.full((self.token.shape[0], 1), self.seen - 1),
            use_cache=True,
        )
        out = self.forward(**inputs)
        self.token = out.logits[:, -1].argmax(-1, keepdim=True)


@dataclass
class Prefilled:
    """A family's batch-1 prefill: the cache, the first token to feed, and the policy (evictlayers)."""

    cache: object
    token: torch.Tensor
    prompt: int
    policy: object | None


class PrefillMemo:
    """The prefill of one (family, prompt) at a time, so a finished family's cache is freed."""

    def __init__(self, context: Context):
        self.context = context
        self.key, self.value = None, None

    def get(self, family: str, prompt: int) -> Prefilled:
        key = (family, prompt)
        if key != self.key:
            if self.key is None or family != self.key[0]:
                # a new family starts from an empty compile cache: the recompiles of the previous family
                # (new batch sizes, new slot counts) must not use up dynamo's recompile limit, past which
                # evictlayers' fullgraph decode step fails and the HF forward silently runs eagerly
                torch._dynamo.reset()
            self.value = None  # free the previous cache before building the next
            self.value, self.key = prefill_family(self.context, family, prompt), key
        return self.value


def prefill_family(context: Context, family: str, prompt: int) -> Prefilled:
    """Prefill a PG-19 prompt at batch 1: ``hf`` (the unmodified model, SDPA) or an evictlayers recipe."""
    model = context.subject.model
    ids = context.subject.prompt(prompt)
    with torch.inference_mode():
        if family == "hf":
            with attention_implementation(model, "sdpa"):
                cache, token = prefill(model, ids)
            return Prefilled(cache, token, prompt, None)
        import evictlayers as el

        policy = recipe(family)
        with el.apply(model, policy) as run:
            cache, token = prefill(model, ids, run.new_cache())
        return Prefilled(cache, token, prompt, policy)
