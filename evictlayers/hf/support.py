"""Whether evictlayers can serve a model's attention, decided from the model itself.

No list of model types: a model is served when it is decoder-only, keeps a per-token key/value cache
that transformers builds from its config (``DynamicCache(config=...)``), and every attention layer of
that cache is computed by one module that calls transformers' attention interface with a
``layer_idx``. Whatever that call passes which changes the result is honoured (scaling, soft-capping,
sliding windows, learned attention sinks, key and value head dims that differ) or the model is refused
here, at ``apply`` time, naming the model type, the layer and the reason: never silent full attention.

Recurrent and linear-attention layers of hybrid models (Mamba, gated delta nets, short convolutions)
keep their state in the model's own cache layer objects, which the eviction cache carries untouched.

Keys and values that the model changes between the cache update and the attention call are served where
the attention function can tell, per call, that they are the cached heads repeated (JetMoE repeats them
once per expert) or the module's own per-token ``expand_kv`` of a cached latent (MLA: DeepSeek V2/V3,
MiniCPM3, GLM-4-MoE-Lite, Kimi; the slot store then keeps the expanded per-head keys and values, larger per
token than the latent); anything else is refused at that call (``hf/attention.py``).

KV sharing (Gemma 3n, Gemma 4's small models): a layer that reuses an earlier layer's keys and values
(``kv_sharing_modes`` "reuse") holds no cache of its own; it attends over exactly the tokens its source
layer attended over in the same forward (before the source evicts), as transformers hands it the keys
its source's cache update returned. The source's policy alone decides what is kept.

One attention module serving several cache layers (Zamba's shared block, with no ``layer_idx`` of its own;
Dory's looped section, whose later passes write to appended copies of its cache layers) attends over the
cache layer its call's update staged (``EvictionRun.staged_layer``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from dataclasses import dataclass

from torch import nn

from transformers.cache_utils import get_layer_types_and_kwargs


# DeepSeek V4's compressed attention layers, as transformers' DeepseekV4HCACache / DeepseekV4CSACache hold them
COMPRESSED_ATTENTION = (
    "compressed attention (DeepSeek V4's HCA and CSA): the layer attends over a sliding window of recent tokens "
    "plus entries a learned compressor builds from every block of compress_rate consecutive tokens (CSA with an "
    "indexer choosing among them); its cache holds those block entries and a buffer of the next block's tokens, "
    "not a key per token, so there is no token for an eviction policy to keep or drop beyond the window: "
    "evictlayers evicts per-token keys only"
)


class UnsupportedModelError(TypeError):
    """The model's attention cannot be served by evictlayers; the message names the model, layer and reason."""


# cache layer types (transformers' ``layer_types``) and what evictlayers does with each
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding"}
HYBRID_LAYER_TYPES = {"hybrid", "hybrid_sliding"}  # recurrent state and attention keys in one layer
CARRIED_LAYER_TYPES = {"conv", "linear_attention"}  # recurrent state only: carried untouched
EMPTY_LAYER_TYPES = {"dummy"}  # layers without attention (MoE/MLP-only blocks)

# the attribute names transformers gives a decoder layer's cross-attention module (BART's and Whisper's
# encoder_attn, BERT's crossattention, Mllama's cross_attn)
CROSS_ATTENTION_NAMES = {"encoder_attn", "crossattention", "cross_attn", "cross_attention", "encoder_attention"}

# keywords of the attention-interface call that evictlayers honours (or that cannot change the result:
# the mask is rebuilt from slot positions, positions are already in the rotated keys)
HONOURED_KEYWORDS = {
    "scaling", "dropout", "sliding_window", "softcap", "attention_mask", "position_ids", "is_causal",
    "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "s_aux", "sinks",  # learned attention sinks: kernels/attention_sinks.py
}
# keywords that change the result and that evictlayers does not implement, with what they mean (refused
# when a model's attention call passes them: at apply time from its source, per call at run time)
REFUSED_KEYWORDS = {
    "indices": "sparse attention over indexer-selected keys",
    "block_indices": "block-sparse attention",
    "position_bias": "an additive position bias on the logits",
}


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer evictlayers serves: its module and the window its cache may hold.

    Attributes:
        index: the layer's index in the model's cache (``module.layer_idx``).
        module: the attention module whose attention call evictlayers receives.
        window: the sliding window of a sliding-window layer (a query sees itself and the ``window - 1``
            tokens before it), ``None`` for a full-attention layer.
        recurrent_states: for a hybrid layer (recurrent state and attention keys in one cache layer), how
            many recurrent states it carries; ``None`` for a pure attention layer.
        chunk: the chunk of a chunked-attention layer (Llama 4: a query sees the tokens of its own chunk of
            ``chunk`` positions only), ``None`` elsewhere.
    """

    index: int
    module: nn.Module
    window: int | None
    recurrent_states: int | None = None
    chunk: int | None = None


@dataclass(frozen=True)
class ReusingLayer:
    """A layer that attends with its own queries over another layer's keys and values (KV sharing).

    Attributes:
        index: the layer's index (``module.layer_idx``); its cache layer holds nothing.
        module: the attention module whose attention call evictlayers receives.
        source: the index of the layer whose cache update it reuses (the last layer of the same type before
            it that keeps its keys and values for sharing).
    """

    index: int
    module: nn.Module
    source: int


@dataclass(frozen=True)
class ModelSupport:
    """How evictlayers serves one model.

    Attributes:
        layer_types: transformers' cache layer type per layer (``full_attention``, ``sliding_attention``,
            ``linear_attention``, ``conv``, ``dummy``).
        attention: the attention layers, ordered by index.
        carried: ``{index: (layer_type, kwargs)}`` for the layers whose cache is the model's own
            (recurrent state carried untouched, or no state at all: a reusing layer's included).
        reusing: the layers that attend over another layer's keys and values (KV sharing), ordered by index.
        shared_blocks: attention modules with no layer of their own (``layer_idx`` ``None`` or ``-1``) that several
            layers call, each call naming its cache layer (Zamba's); the layers they serve name one of them.
    """

    model_type: str
    layer_types: tuple[str, ...]
    attention: tuple[AttentionLayer, ...]
    carried: dict[int, tuple[str, dict]]
    reusing: tuple[ReusingLayer, ...] = ()
    shared_blocks: tuple[nn.Module, ...] = ()

    @property
    def modules(self) -> list[nn.Module]:
        """Every attention module evictlayers patches, each once (a shared block serves several layers)."""
        found = {id(m): m for m in (*(layer.module for layer in (*self.attention, *self.reusing)), *self.shared_blocks)}
        return list(found.values())

    @property
    def sources(self) -> frozenset[int]:
        """The layers whose attended keys and values a reusing layer reads."""
        return frozenset(layer.source for layer in self.reusing)

    def source_of(self, layer_idx: int) -> int | None:
        """The layer whose keys and values ``layer_idx`` reuses, ``None`` for a layer with a cache of its own."""
        return next((layer.source for layer in self.reusing if layer.index == layer_idx), None)

    def last_reader(self, source: int) -> int:
        """The last reusing layer that reads ``source`` (after it, the source's attended tokens can go)."""
        return max(layer.index for layer in self.reusing if layer.source == source)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def window(self, layer_idx: int) -> int | None:
        return next((layer.window for layer in self.attention if layer.index == layer_idx), None)

    def chunk(self, layer_idx: int) -> int | None:
        return next((layer.chunk for layer in self.attention if layer.index == layer_idx), None)

    def recurrent_states(self, layer_idx: int) -> int | None:
        return next((layer.recurrent_states for layer in self.attention if layer.index == layer_idx), None)


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before ``evictlayers.apply`` swapped in its ``Evicting<Class>``."""
    return getattr(module, "_evictlayers_original_class", type(module))


@contextlib.contextmanager
def attention_implementation(model: nn.Module, support: ModelSupport, name: str):
    """Run with every config the model and its attention modules read set to attention implementation
    ``name`` (a key of transformers' ``ALL_ATTENTION_FUNCTIONS``, or "eager"); each is restored on exit,
    also when the body raises. Used by ``apply`` (for the whole run) and by the induction probe."""
    modules = [model, *(layer.module for layer in support.attention)]
    configs = {id(module.config): module.config for module in modules if hasattr(module, "config")}
    saved = [(config, config._attn_implementation) for config in configs.values()]
    try:
        for config in configs.values():
            config._attn_implementation_internal = name
        yield
    finally:
        for config, implementation in saved:
            config._attn_implementation_internal = implementation


def _where(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__} (model_type={getattr(config, 'model_type', None)!r})"


def model_support(model: nn.Module) -> ModelSupport:
    """What evictlayers serves in ``model``; refuses what it cannot serve exactly.

    Raises:
        UnsupportedModelError: the model is not a decoder-only transformers model with a per-token KV cache
            whose attention layers call the attention interface, or its attention call passes something
            that changes the result and that evictlayers does not implement. The message names the model
            type, the layer and the reason.
    """
    where = _where(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise UnsupportedModelError(f"{where} is not a transformers model (it has no config)")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{where} is an encoder-decoder model (its decoder cross-attends to an encoder); evictlayers serves "
            "decoder-only self-attention"
        )
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES:
            index = getattr(module, "layer_idx", None)
            raise UnsupportedModelError(
                f"{where}{f', layer {index}' if isinstance(index, int) else ''}: {type(module).__name__} ({name}) is a "
                "cross-attention layer: its keys come from an encoder's output (of the source text in an "
                "encoder-decoder model, whose decoder the causal-LM class is, or of an image), not from the tokens "
                "generated; evictlayers serves decoder-only self-attention"
            )
    supports_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_cache is not None and not supports_cache():
        raise UnsupportedModelError(
            f"{where} keeps its generation state in a cache class of its own, not in transformers' per-token "
            "key/value cache that evictlayers replaces"
        )
    holders = sorted({type(m).__name__ for m in model.modules() if callable(getattr(m, "_setup_cache", None))})
    if holders:
        raise UnsupportedModelError(
            f"{where} keeps recurrent state in its modules ({', '.join(holders)}), set up when no cache is passed; "
            "evictlayers replaces the cache and would skip that set-up"
        )
    text_config = config.get_text_config(decoder=True)
    sources = _kv_sources(text_config, where)
    layer_types, layer_kwargs = _layer_types(text_config, where)
    indexed = _indexed_modules(model)
    candidates = {
        index: [m for m in modules if _calls_interface(original_class(m))]
        for index, modules in indexed.items()
    }
    candidates = {index: modules for index, modules in candidates.items() if modules and index != -1}
    # attention blocks shared by several layers (Zamba's) carry layer_idx None or -1 and get the layer per call
    shared_blocks = [
        m for m in model.modules()
        if hasattr(m, "layer_idx") and m.layer_idx in (None, -1) and _calls_interface(original_class(m))
    ]
    attention, carried, reusing = [], {}, []
    blocks_serve = False  # whether a layer's attention is a shared block (else such modules are not the decoder's)
    for index, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        modules = candidates.get(index, [])
        if index in sources:
            if len(modules) != 1 or kind not in EMPTY_LAYER_TYPES:
                raise UnsupportedModelError(
                    f"{where}, layer {index}: a KV-sharing layer should have an empty cache layer ('dummy') and one "
                    f"attention module calling the attention interface; found cache layer type {kind!r} and "
                    f"{len(modules)} such modules"
                )
            _check_call(modules[0], where, index)
            reusing.append(ReusingLayer(index, modules[0], sources[index]))
            carried[index] = (kind, kwargs)
            continue
        if kind in ATTENTION_LAYER_TYPES:
            if not modules and shared_blocks:
                # Zamba's attention block, shared by several layers and told its cache layer at each call: the
                # attention function attends over the cache layer its call's update staged (EvictionRun.staged_layer)
                modules, blocks_serve = shared_blocks[:1], True
            if len(modules) != 1:
                named = sorted({type(m).__name__ for m in modules})
                others = sorted({type(m).__name__ for m in indexed.get(index, []) if m not in modules})
                raise UnsupportedModelError(
                    f"{where}, layer {index} ({kind}): expected one attention module with layer_idx={index} that "
                    f"calls transformers' attention interface, found {len(modules)} ({', '.join(named) or 'none'}"
                    f"{'; other modules of the layer: ' + ', '.join(others) if others else ''}); attention computed "
                    "outside the interface cannot be served"
                )
            module = modules[0]
            _check_call(module, where, index)
            window = kwargs.get("sliding_window") if kind in ("sliding_attention", "hybrid_sliding") else None
            states = kwargs.get("number_of_states", 1) if kind in HYBRID_LAYER_TYPES else None
            chunk = _attention_chunk(kwargs, where, index) if kind == "chunked_attention" else None
            attention.append(AttentionLayer(index, module, window, states, chunk))
        elif kind in CARRIED_LAYER_TYPES or kind in EMPTY_LAYER_TYPES:
            if modules:
                raise UnsupportedModelError(
                    f"{where}, layer {index}: the cache layer type is {kind!r} but "
                    f"{type(modules[0]).__name__} calls the attention interface there"
                )
            carried[index] = (kind, kwargs)
        else:
            reason = {
                "indexed_attention": "sparse attention (DeepSeek's DSA, Qwen 4's QSA): an indexer, with keys of its "
                "own for every past token in the cache, picks for each query the tokens (Qwen 4: blocks of tokens) it "
                "scores highest among all the query can see, and the query attends to those only. evictlayers' "
                "kernels attend over every token a head holds and take no per-query selection, so it would compute "
                "other logits even with nothing evicted; serving it needs the indexer's keys held for the tokens "
                "each layer keeps and its selection applied inside every attention kernel, which evictlayers does "
                "not implement",
                "heavily_compressed_attention": COMPRESSED_ATTENTION,
                "compressed_sparse_attention": COMPRESSED_ATTENTION,
            }.get(kind, "a cache layer type evictlayers cannot hold")
            raise UnsupportedModelError(f"{where}, layer {index}: cache layer type {kind!r}: {reason}")
    stray = sorted(set(candidates) - set(range(len(layer_types))))
    if stray:
        raise UnsupportedModelError(
            f"{where}: attention modules with layer_idx {stray} fall outside the model's {len(layer_types)} "
            "cache layers"
        )
    if not attention:
        raise UnsupportedModelError(f"{where} has no attention layer to evict from")
    if blocks_serve:
        for block in shared_blocks:
            _check_call(block, where, block.layer_idx)
    else:
        shared_blocks = []
    served = {layer.index for layer in attention}
    for layer in reusing:
        if layer.source not in served:
            raise UnsupportedModelError(
                f"{where}, layer {layer.index}: it reuses the keys and values of layer {layer.source}, which is not "
                "an attention layer evictlayers serves"
            )
    return ModelSupport(
        getattr(config, "model_type", "?"), tuple(layer_types), tuple(attention), carried, tuple(reusing),
        tuple(shared_blocks),
    )


def _attention_chunk(kwargs: dict, where: str, index: int) -> int:
    """The chunk of a chunked-attention cache layer (transformers sizes it by its ``sliding_window``: the
    config's ``attention_chunk_size``)."""
    chunk = kwargs.get("sliding_window")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2:
        raise UnsupportedModelError(
            f"{where}, layer {index}: a chunked-attention layer has attention_chunk_size={chunk!r}, not a token "
            "count of at least 2"
        )
    return chunk


def _kv_sources(text_config, where: str) -> dict[int, int]:
    """``{reusing layer: source layer}`` of KV sharing (empty without it), from ``kv_sharing_modes``: a "reuse"
    layer reads what the last "store" layer of its own ``layer_types`` entry before it keeps (transformers
    hands it that layer's cache update through ``shared_kv_states``). Configs that share by
    ``num_kv_shared_layers`` without modes, or whose every layer reuses (an assistant model, which reads
    another model's keys), are refused."""
    try:
        modes = getattr(text_config, "kv_sharing_modes", None)
    except ValueError as error:  # the config rejects its own sharing layout
        raise UnsupportedModelError(f"{where}: its KV-sharing layout is invalid ({error})") from error
    if modes is None:
        if getattr(text_config, "num_kv_shared_layers", 0):
            raise UnsupportedModelError(
                f"{where}: its last {text_config.num_kv_shared_layers} layers reuse earlier layers' keys and values "
                "(num_kv_shared_layers) without saying which (no kv_sharing_modes), so evictlayers cannot tell "
                "which layer's tokens each one attends over"
            )
        return {}
    kinds = list(getattr(text_config, "layer_types", None) or ["full_attention"] * len(modes))
    sources, last_store = {}, {}
    for index, (mode, kind) in enumerate(zip(modes, kinds, strict=True)):
        if mode == "store":
            last_store[kind] = index
        elif mode == "reuse":
            if kind not in last_store:
                raise UnsupportedModelError(
                    f"{where}, layer {index}: it reuses keys and values of a {kind!r} layer that no earlier layer of "
                    "this model keeps (an assistant model reads another model's cache); evictlayers serves a model "
                    "whose every layer's keys come from its own tokens"
                )
            sources[index] = last_store[kind]
    return sources


def _layer_types(text_config, where: str) -> tuple[list[str], list[dict]]:
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    if isinstance(layer_kwargs, dict):  # transformers < 5.19: one dict of keywords for every layer
        layer_kwargs = [_keywords_of(kind, layer_kwargs) for kind in layer_types]
    for kind, kwargs in zip(layer_types, layer_kwargs):
        if kind == "sliding_attention" and not isinstance(kwargs.get("sliding_window"), int):
            raise UnsupportedModelError(
                f"{where}: a sliding-window layer has sliding_window={kwargs.get('sliding_window')!r}, not a "
                "token count"
            )
    return list(layer_types), list(layer_kwargs)


def _keywords_of(kind: str, shared: dict) -> dict:
    """The keywords of ``shared`` that a cache layer of type ``kind`` takes (transformers' own split)."""
    names = {
        "sliding_attention": ("sliding_window",), "chunked_attention": ("sliding_window",),
        "hybrid_sliding": ("sliding_window", "number_of_states"), "hybrid": ("number_of_states",),
        "conv": ("number_of_states",), "linear_attention": ("number_of_states",),
    }.get(kind, ())
    return {name: shared[name] for name in names if name in shared}


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str | None:
    """The source of the ``forward`` that ``cls`` runs, or ``None`` where it cannot be read."""
    for owner in cls.__mro__:
        if "forward" in vars(owner):
            try:
                return textwrap.dedent(inspect.getsource(vars(owner)["forward"]))
            except (OSError, TypeError):
                return None
    return None


def _calls_interface(cls: type) -> bool:
    source = _forward_source(cls)
    return source is not None and "ALL_ATTENTION_FUNCTIONS" in source


def _indexed_modules(model: nn.Module) -> dict[int, list[nn.Module]]:
    """``{layer_idx: modules}`` of the modules that carry an int ``layer_idx``."""
    found: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and not isinstance(index, bool):
            found.setdefault(index, []).append(module)
    return found


def _check_call(module: nn.Module, where: str, index: int) -> None:
    """Refuse cross-attention, non-causal attention, and an attention call that passes a keyword
    evictlayers does not honour."""
    cls = original_class(module)
    name = cls.__name__
    if "CrossAttention" in name or getattr(module, "is_cross_attention", False):
        raise UnsupportedModelError(
            f"{where}, layer {index}: {name} is a cross-attention layer (its keys come from another input, not "
            "from the tokens generated); evictlayers serves self-attention"
        )
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(
            f"{where}, layer {index}: {name} attends bidirectionally (is_causal=False); "
            "evictlayers serves causal attention"
        )
    calls = _attention_calls(cls)
    if len(calls) > 1:
        raise UnsupportedModelError(
            f"{where}, layer {index}: {cls.__name__} calls the attention function {len(calls)} times per forward "
            "over one cache update (DiffLlama's differential attention: the same queries and keys, with each half "
            "of the value heads repeated over all heads); a head's output then reads values of other key/value "
            "heads, whose kept tokens differ under evictlayers' per-head eviction, and a step's slots are attended "
            "and evicted once; evictlayers serves one attention per layer over each head's own keys and values"
        )
    for keywords in calls:
        for keyword in keywords:
            if keyword is None or keyword in HONOURED_KEYWORDS:
                continue
            meaning = REFUSED_KEYWORDS.get(keyword, "an argument evictlayers' attention does not implement")
            raise UnsupportedModelError(
                f"{where}, layer {index}: {cls.__name__} passes {keyword}= to the attention function: "
                f"{meaning}; evictlayers refuses rather than silently ignore it"
            )


@functools.lru_cache(maxsize=None)
def _attention_calls(cls: type) -> tuple[tuple[str | None, ...], ...]:
    """The keyword names (``None`` for ``**kwargs``) of each ``attention_interface(...)`` call in the
    ``forward`` that ``cls`` runs; parsed once per class, not once per layer and ``apply``."""
    source = _forward_source(cls)
    tree = ast.parse(source) if source else None
    return tuple(
        tuple(keyword.arg for keyword in node.keywords)
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface"
    )
