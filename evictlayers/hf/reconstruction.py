"""KVzip's context compression through a patched model (``EvictionRun.compress_context``).

KVzip (Kim et al. 2025, arXiv:2505.23416) prefills a context, then asks the model to repeat it: the input
``<repeat prompt> + <context chunk>`` runs, teacher-forced, over the context's cache, and the attention each
cached token gets is its score (``scoring/reconstruction.py``, ``ContextReconstruction``). Here the context
is prefilled into an ``EvictionCache`` whose layers defer eviction (``SlotStore.defer``), each chunk's
reconstruction is a probe of the cache (``EvictionCache.probing``: attends, scores, stores nothing), and then
every layer keeps its best ``budget`` (``EvictionCache.evict_deferred``).

The repeat prompts are the authors' (their code, ``model/wrapper.py``, ``self_task``): before the first
chunk ``"\\n\\nRepeat the previous context exactly."``, before each later one ``"\\n\\nRepeat the part of the
previous context exactly, starting with "`` followed by the previous chunk's last 8 tokens; then the chat
template's turn change into the assistant's answer (the text a chat template puts after a user message with
``add_generation_prompt=True``; without a template, the authors' fallback ``"\\n\\nAnswer: "``), then the
chunk. Chunks of 2,048 tokens by default (the authors score in chunks of 2,000, kvpress of 2,048).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn

from evictlayers.hf.cache import EvictionCache, EvictionHybridLayer
from evictlayers.hf.prompt import check_ids_and_mask, feed_in_chunks, prompt_cache

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_LATER = "\n\nRepeat the part of the previous context exactly, starting with "
CARRIED = 8  # the previous chunk's last tokens after REPEAT_LATER
NO_TEMPLATE_SUFFIX = "\n\nAnswer: "  # the authors' template for a model they have none for
DEFAULT_CHUNK = 2048
_MARKER = "EVICTLAYERSCONTEXTMARKER"  # a user message whose text locates what the template puts after it


@dataclass(frozen=True)
class RepeatPrompts:
    """The token ids before each reconstructed chunk: ``first`` (then ``suffix``) before the first chunk; before a
    later one ``later``, the previous chunk's last ``carried`` tokens, then ``suffix`` (``later=None``: ``first``
    and ``suffix`` before every chunk)."""

    first: tuple[int, ...]
    suffix: tuple[int, ...] = ()
    later: tuple[int, ...] | None = None
    carried: int = CARRIED

    def before(self, index: int, previous: torch.Tensor) -> torch.Tensor:
        """``[P]`` the ids before chunk ``index``; ``previous``: the previous chunk's ids (unused for the first)."""
        device = previous.device
        if index == 0 or self.later is None:
            return torch.tensor([*self.first, *self.suffix], dtype=torch.long, device=device)
        tail = previous[-self.carried:] if self.carried else previous[:0]
        return torch.cat([
            torch.tensor(self.later, dtype=torch.long, device=device), tail.long(),
            torch.tensor(self.suffix, dtype=torch.long, device=device),
        ])


def _encode(tokenizer, text: str) -> tuple[int, ...]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    return tuple(int(i) for i in ids)


def generation_suffix(tokenizer) -> str:
    """The text a chat template puts after a user message to open the assistant's answer (``apply_chat_template``
    with ``add_generation_prompt=True``, thinking off where the template has it); ``NO_TEMPLATE_SUFFIX`` for a
    tokenizer without a template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARKER}], add_generation_prompt=True, tokenize=False, enable_thinking=False,
        )
        if isinstance(text, str) and _MARKER in text:
            return text.split(_MARKER, 1)[1]
    return NO_TEMPLATE_SUFFIX


def repeat_prompts(tokenizer) -> RepeatPrompts:
    """KVzip's repeat prompts in ``tokenizer``'s ids (the module docstring has the wording)."""
    return RepeatPrompts(
        first=_encode(tokenizer, REPEAT_FIRST), later=_encode(tokenizer, REPEAT_LATER),
        suffix=_encode(tokenizer, generation_suffix(tokenizer)),
    )


def _fixed_prompt(repeat_prompt) -> RepeatPrompts:
    """The caller's ``repeat_prompt`` ids (a list of ints, ``[P]`` or ``[1, P]`` tensor) before every chunk."""
    ids = repeat_prompt
    if isinstance(ids, torch.Tensor):
        not_ids = ids.is_floating_point() or ids.dtype == torch.bool
        if not_ids or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise ValueError(
                f"compress_context(repeat_prompt=...): expected token ids, [P] or [1, P]; got a {ids.dtype} tensor "
                f"of shape {tuple(ids.shape)}"
            )
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(
            f"compress_context(repeat_prompt={repeat_prompt!r}): expected token ids (a list of ints or a tensor)"
        )
    if not ids:
        raise ValueError("compress_context(repeat_prompt=[]): the repeat prompt needs at least one token")
    return RepeatPrompts(first=tuple(ids))


def probe_inputs(context: torch.Tensor, real: torch.Tensor, prompts: RepeatPrompts, chunk: int, pad: int = 0):
    """Yield ``(ids [B, L], real [B, L])`` per chunk: each row's repeat prompt then its next ``chunk`` real context
    tokens, left-padded to the longest row; a row whose context has no tokens left is all padding."""
    rows = [context[b][real[b]] for b in range(context.shape[0])]
    for index in range(math.ceil(max(len(r) for r in rows) / chunk)):
        start = index * chunk
        inputs = [
            torch.cat([prompts.before(index, r[max(start - chunk, 0) : start]), r[start : start + chunk]])
            if len(r) > start else None
            for r in rows
        ]
        width = max(len(i) for i in inputs if i is not None)
        ids = torch.full((len(rows), width), pad, dtype=torch.long, device=context.device)
        mask = torch.zeros((len(rows), width), dtype=torch.bool, device=context.device)
        for b, row in enumerate(inputs):
            if row is not None:
                ids[b, width - len(row) :] = row
                mask[b, width - len(row) :] = True
        yield ids, mask


def _check_arguments(input_ids, attention_mask, chunk, prefill_chunk, room) -> None:
    check_ids_and_mask("compress_context", "context", input_ids, attention_mask)
    for name, value in (("chunk", chunk), ("prefill_chunk", prefill_chunk)):
        if value is None and name == "prefill_chunk":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"compress_context({name}={value!r}): expected an int number of tokens >= 1")
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"compress_context(room={room!r}): expected an int number of tokens per head >= 0")


def _check_run(run) -> None:
    """Refuse, before any forward, what a probe cannot serve: a policy whose scorers do not observe probes, and a
    model whose other layers hold recurrent state (a probe's forward would update it)."""
    for policy in run.policy.layer_policies:
        if not policy.observes_probes:
            raise ValueError(
                f"compress_context scores the context by probes, which {' '.join(repr(policy).split())} cannot "
                "observe: use a policy whose selectors score by probes (ContextReconstruction, the kvzip recipe)"
            )
    support = run.support
    recurrent = sorted(
        [index for index, (kind, _) in support.carried.items() if kind in ("conv", "linear_attention")]
        + [layer.index for layer in support.attention if layer.recurrent_states is not None]
    )
    if recurrent:
        raise ValueError(
            f"model_type={support.model_type!r}: layers {recurrent} hold recurrent state, which the reconstruction's "
            "forwards would advance past the context; compress_context serves attention-only models"
        )


def _forward_options(model: nn.Module) -> tuple[bool, bool, str]:
    """Whether the model's forward takes ``position_ids`` and ``logits_to_keep``, and its cache argument's name
    (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    parameters = inspect.signature(model.forward).parameters
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    return "position_ids" in parameters, "logits_to_keep" in parameters, cache_name


def compress_context(
    run, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, repeat_prompt=None,
    chunk: int = DEFAULT_CHUNK, prefill_chunk: int | None = None, room: int = 0, cache: EvictionCache | None = None,
) -> EvictionCache:
    """``EvictionRun.compress_context`` (which documents it)."""
    _check_arguments(input_ids, attention_mask, chunk, prefill_chunk, room)
    _check_run(run)
    if repeat_prompt is not None:
        prompts = _fixed_prompt(repeat_prompt)
    elif run.tokenizer is not None:
        prompts = repeat_prompts(run.tokenizer)
    else:
        raise ValueError(
            "compress_context needs the repeat prompt's token ids: apply the policy with the model's tokenizer "
            "(evictlayers.apply(model, policy, tokenizer=tokenizer): KVzip's prompts) or pass repeat_prompt=ids"
        )
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    lengths = real.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError(f"compress_context: row {int((lengths == 0).nonzero()[0])} of the context has no real token")
    padded = not bool(real.all())
    takes_positions, takes_logits_to_keep, cache_name = _forward_options(run.model)
    if padded and not takes_positions:
        raise ValueError(
            f"compress_context: the context is padded, and {type(run.model).__name__}.forward takes no position_ids "
            "to place each row's reconstruction after its own context; compress one row at a time"
        )
    cache = prompt_cache(run, "compress_context", cache, lengths if padded else input_ids.shape[1])
    if any(isinstance(layer, EvictionHybridLayer) for layer in cache.layers):
        raise ValueError(
            "compress_context: this cache holds recurrent state beside attention, which a probe would advance"
        )
    extra = {"logits_to_keep": 1} if takes_logits_to_keep else {}
    cache.defer_eviction()
    positions = (real.long().cumsum(1) - 1).clamp(min=0) if padded else None
    # the context, every token held
    feed_in_chunks(run.model, cache, input_ids, attention_mask, prefill_chunk or input_ids.shape[1], positions,
                   cache_name=cache_name, **extra)
    with torch.no_grad(), cache.probing():  # the reconstruction, chunk by chunk: scored, never stored
        for ids, probe_real in probe_inputs(input_ids, real, prompts, chunk):
            inputs = {
                "input_ids": ids, "attention_mask": torch.cat([real, probe_real], 1).long(),
                cache_name: cache, "use_cache": True, **extra,
            }
            if padded:  # each row's reconstruction follows its own context
                inputs["position_ids"] = lengths[:, None] + (probe_real.long().cumsum(1) - 1).clamp(min=0)
            run.model(**inputs)
    cache.evict_deferred()
    cache.add_room(room)
    return cache
