"""Tiny random models of every causal-LM architecture transformers ships, for the conformance sweep.

``tiny_model(model_type)`` shrinks the architecture's default config generically (small widths, 4
layers, a small vocabulary, short sliding windows and chunks so ~30-token sequences cross them, per-layer
lists and per-layer overrides cut to the same 4 layers) and builds a float32 model in eval mode;
``_TYPE_OVERRIDES`` sets the few fields a type's default config leaves unset or its validators tie
together. Nothing here knows evictlayers: the sweep compares the patched model with this unmodified one.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tiny_models import PAD, greedy, left_padded

VOCAB = 128  # above tiny_models' token ids (< 96)
WINDOW = 12  # sliding windows and attention chunks shorter than the sweep's sequences
LAYERS = 4

# standard names (mapped through each config's attribute_map) and the small values they get
_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}
# any other int field of these names is shrunk to the value given
_FIELD_RULES = {
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 12,
    "qk_head_dim": 16,
    "global_head_dim": 32,  # Gemma 4's global layers where the config has no per-layer overrides: twice the local
    "first_k_dense_replace": 1,
    "attn_layer_period": 2,  # hybrids that place attention every n-th layer: one in every two
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    # Mamba-2 mixers: hidden_size * expand == n_heads * d_head (64 * 2 == 8 * 16)
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_ssm": 128,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    # Inkling's relative position bias spans rel_extent tokens back; Inkling 2 scales its full layers' queries
    # logarithmically from position log_scaling_n_floor on, and sums n_layers_per_attn_res_block layers into
    # each block its attention residuals read
    "rel_extent": WINDOW,
    "log_scaling_n_floor": 16,
    "n_layers_per_attn_res_block": LAYERS // 2,
    # Inkling 2's LM head is narrower than its (padded) embedding table
    "unpadded_vocab_size": VOCAB - 8,
    # BLT's local encoder and decoder read the global transformer's width, which the shrink sets to hidden_size;
    # its hash n-gram embedding table has this many rows per n-gram size (500002 by default: 768 MB at width 64)
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 64,
    "local_attention_window_len": WINDOW,
}
# sizes of the layers of one type where they differ from the global ones (Inkling's sliding-window layers'
# swa_num_attention_heads, swa_head_dim, ...): scaled as the global size was (see _scaled)
_VARIANT_PREFIXES = ("swa_",)


def causal_lm_types() -> list[str]:
    """Every model type in transformers' causal-LM mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# What the generic shrink cannot infer, per config ``model_type`` (a sub-config's type applies inside a
# multimodal config too): fields a default config leaves unset that the model needs (real checkpoints set
# them), a config's own validators, and sizes kept consistent where one width is derived from others. A
# dict value for a sub-config field updates that sub-config's shrunk keywords.
_TYPE_OVERRIDES: dict[str, dict] = {
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not define, and clamps its
    # projections by clip_qkv, which it leaves unset (DBRX's checkpoints clip at 8)
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10_000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 96},
    },
    # one codebook (the decoder reads rows * codebooks token rows), and the start token generate() pads
    # the codebooks' delays with
    "musicgen_decoder": {"num_codebooks": 1, "decoder_start_token_id": PAD},
    "musicgen_melody_decoder": {"num_codebooks": 1, "decoder_start_token_id": PAD},
    # the block stack's width and depth are read apart from hidden_size and num_hidden_layers; its cache
    # rounds the key width (hidden_size * qk_dim_factor) up to a multiple of 64, the layers do not
    "xlstm": {"hidden_size": 128, "embedding_dim": 128, "num_blocks": LAYERS},
    # the default config leaves the MoE sizes unset (None)
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    # the audio-to-text adapter's input width must be the text width
    "dots3_note": {"audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64}},
    # attention_types expands to one entry per layer
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]], "window_size": WINDOW},
    # layer_types has no default: a short convolution and an attention layer, twice
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    # a Mamba-2 mixer needs hidden_size * expand == num_heads * head_dim
    "mamba2": {"num_heads": 8, "n_groups": 1},
    # one rotary table per layer type, which the default config leaves empty; mrope sections within the
    # shrunk rotary half
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 2, 2]},
        },
    },
    # the axial position embeddings' widths sum to the hidden size and their shape covers the chunks; LSH
    # attention hashes with random rotations unless seeded, so two forwards would differ
    "reformer": {
        "axial_pos_embds_dim": (32, 32), "axial_pos_shape": (16, 16), "attention_head_size": 16,
        "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16, "attn_layers": ("local", "lsh", "local", "lsh"),
        "hash_seed": 0, "num_buckets": 4,
    },
    # Zamba's shared attention block is tied across its hybrid layers, so it needs two of them; its attention
    # reads the concatenation of the input and the original embeddings (2 * hidden_size)
    "zamba": {
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "attention_hidden_size": 128,
        "attention_head_dim": 32, "mamba_dt_rank": 8,
    },
    # Qwen 4's full-attention layers always run the QSA indexer, whose sizes the default config leaves unset
    "qwen4_exp_text": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4, "hc_lowrank": 8, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    },
    # a Gemma 4 assistant reads every layer's keys from its target model, with no per-layer inputs of its own
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "gemma4_unified_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # the language adapters need a default language to run
    "xmod": {"default_language": "en_XX"},
    # the input, recurrent and output sections partition the layers (the default's 8 input and 8 output layers
    # left a recurrent section of -12); one input, two looped and one output layer
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # the looped section starts after the first block and ends on a block boundary (multiples of
    # n_layers_per_attn_res_block, 2): layers 2 and 3, run twice
    "inkling2_loop_text": {
        "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, "loop_gate_rank": 8,
    },
    # BltConfig has no num_hidden_layers of its own, and BltModel's cache (DynamicCache(config=BltConfig)) reads
    # it: transformers' BLT tests set it (and the decoder's heads and width) on the config after building it
    "blt": {"num_hidden_layers": LAYERS, "num_attention_heads": _SIZES["num_attention_heads"],
            "hidden_size": _SIZES["hidden_size"]},
}


def _fields(config_class: type) -> set[str]:
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    return set(inspect.signature(config_class.__init__).parameters)


def _read(config: PretrainedConfig, name: str):
    """``config.<name>``, or ``None``; for a per-layer attribute of a heterogeneous config (one whose layers
    override it), the global value."""
    global_value = getattr(config, "_getattr_without_heterogeneous_validation", None)
    try:
        return global_value(name, None) if global_value is not None else getattr(config, name, None)
    except AttributeError:
        return None


def _per_layer_overrides(config: PretrainedConfig) -> dict[int, dict]:
    """``{layer index: {attribute: value}}`` of a heterogeneous config's layers that differ from it."""
    spec = config.__dict__.get("_heterogeneity_spec")
    return {} if spec is None else {index: dict(values) for index, values in spec.per_layer_overrides.items()}


def _shrunk_kwargs(config: PretrainedConfig) -> dict:
    cls = type(config)
    fields = _fields(cls)
    kwargs = {}
    latent = _read(config, "kv_lora_rank") is not None  # MLA: heads and head dims come from the ranks
    for name, value in _SIZES.items():
        field = cls.attribute_map.get(name, name)
        if field in fields and not (latent and name == "head_dim"):
            kwargs[field] = value
    if latent:  # one latent per head; value heads narrower than query/key heads (MLA's D_v != D_k)
        kwargs[cls.attribute_map.get("num_key_value_heads", "num_key_value_heads")] = _SIZES["num_attention_heads"]
        if "head_dim" in fields and _read(config, "head_dim") == _read(config, "qk_rope_head_dim"):
            kwargs["head_dim"] = _FIELD_RULES["qk_rope_head_dim"]  # the rotary table's width is the rope part's
    if "rotary_dim" in fields and isinstance(_read(config, "rotary_dim"), int):
        kwargs["rotary_dim"] = 8  # partial rotary within the shrunk head
    for name, value in _FIELD_RULES.items():
        default = _read(config, name)
        # a name the config keeps under another (Inkling's sliding_window is its sliding_window_size)
        field = name if name in fields else cls.attribute_map.get(name, name)
        if field in fields and isinstance(default, int):
            # never more experts per token than the architecture allows by default (ZAYA routes to one)
            kwargs[field] = min(value, default) if name == "num_experts_per_tok" else value
        elif name == "num_experts_per_tok" and field in fields:
            kwargs[field] = value
    for name in sorted(fields):
        prefix = next((prefix for prefix in _VARIANT_PREFIXES if name.startswith(prefix)), None)
        size = name[len(prefix):] if prefix else None
        default, value = _read(config, size) if size else None, _read(config, name)
        if size in _SIZES and isinstance(value, int) and isinstance(default, int) and isinstance(kwargs.get(size), int):
            kwargs[name] = _scaled(value, default, kwargs[size])
    # encoder-decoder configs size their two stacks apart
    for name in ("encoder_layers", "decoder_layers"):
        if name in fields and isinstance(_read(config, name), int):
            kwargs[name] = LAYERS
    for name in ("encoder_attention_heads", "decoder_attention_heads"):
        if name in fields and isinstance(_read(config, name), int):
            kwargs[name] = _SIZES["num_attention_heads"]
    for name in ("encoder_ffn_dim", "decoder_ffn_dim"):
        if name in fields and isinstance(_read(config, name), int):
            kwargs[name] = _SIZES["intermediate_size"]
    if not _read(config, "is_encoder_decoder"):
        kwargs["is_decoder"] = True  # encoder families (BERT, RoBERTa, ...) are causal LMs only as decoders
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if name in fields:
            kwargs[name] = {"pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}[name]
    _shrink_layers(config, fields, kwargs)
    overrides = _TYPE_OVERRIDES.get(getattr(config, "model_type", ""), {})
    # sub-configs (text/vision/audio parts of multimodal types) are shrunk the same way
    for name in sorted(fields):
        value = _read(config, name)
        if isinstance(value, PretrainedConfig):
            sub_kwargs = {**_shrunk_kwargs(value), **overrides.get(name, {})}
            kwargs[name] = type(value)(**sub_kwargs)
    kwargs.update(
        {name: value for name, value in overrides.items() if not isinstance(kwargs.get(name), PretrainedConfig)}
    )
    return kwargs


def _shrink_layers(config: PretrainedConfig, fields: set[str], kwargs: dict) -> None:
    """Cut per-layer lists and per-layer overrides to ``LAYERS`` layers, the same layers for all of them."""
    depth = _read(config, "num_hidden_layers")
    # the layer types first: where the lists hold more distinct values than LAYERS, theirs are kept
    kinds_field = type(config).attribute_map.get("layer_types", "layer_types")
    lists = {
        name: value for name in sorted(fields, key=lambda name: (name != kinds_field, name))
        if isinstance(value := _read(config, name), list) and len(value) == depth and name not in kwargs
    }
    overrides = _per_layer_overrides(config)
    shared = _read(config, "num_kv_shared_layers")
    kinds = lists.get(kinds_field)
    if isinstance(shared, int) and shared > 0 and kinds:
        # KV sharing: the last `shared` layers reuse the keys of the last earlier layer of their type, so
        # each type keeps a layer before the shared ones and one among them
        boundary = depth - shared
        firsts: dict[tuple[str, bool], int] = {}
        for index, kind in enumerate(kinds):
            firsts.setdefault((kind, index >= boundary), index)
        kept = sorted(firsts.values())[:LAYERS]
        kept = sorted(kept + [i for i in range(depth) if i not in kept][: LAYERS - len(kept)])
        kwargs["num_kv_shared_layers"] = sum(index >= boundary for index in kept)
    elif lists or overrides:
        kept = _kept_layers(depth, [*lists.values(), [overrides.get(i, {}) for i in range(depth)]])
    if lists or overrides:
        for name, value in lists.items():
            kwargs[name] = [value[index] for index in kept]
        if overrides:
            kwargs["per_layer_config"] = {
                new: _shrunk_override(config, overrides[old], kwargs)
                for new, old in enumerate(kept) if old in overrides
            }
    # hybrids whose default stack is recurrent only get attention on every second layer, so the sweep
    # sees both kinds
    if "attn_layer_indices" in fields and _read(config, "attn_layer_indices") is None:
        kwargs["attn_layer_indices"] = [1, 3]
    recurrent = {"linear_attention", "mamba", "conv"}
    kinds = kwargs.get("layer_types")
    if kinds and set(kinds) <= recurrent:
        kwargs["layer_types"] = [kind if index % 2 == 0 else "full_attention" for index, kind in enumerate(kinds)]


def _kept_layers(depth: int, per_layer: list[list]) -> list[int]:
    """``LAYERS`` layer indices in order: the first layer of each distinct value of every per-layer list (as
    far as ``LAYERS`` allows), then the earliest others. A hybrid's first layers may all be recurrent, and a
    heterogeneous config's overridden layers may come late."""
    chosen: list[int] = []
    for values in per_layer:
        seen = []
        for index, value in enumerate(values):
            if value not in seen:
                seen.append(value)
                if index not in chosen and len(chosen) < LAYERS:
                    chosen.append(index)
    for index in range(depth):
        if len(chosen) >= LAYERS:
            break
        if index not in chosen:
            chosen.append(index)
    return sorted(chosen)


def _shrunk_override(config: PretrainedConfig, override: dict, kwargs: dict) -> dict:
    """One layer's overrides at the shrunk sizes: a size scaled as the global one was (Gemma 4's global
    layers keep twice the head dim of its local ones), anything else as it is."""
    shrunk = {}
    for name, value in override.items():
        default, small = _read(config, name), kwargs.get(name)
        if isinstance(value, int) and isinstance(default, int) and isinstance(small, int) and default > 0:
            shrunk[name] = _scaled(value, default, small)
        else:
            shrunk[name] = value
    # an MLA layer whose head dim is its no-rope and rope parts together keeps it so (Dots 3's sliding layers)
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")
    if any(name in override for name in parts):
        layer = {name: override.get(name, _read(config, name)) for name in ("head_dim", *parts)}
        head, nope, rope = layer.values()
        if all(isinstance(size, int) for size in (head, nope, rope)) and head == nope + rope:
            shrunk["head_dim"] = sum(shrunk.get(name, kwargs.get(name, layer[name])) for name in parts)
    return shrunk


def _scaled(value: int, default: int, small: int) -> int:
    """``value``, a size beside the global ``default`` that the shrink set to ``small``, scaled alike: by the same
    factor where that gives a whole size, else still wider or narrower than ``small`` (or equal to it)."""
    if value == default or default <= 0:
        return small
    scaled, remainder = divmod(small * value, default)
    if remainder or scaled <= 0:  # not a whole multiple: still wider or narrower than the global value
        scaled = 2 * small if value > default else max(1, small // 2)
    return scaled


def tiny_config(model_type: str, **changes) -> PretrainedConfig:
    """The shrunk config of ``model_type``: of the causal-LM class's own config class where it differs from
    the type's (MusicGen's causal LM is its decoder); ``changes`` replace shrunk keywords."""
    config_class = _causal_lm_class(model_type).config_class
    if config_class is None or config_class is PretrainedConfig:
        config_class = CONFIG_MAPPING[model_type]
    try:
        default = config_class()
    except Exception:  # a default its own validators reject (Gemma 4's assistants): with the type's overrides
        default = config_class(**_TYPE_OVERRIDES.get(config_class.model_type, {}))
    return config_class(**{**_shrunk_kwargs(default), **changes})


def _causal_lm_class(model_type: str) -> type:
    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


def tiny_model(model_type: str, attn_implementation: str = "eager", seed: int = 0, **changes):
    """A float32, eval-mode tiny model of ``model_type`` whose generation never stops early; ``changes``
    replace keywords of its shrunk config."""
    config = tiny_config(model_type, **changes)
    torch.manual_seed(seed)
    if isinstance(config, CONFIG_MAPPING[model_type]):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    else:
        config._attn_implementation = attn_implementation
        model = _causal_lm_class(model_type)(config)
    model = model.float().eval()
    generation = model.generation_config
    generation.pad_token_id = PAD
    generation.eos_token_id = None
    generation.bos_token_id = None
    generation.do_sample = False
    if generation.num_return_sequences is None:
        generation.num_return_sequences = 1  # MusicGen's own generate() reads it without a default
    return model


# ---- the conformance check of one architecture -------------------------------------------------------

LENGTHS = [20, 13]  # a left-padded batch of two prompts of different lengths
NEW_TOKENS = 10
BUDGET = 8  # the H2O budget of the eviction check: well below the 29 tokens a row feeds
TOL = dict(rtol=1e-4, atol=1e-4)


@dataclasses.dataclass
class Outcome:
    """What the sweep found for one model type: ``status`` is ``works``, ``refused`` (``apply`` raised
    ``UnsupportedModelError``; ``reason`` is its message) or ``skipped`` (transformers itself cannot build
    or run the shrunk model; ``reason`` says why). ``rolling`` is the outcome of a working type under
    ``Policy(positions="rolling")`` with nothing evicted. A patched model whose logits differ is not an
    outcome: ``conformance`` raises ``AssertionError``."""

    model_type: str
    status: str
    reason: str = ""
    features: tuple[str, ...] = ()
    rolling: str = ""  # for a working type: "works" or "refused" under Policy(positions="rolling")


def _forward(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def config_features(model) -> list[str]:
    """Attention features of a model read from its config and modules alone (independent of evictlayers)."""
    config = model.config.get_text_config(decoder=True)
    found = []
    layer_types = _read(config, "layer_types") or []
    if _read(config, "sliding_window") is not None and (not layer_types or "sliding_attention" in layer_types):
        found.append("sliding window")
    if any(kind in ("linear_attention", "conv", "mamba", "hybrid") for kind in layer_types):
        found.append("hybrid")
    if _read(config, "attn_logit_softcapping"):
        found.append("softcap")
    if _read(config, "kv_lora_rank"):
        found.append("MLA")
    if "indexed_attention" in layer_types:
        found.append("sparse (indexer)")
    if any(("no_rope" in name or "nope_layer" in name) and _read(config, name) for name in vars(config)):
        found.append("NoPE layers")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        found.append("learned sinks")
    if _read(config, "attention_chunk_size"):
        found.append("chunked attention")
    if getattr(config, "is_heterogeneous", False):
        found.append("per-layer sizes")
    return found


def conformance(model_type: str, evictlayers, **changes) -> Outcome:
    """Build the tiny ``model_type`` (``changes``: keywords of its shrunk config replaced), then either it
    is refused by ``evictlayers.apply`` (and left untouched), or with nothing evicted it gives the unmodified
    model's logits and greedy tokens on a left-padded batch of 2 and under an H2O budget every attention
    layer holds at most its budget."""
    el = evictlayers
    try:
        model = tiny_model(model_type, **changes)
        ids, mask = left_padded(LENGTHS)
        reference_logits = _forward(model, ids, mask)
        reference = greedy(model, ids, mask, NEW_TOKENS)
    except Exception as error:  # transformers itself cannot build or run the shrunk architecture
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        return Outcome(model_type, "skipped", f"{type(error).__name__}: {first[:160]}")
    features = tuple(config_features(model))
    real = mask.bool()
    try:  # refused by apply, or by the first attention call that passes what evictlayers cannot serve
        with el.apply(model, el.Policy(budget=None)):
            logits = _forward(model, ids, mask)
            generated = greedy(model, ids, mask, NEW_TOKENS)
    except el.UnsupportedModelError as error:
        torch.testing.assert_close(_forward(model, ids, mask), reference_logits, rtol=0, atol=0)
        return Outcome(model_type, "refused", str(error), features)
    torch.testing.assert_close(logits[real], reference_logits[real], **TOL, msg=lambda m: f"{model_type} prefill: {m}")
    for step, (got, want) in enumerate(zip(generated.logits, reference.logits, strict=True)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, step=step: f"{model_type} decode step {step}: {m}")
    assert torch.equal(generated.sequences, reference.sequences), f"{model_type}: greedy tokens differ"

    policy = el.Policy(el.RecentWindow(0.5), el.HeavyHitterSelector(el.Cumulative()), budget=BUDGET)
    with el.apply(model, policy) as run:
        greedy(model, ids, mask, NEW_TOKENS)
        stats = run.stats()
    windows = {layer.index: layer.window for layer in run.support.attention}
    assert windows, f"{model_type}: no attention layer served"
    for index, layer in enumerate(stats["layers"]):
        if index >= run.support.num_layers:  # a looped section's copy of one of its layers (Dory's later passes)
            assert layer["retained_tokens"] <= BUDGET, (model_type, index, layer)
            continue
        if index not in windows:
            assert layer["kind"] in ("carried", "shared") and layer["retained_tokens"] == 0, (model_type, index, layer)
            continue
        window = windows[index]
        limit = BUDGET if window is None else min(BUDGET, window - 1)
        assert layer["retained_tokens"] <= limit, (model_type, index, layer)
        assert layer["seen_tokens"] == max(LENGTHS) + NEW_TOKENS - 1, (model_type, index, layer)
    torch.testing.assert_close(_forward(model, ids, mask), reference_logits, rtol=0, atol=0)

    try:  # rolling positions with nothing evicted: every rank is the original position
        with el.apply(model, el.Policy(budget=None, positions="rolling")):
            rolled = greedy(model, ids, mask, NEW_TOKENS)
        rolling = "works"
    except el.UnsupportedModelError:
        rolling = "refused"
    if rolling == "works":
        for step, (got, want) in enumerate(zip(rolled.logits, reference.logits, strict=True)):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, step=step: f"{model_type} rolling step {step}: {m}")
    return Outcome(model_type, "works", "", features, rolling)


# ---- docs/models.md: the sweep's table -----------------------------------------------------------------

MODELS_DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
# architectures whose shrunk model takes tens of seconds to build or run on 2 cores: marked slow
SLOW_TYPES = {"longcat_flash", "kimi_linear"}


def render_models_doc(outcomes: list[Outcome], transformers_version: str) -> str:
    counts = {status: sum(o.status == status for o in outcomes) for status in ("works", "refused", "skipped")}
    lines = [
        "# Supported models",
        "",
        "Generated by `python scripts/models_doc.py` from the conformance sweep "
        "(`tests/test_architecture_sweep.py`), which runs on every causal-LM model type of transformers "
        f"{transformers_version}. Each architecture is built as a tiny random model from its own config class "
        "(a generic shrink of the default config: 4 layers, small widths, sliding windows and chunks of "
        f"{WINDOW} tokens, per-layer overrides scaled alike, and set per type the few fields a default config "
        "leaves unset or its validators tie together), then one of:",
        "",
        "- **works**: with nothing evicted, prefill and greedy decoding of a left-padded batch of 2 give the "
        "unmodified model's logits and tokens, and under an H2O budget of "
        f"{BUDGET} tokens every attention layer holds at most its budget (a sliding layer at most its window);",
        "- **refused**: `evictlayers.apply` (or the first attention call, for what only shows at run time) raises "
        "`UnsupportedModelError` with the reason below, and the model is left as it was;",
        "- **skipped**: transformers itself cannot build or run the shrunk architecture (the reason is "
        "transformers' error); such a type is neither served nor refused by this sweep.",
        "",
        "For a working type, *rolling positions* says whether `Policy(positions=\"rolling\")` gives the same "
        "logits with nothing evicted (works) or is refused (learned absolute positions, a rotary form other than "
        "rotate-half, several rotary modules).",
        "",
        "There is no fourth outcome: a patched model whose logits differ fails the test suite. Features are read "
        "from each config: sliding window, softcap, MLA (a compressed key/value latent), NoPE layers (layers "
        "without rotary positions), learned sinks, chunked attention, hybrid (recurrent or linear-attention "
        "layers beside attention), sparse (indexer) (an indexer picks the tokens each query attends to), per-layer "
        "sizes (layers whose head dims or head counts differ from the config's, as Gemma 4's global layers).",
        "",
        f"**{counts['works']} work, {counts['refused']} are refused, {counts['skipped']} are skipped** "
        f"of {len(outcomes)} model types.",
        "",
        "| model type | outcome | rolling positions | features | reason |",
        "|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        reason = outcome.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| `{outcome.model_type}` | {outcome.status} | {outcome.rolling} | {', '.join(outcome.features)} | {reason} |"
        )
    return "\n".join(lines) + "\n"


def documented_outcomes(path: Path = MODELS_DOC) -> tuple[str | None, dict[str, str]]:
    """``(transformers version, {model type: (outcome, rolling outcome)})`` as ``docs/models.md`` records them."""
    text = path.read_text(encoding="utf-8")
    version = re.search(r"causal-LM model type of transformers (\S+?)\.\s", text)
    rows = re.findall(r"^\| `([^`]+)` \| (works|refused|skipped) \| (works|refused|) \|", text, flags=re.MULTILINE)
    return (version.group(1) if version else None), {model_type: (status, rolling) for model_type, status, rolling in rows}
