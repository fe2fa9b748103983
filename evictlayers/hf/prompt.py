"""A prompt fed in chunks, with a float budget that stays a fraction of the whole prompt.

A float budget is resolved at a cache's first forward from the prompt's length. When the prompt comes in chunks
(``generate(..., prefill_chunk_size=N)``, ``EvictionRun.prefill``), the cache is told the whole prompt's length
first (``EvictionCache.declare_prompt``), so every layer resolves the budget one forward of the prompt would; a
second chunk of a prompt of unknown length under a float budget is refused rather than served with the first
chunk's fraction. ``EvictionRun`` wraps ``generate`` to read each call's prompt (``generate_prompt``) and asks
``govern_prompt`` before every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from evictlayers.hf.cache import ROLLBACK_REFUSED, EvictionCache


@dataclass(frozen=True)
class GeneratePrompt:
    """What a ``generate()`` call under the patch says about its prompt: the padding mask it runs with
    (``[B, width]``, the one passed or the one transformers infers from the pad token), ``None`` where the call
    continues a cache that already holds tokens (nothing to declare)."""

    mask: torch.Tensor | None

    @property
    def width(self) -> int | None:
        return None if self.mask is None else self.mask.shape[1]

    def expanded(self, batch: int) -> torch.Tensor:
        """The mask of a forward of ``batch`` rows: generate repeats each row for its beams and returned
        sequences (``repeat_interleave``) before the first forward."""
        rows = self.mask.shape[0]
        if batch % rows:
            raise RuntimeError(
                f"evictlayers: generate() was given {rows} prompts but its first forward has {batch} rows"
            )
        return self.mask.repeat_interleave(batch // rows, dim=0) if batch != rows else self.mask


def generate_prompt(model: nn.Module, args: tuple, kwargs: dict) -> GeneratePrompt:
    """The prompt of ``model.generate(*args, **kwargs)``, read from its arguments as ``generate()`` reads them."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if isinstance(cache, Cache) and cache.get_seq_length() > 0:
        return GeneratePrompt(None)  # a continuation: the cache's budget was fixed by its own prompt
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    embeds, mask = kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    inputs = embeds if embeds is not None else ids
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2 or inputs.shape[1] == 0:
        return GeneratePrompt(None)  # no prompt to read (generate starts from its BOS token)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == inputs.shape[1]:
        return GeneratePrompt(mask.bool())
    mask = torch.ones(inputs.shape[:2], dtype=torch.bool, device=inputs.device)
    if embeds is None and not inputs.is_floating_point():
        # transformers' rule: padding is inferred from the pad token where the ids hold one that is no EOS
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
        pads = [] if pad is None else torch.as_tensor(pad).flatten().tolist()
        eos = [] if eos is None else torch.as_tensor(eos).flatten().tolist()
        if len(pads) == 1 and pads[0] not in eos and bool((inputs == pads[0]).any()):
            mask = inputs != pads[0]
    return GeneratePrompt(mask)


#: ``generate()`` arguments of the modes that roll the cache back after a draft (``EvictionLayer.crop``)
ROLLBACK_ARGUMENTS = ("assistant_model", "prompt_lookup_num_tokens", "dola_layers")


def refuse_rollback(kwargs: dict) -> None:
    """Refuse a ``generate()`` call that would roll the cache back, before it runs: transformers refuses such a
    cache in its own words in some releases and calls ``crop`` in others."""
    config = kwargs.get("generation_config")
    asked = [name for name in ROLLBACK_ARGUMENTS
             if kwargs.get(name) is not None or getattr(config, name, None) is not None]
    if asked:
        raise NotImplementedError(f"{ROLLBACK_REFUSED} (generate() was given {', '.join(asked)})")


def govern_prompt(cache: EvictionCache, mask: torch.Tensor | None, batch: int, tokens: int,
                  call: GeneratePrompt | None, fraction_budget: bool, budget) -> bool:
    """Keep a float budget a fraction of the whole prompt, however the prompt arrives (before a forward of
    ``tokens`` tokens per row on ``cache``); returns whether the forward is a chunk of a declared prompt.

    The prompt phase of a cache lasts from its first forward to its first one-token forward. A forward of
    several tokens on a cache that already holds tokens and has not decoded yet is therefore a second
    chunk of the prompt; after a one-token forward (or past a declared prompt) a multi-token forward
    continues the cache (a second turn, a question after a compressed context) and is left alone.

    - Inside ``generate()``, whose prompt is known (``GeneratePrompt``), a first forward shorter than the
      prompt (``prefill_chunk_size``) declares the prompt's real tokens per row to the cache
      (``EvictionCache.declare_prompt``, left padding excluded as in one forward), so every layer resolves
      its budget at the first chunk as one forward of the prompt would; a ``generate()`` given a cache that
      already holds tokens continues it.
    - Outside it, a second chunk of a prompt whose length the cache was not told, under a float budget,
      raises ``ValueError``: its budget was resolved from the first chunk alone. An ``int`` budget, a
      declared length (``run.new_cache(prompt_len=...)``) or ``run.prefill`` are the ways to chunk a
      prompt.

    ``call``: the prompt of the ``generate()`` call under way (``None`` outside one); ``fraction_budget``: whether
    a layer's policy has a float budget (``budget``, named in the refusal).
    """
    if cache.decoded:
        return False
    held = cache.get_seq_length()
    if held == 0:
        if call is not None and call.mask is not None and tokens < call.width and not cache.prompt_declared:
            expected = call.expanded(batch)
            if mask is not None and not torch.equal(mask[:, :tokens].bool(), expected[:, :tokens].to(mask.device)):
                raise RuntimeError(
                    "evictlayers: generate()'s first prompt chunk runs with another padding mask than the one "
                    "read from its arguments; pass attention_mask= to generate()"
                )
            cache.declare_prompt(expected.sum(1))
        return cache.prompt_declared
    if cache.in_prompt:
        if call is not None and call.width is not None and held >= call.width:
            raise RuntimeError(
                f"evictlayers: generate() has fed its {call.width}-token prompt, but the cache still waits for "
                "prompt tokens: the prompt lengths read from its arguments disagree with the padding mask it "
                "ran with; pass attention_mask= to generate()"
            )
        return True
    if tokens == 1:
        cache.decoded = True
        return False
    if cache.prompt_declared or call is not None or not fraction_budget:
        return False
    raise ValueError(
        f"evictlayers: this forward feeds {tokens} tokens per row to a cache that already holds {held} and has "
        "not decoded yet, so it is a second chunk of the prompt; the policy's float budget "
        f"(budget={budget}) is a fraction of the whole prompt, but the cache resolved it from "
        "the first chunk alone. Prefill in chunks with run.prefill(input_ids, attention_mask, chunk=N) or "
        "model.generate(..., prefill_chunk_size=N), tell the cache the prompt's length "
        "(run.new_cache(prompt_len=attention_mask.sum(1))), or use an int budget (tokens per head)"
    )


def check_ids_and_mask(owner: str, what: str, input_ids, attention_mask) -> None:
    """Refuse ``input_ids`` that are not a non-empty ``[batch, tokens]`` tensor of token ids, and a padding mask of
    another shape; ``owner`` (``"run.prefill"``) and ``what`` (``"prompt"``) name them in the message."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(
            f"{owner}(input_ids): expected a [batch, tokens] tensor of token ids, got "
            f"{type(input_ids).__name__}{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError(f"{owner}(input_ids): the {what} is empty")
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape
    ):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
        raise ValueError(
            f"{owner}(attention_mask): expected the {what}'s [batch, tokens] = {tuple(input_ids.shape)} "
            f"padding mask, got {shape}"
        )


def check_prefill_arguments(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, chunk: int,
                            position_ids: torch.Tensor | None) -> int | torch.Tensor:
    """Refuse what ``EvictionRun.prefill`` cannot take; return the prompt's real tokens (an ``int``, or ``[B]``
    from the mask)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"run.prefill(chunk={chunk!r}): expected an int number of tokens per forward")
    if chunk < 1:
        raise ValueError(f"run.prefill(chunk={chunk}): a chunk holds at least 1 token")
    check_ids_and_mask("run.prefill", "prompt", input_ids, attention_mask)
    width = input_ids.shape[1]
    if position_ids is not None and (
        not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != width
    ):
        raise ValueError(f"run.prefill(position_ids): expected positions for the prompt's {width} tokens")
    return width if attention_mask is None else attention_mask.bool().sum(1)


def prompt_cache(run, owner: str, cache: EvictionCache | None, prompt_len: int | torch.Tensor) -> EvictionCache:
    """The cache a prompt of ``prompt_len`` real tokens (an ``int``, or ``[B]``) is fed into: a new one from ``run``,
    or the caller's ``cache``, which must be an empty evictlayers cache (declared ``prompt_len`` long if it was
    not); ``owner`` (``"run.prefill"``) names the call in the refusal."""
    if cache is None:
        return run.new_cache(prompt_len=prompt_len)
    if not isinstance(cache, EvictionCache) or cache.get_seq_length() > 0:
        raise ValueError(
            f"{owner}(cache=...): expected an empty evictlayers cache (run.new_cache()), got a "
            f"{type(cache).__name__} holding {cache.get_seq_length() if isinstance(cache, Cache) else 0} tokens"
        )
    if not cache.prompt_declared:
        cache.declare_prompt(prompt_len)
    return cache


def feed_in_chunks(model: nn.Module, cache: EvictionCache, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None, chunk: int, position_ids: torch.Tensor | None,
                   cache_name: str = "past_key_values", **extra):
    """The prompt through ``model`` ``chunk`` tokens at a time into ``cache`` (passed as ``cache_name``), under
    ``torch.no_grad``, with ``extra`` keywords in every forward; the last chunk's output."""
    width = input_ids.shape[1]
    out = None
    with torch.no_grad():
        for start in range(0, width, chunk):
            stop = min(start + chunk, width)
            inputs = {"input_ids": input_ids[:, start:stop], cache_name: cache, "use_cache": True, **extra}
            if attention_mask is not None:
                inputs["attention_mask"] = attention_mask[:, :stop]
            if position_ids is not None:
                inputs["position_ids"] = position_ids[..., start:stop]
            out = model(**inputs)
    return out
