"""The attention function transformers calls while ``evictlayers.apply`` is active.

Registered in ``AttentionInterface`` under ``ATTENTION_NAME`` together with a mask function of the
same name: transformers would otherwise silently hand over no causal mask at prefill. The mask
function builds nothing, because the slot store masks by each slot's original position (slots are
unordered after eviction, so an index-based causal mask would be wrong).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from evictlayers.compose import Policy, SlotStore
from evictlayers.compose.shared_attention import attend_shared
from evictlayers.hf.support import REFUSED_KEYWORDS, UnsupportedModelError, original_class

ATTENTION_NAME = "evictlayers"
FULL, ROLLING_FULL = Policy(), Policy(positions="rolling")  # what a call without a cache attends with


def no_index_mask(*args, **kwargs) -> None:
    """Mask function paired with the attention function: masking happens by slot position instead."""
    return None


def evicting_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``(attn_output [B, Q, H_q, D_v], None)`` as transformers' attention functions return."""
    run = getattr(module, "_evictlayers_run", None)
    if run is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} reached {type(module).__name__}, which "
            "evictlayers.apply did not patch; use `with evictlayers.apply(model, policy):`"
        )
    if dropout and module.training:
        raise ValueError("evictlayers runs inference only: attention dropout is not supported (call model.eval())")
    _refuse_unserved(run, module, kwargs)
    if run.recording:
        # the rolling probe: each layer's queries and keys are recorded and its output is zero, so what
        # the next layer receives does not depend on positions and every layer can be checked alone
        run.record(module.layer_idx, query, key)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is not None and run.replaced_implementation == "sdpa":
        raise UnsupportedModelError(
            f"{_where(run, module)} soft-caps its attention logits, which transformers' sdpa attention does not "
            "apply (older releases ignore it): the unmodified model is not defined; load the model with "
            "attn_implementation='eager'"
        )
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # learned sinks: GPT-OSS's s_aux, others' sinks
    options = {"scaling": scaling, "softcap": softcap, "sliding_window": sliding_window}
    source = run.support.source_of(module.layer_idx)
    if source is not None and run.cache is not None:
        out = _attend_reused(run, module, source, query, key, value, options, sinks)
        return out.transpose(1, 2).contiguous(), None
    layer = run.staged_layer(module.layer_idx)
    if layer is not None:
        staged_key, staged_value = layer.staged
        tiles, expanded = 1, False
        if key is not staged_key or value is not staged_value:
            if torch.compiler.is_compiling():
                # a compiled decode step follows the eager prefill of the same cache, which compared the
                # keys by value (a comparison a graph cannot branch on)
                known = layer.head_tiles
                tiles = known if known is not None and key.shape[1] == known * staged_key.shape[1] else None
                expanded = bool(layer.expands_latent) and key.shape[2] == staged_key.shape[2]
            else:
                tiles = layer.head_tiles = _tiles(staged_key, staged_value, key, value)
                expanded = layer.expands_latent = tiles is None and _expands_latent(module, layer.staged, key, value)
        if tiles is None and not expanded:
            # the slot store attends over what the cache received (or its per-token expansion); a model
            # that changes the keys otherwise after cache.update would be served other keys
            raise UnsupportedModelError(
                f"{_where(run, module)} changes its keys or values between the cache update and the attention "
                "call in a way evictlayers cannot follow (neither its own per-token expansion of a cached latent, "
                "expand_kv, nor the cached heads repeated), so the keys evictlayers holds are not the ones it "
                "attends over"
            )
        real = run.real_tokens(layer.store.seq_len, query.shape[2])
        if expanded:
            # MLA: the cache received each token's compressed latent and the model expanded exactly those
            # tokens into per-head keys (rotary part included) and values; the expansion is per token, so
            # keeping the expanded keys and values is keeping the latents, at H * (D_k + D_v) per token
            out = layer.attend(
                query, real, key=key, value=value, **options, sinks=sinks, sentence_ends=run.sentence_ends
            )
        else:
            if tiles > 1:
                # query head e * H_kv + h attends over cached head h (JetMoE repeats the cached heads once per
                # expert it routes to); grouped in the store's order, query head h * tiles + e reads head h
                query = _by_cached_head(query, tiles)
                sinks = None if sinks is None else _by_cached_head(sinks, tiles)
            out = layer.attend(query, real, **options, sinks=sinks, sentence_ends=run.sentence_ends)
            if tiles > 1:
                out = _by_tile(out, tiles)
    else:
        # no cache (use_cache=False): a full slot store used for this call only, so positions, rotation
        # and masking are the ones every cached step uses
        table = run.rotary[module.layer_idx] if run.rotary is not None else None
        store = SlotStore(ROLLING_FULL if table is not None else FULL, module.layer_idx, rotary=table)
        out = store.step(query, key, value, run.real_tokens(0, query.shape[2]), **options, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _attend_reused(run, module: torch.nn.Module, source: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, options: dict, sinks: torch.Tensor | None) -> torch.Tensor:
    """A KV-sharing layer's attention (``compose/shared_attention.py``): over what its source layer attended
    over in this forward, provided the keys it was handed are the ones the source's cache update returned."""
    layer = run.cache.layers[source]
    if layer.returned is None or key is not layer.returned[0] or value is not layer.returned[1]:
        raise UnsupportedModelError(
            f"{_where(run, module)} reuses layer {source}'s keys and values (KV sharing), but the keys it attends "
            f"over are not the ones layer {source}'s cache update returned in this forward, so evictlayers cannot "
            "tell which tokens they are"
        )
    if layer.store.attended is None:
        raise RuntimeError(
            f"evictlayers: layer {module.layer_idx} reuses layer {source}'s keys and values, but layer {source} "
            "kept nothing of its step (did it attend through evictlayers in this forward?)"
        )
    out = attend_shared(layer.store.attended, query, **options, sinks=sinks)
    if module.layer_idx == run.support.last_reader(source):  # no later layer reads it: let it go
        layer.store.attended = None
        layer.returned = None
    return out


def _tiles(staged_key: torch.Tensor, staged_value: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int | None:
    """How many times ``key``/``value`` ``[B, H, T, D]`` repeat the staged heads whole along the head dim
    (``staged.repeat(1, n, 1, 1)``; 1 for a copy), or ``None`` where they are anything else. Compared by
    value: attention over such keys is attention over the staged heads, whatever produced them."""
    heads = staged_key.shape[1]
    if key.shape[1] % heads or key.shape[0::2] != staged_key.shape[0::2]:
        return None
    if value.shape[0::2] != staged_value.shape[0::2]:
        return None
    tiles = key.shape[1] // heads
    if value.shape[1] != tiles * staged_value.shape[1]:
        return None
    if torch.equal(key, staged_key.repeat(1, tiles, 1, 1)) and torch.equal(value, staged_value.repeat(1, tiles, 1, 1)):
        return tiles
    return None


def _expands_latent(module: torch.nn.Module, staged: tuple[torch.Tensor, torch.Tensor], key: torch.Tensor,
                    value: torch.Tensor) -> bool:
    """Whether ``key``/``value`` are the module's ``expand_kv`` of the staged latent and rotary key (the
    method transformers' MLA attentions expand their cached latents with, token by token), compared by value."""
    expand = getattr(module, "expand_kv", None)
    if not callable(expand) or key.shape[0::2] != staged[0].shape[0::2]:
        return False
    with torch.no_grad():
        expanded_key, expanded_value = expand(*staged)
    return torch.equal(expanded_key, key) and torch.equal(expanded_value, value)


def _by_cached_head(heads_first: torch.Tensor, tiles: int) -> torch.Tensor:
    """Query heads (dim 1, or dim 0 of per-head sinks) from tile-major ``e * H + h`` to head-major ``h * tiles + e``."""
    dim = 0 if heads_first.dim() == 1 else 1
    shape = heads_first.shape
    split = (*shape[:dim], tiles, shape[dim] // tiles, *shape[dim + 1 :])
    return heads_first.reshape(split).transpose(dim, dim + 1).reshape(shape)


def _by_tile(out: torch.Tensor, tiles: int) -> torch.Tensor:
    """``_by_cached_head`` undone on the output ``[B, H_q, Q, D_v]``."""
    batch, heads, *rest = out.shape
    return out.reshape(batch, heads // tiles, tiles, *rest).transpose(1, 2).reshape(out.shape)


def _refuse_unserved(run, module: torch.nn.Module, kwargs: dict) -> None:
    """Arguments of this call that would change the result and that evictlayers does not implement
    (``model_support`` refuses the models whose attention passes them; this catches them per call)."""
    if kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"{_where(run, module)}: the attention call is not causal (is_causal=False)")
    if kwargs.get("output_attentions"):
        raise UnsupportedModelError(
            f"{_where(run, module)}: output_attentions=True asks for the attention weights over the whole "
            "sequence, which an eviction cache does not hold; run without output_attentions"
        )
    packed = [name for name in ("cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(name) is not None]
    if packed:
        raise UnsupportedModelError(
            f"{_where(run, module)}: packed sequences ({', '.join(packed)}) are not supported; pad instead"
        )
    for name, meaning in REFUSED_KEYWORDS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{_where(run, module)}: the attention call passes {name}= ({meaning}), which evictlayers does "
                "not implement"
            )


def _where(run, module: torch.nn.Module) -> str:
    """``model_type=..., <Class> (layer i)``: where a refusal at run time happened."""
    return f"model_type={run.support.model_type!r}, {original_class(module).__name__} (layer {module.layer_idx})"


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, evicting_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_index_mask)
