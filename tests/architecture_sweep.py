"""Tiny random models of every causal-LM architecture transformers ships, for the conformance sweep.

``tiny_model(model_type)`` shrinks the architecture's default config generically (small widths, 4
layers, a small vocabulary, short sliding windows and chunks so ~30-token sequences cross them) and
builds a float32 model in eval mode. Nothing here knows evictlayers: the sweep compares the patched
model with this unmodified one.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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
}


def causal_lm_types() -> list[str]:
    """Every model type in transformers' causal-LM mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _fields(config_class: type) -> set[str]:
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    return set(inspect.signature(config_class.__init__).parameters)


def _shrunk_kwargs(config: PretrainedConfig) -> dict:
    cls = type(config)
    fields = _fields(cls)
    kwargs = {}
    latent = getattr(config, "kv_lora_rank", None) is not None  # MLA: heads and head dims come from the ranks
    for name, value in _SIZES.items():
        field = cls.attribute_map.get(name, name)
        if field in fields and not (latent and name == "head_dim"):
            kwargs[field] = value
    if latent:  # one latent per head; value heads narrower than query/key heads (MLA's D_v != D_k)
        kwargs[cls.attribute_map.get("num_key_value_heads", "num_key_value_heads")] = _SIZES["num_attention_heads"]
    if "rotary_dim" in fields and isinstance(getattr(config, "rotary_dim", None), int):
        kwargs["rotary_dim"] = 8  # partial rotary within the shrunk head
    for name, value in _FIELD_RULES.items():
        if name in fields and (isinstance(getattr(config, name, None), int) or name == "num_experts_per_tok"):
            kwargs[name] = value
    if not getattr(config, "is_encoder_decoder", False):
        kwargs["is_decoder"] = True  # encoder families (BERT, RoBERTa, ...) are causal LMs only as decoders
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if name in fields:
            kwargs[name] = {"pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}[name]
    # per-layer lists sized for the default depth are cut to the shrunk depth, keeping one layer of each
    # kind (a hybrid's first layers may all be recurrent)
    for name in sorted(fields):
        value = getattr(config, name, None)
        if isinstance(value, list) and len(value) == getattr(config, "num_hidden_layers", -1) and name not in kwargs:
            kwargs[name] = _keep_each_kind(value)
    # hybrids whose default stack is recurrent only get attention on every second layer, so the sweep
    # sees both kinds
    if "attn_layer_indices" in fields and getattr(config, "attn_layer_indices", None) is None:
        kwargs["attn_layer_indices"] = [1, 3]
    recurrent = {"linear_attention", "mamba", "conv"}
    kinds = kwargs.get("layer_types")
    if kinds and set(kinds) <= recurrent:
        kwargs["layer_types"] = [kind if index % 2 == 0 else "full_attention" for index, kind in enumerate(kinds)]
    # sub-configs (text/vision/audio parts of multimodal types) are shrunk the same way
    for name in sorted(fields):
        value = getattr(config, name, None)
        if isinstance(value, PretrainedConfig):
            kwargs[name] = type(value)(**_shrunk_kwargs(value))
    return kwargs


def _keep_each_kind(values: list) -> list:
    """``LAYERS`` entries of a per-layer list in their order: the first of each distinct value, then the
    earliest others."""
    firsts = []
    for index, value in enumerate(values):
        if all(values[other] != value for other in firsts):
            firsts.append(index)
    chosen = set(firsts[:LAYERS])
    for index in range(len(values)):
        if len(chosen) >= LAYERS:
            break
        chosen.add(index)
    return [values[index] for index in sorted(chosen)]


def tiny_config(model_type: str) -> PretrainedConfig:
    config_class = CONFIG_MAPPING[model_type]
    return config_class(**_shrunk_kwargs(config_class()))


def tiny_model(model_type: str, attn_implementation: str = "eager", seed: int = 0):
    """A float32, eval-mode tiny model of ``model_type`` whose generation never stops early."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.float().eval()
    generation = model.generation_config
    generation.pad_token_id = PAD
    generation.eos_token_id = None
    generation.bos_token_id = None
    generation.do_sample = False
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
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) is not None and (
        not layer_types or "sliding_attention" in layer_types
    ):
        found.append("sliding window")
    if any(kind in ("linear_attention", "conv", "mamba", "hybrid") for kind in layer_types):
        found.append("hybrid")
    if getattr(config, "attn_logit_softcapping", None):
        found.append("softcap")
    if getattr(config, "kv_lora_rank", None):
        found.append("MLA")
    if any(("no_rope" in name or "nope_layer" in name) and getattr(config, name, None) for name in vars(config)):
        found.append("NoPE layers")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        found.append("learned sinks")
    if getattr(config, "attention_chunk_size", None):
        found.append("chunked attention")
    return found


def conformance(model_type: str, evictlayers) -> Outcome:
    """Build the tiny ``model_type``, then either it is refused by ``evictlayers.apply`` (and left
    untouched), or with nothing evicted it gives the unmodified model's logits and greedy tokens on a
    left-padded batch of 2 and under an H2O budget every attention layer holds at most its budget."""
    el = evictlayers
    try:
        model = tiny_model(model_type)
        ids, mask = left_padded(LENGTHS)
        reference_logits = _forward(model, ids, mask)
        reference = greedy(model, ids, mask, NEW_TOKENS)
    except Exception as error:  # transformers itself cannot build or run the shrunk architecture
        return Outcome(model_type, "skipped", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
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
        if index not in windows:
            assert layer["kind"] == "carried" and layer["retained_tokens"] == 0, (model_type, index, layer)
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
SLOW_TYPES = {"blt", "longcat_flash", "kimi_linear"}


def render_models_doc(outcomes: list[Outcome], transformers_version: str) -> str:
    counts = {status: sum(o.status == status for o in outcomes) for status in ("works", "refused", "skipped")}
    lines = [
        "# Supported models",
        "",
        "Generated by `python scripts/models_doc.py` from the conformance sweep "
        "(`tests/test_architecture_sweep.py`), which runs on every causal-LM model type of transformers "
        f"{transformers_version}. Each architecture is built as a tiny random model from its own config class "
        "(a generic shrink of the default config: 4 layers, small widths, sliding windows and chunks of "
        f"{WINDOW} tokens), then one of:",
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
        "layers beside attention).",
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
