"""Tiny random decoders of every supported family, built from configs (no hub downloads).

Each config keeps the family's edge cases small enough to be hit by ~30-token sequences:
GQA (Llama, Mistral, Qwen2, Qwen3), a sliding window (Mistral, Gemma2), logit soft-capping and
mixed sliding/full layers (Gemma2), QK-norm (Qwen3), fused QKV and partial rotary (Phi3, GPT-NeoX),
learned absolute positions (GPT-2, OPT). ``initializer_range`` is raised above the usual 0.02 so that
attention is far from uniform and a wrong key set moves the logits visibly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Run a test module on one intra-op thread, restoring the setting afterwards.

    Import this fixture into a test module to use it. Ops on these tiny tensors gain nothing from
    threads, and on a 2-core machine with anything else running, OpenMP's spinning threads make every
    matmul ~100x slower (a 10-token generate took 2.6 s with 2 threads, 11 ms with 1).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


VOCAB = 96
PAD = 0
SEED = 0


@dataclass(frozen=True)
class Family:
    name: str
    model_class: type[PreTrainedModel]
    config: Callable[[], PretrainedConfig]

    @property
    def implementations(self) -> tuple[str, ...]:
        """The attention implementations transformers offers for this family on CPU. Not sdpa with
        soft-capped logits: transformers' sdpa does not apply soft-capping (releases before 5.21 offer it
        for Gemma2 and ignore the cap), so evictlayers refuses that pairing."""
        sdpa = getattr(self.model_class, "_supports_sdpa", False) and not getattr(self.config(), "attn_logit_softcapping", None)
        return ("eager", "sdpa") if sdpa else ("eager",)


def _llama_like(config_class, **extra) -> PretrainedConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.15,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    base.update(extra)
    return config_class(**base)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", transformers.LlamaForCausalLM, lambda: _llama_like(transformers.LlamaConfig)),
        Family(
            "mistral",
            transformers.MistralForCausalLM,
            lambda: _llama_like(transformers.MistralConfig, head_dim=8, sliding_window=12),
        ),
        Family("qwen2", transformers.Qwen2ForCausalLM, lambda: _llama_like(transformers.Qwen2Config)),
        Family(
            "qwen3",  # QK-norm; head_dim decoupled from hidden_size / heads
            transformers.Qwen3ForCausalLM,
            lambda: _llama_like(transformers.Qwen3Config, head_dim=16),
        ),
        Family(
            "gemma2",  # soft-capped attention and final logits, alternating sliding / full layers
            transformers.Gemma2ForCausalLM,
            lambda: _llama_like(
                transformers.Gemma2Config,
                head_dim=16,
                query_pre_attn_scalar=24,  # scaling 24**-0.5, not head_dim**-0.5
                sliding_window=8,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=5.0,
                layer_types=["sliding_attention", "full_attention"],
                hidden_activation="gelu_pytorch_tanh",
            ),
        ),
        Family(
            "phi3",  # fused qkv, partial rotary
            transformers.Phi3ForCausalLM,
            lambda: _llama_like(
                transformers.Phi3Config,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            ),
        ),
        Family(
            "gpt2",  # learned absolute positions, fused c_attn
            transformers.GPT2LMHeadModel,
            lambda: transformers.GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=128,
                initializer_range=0.15,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=PAD,
            ),
        ),
        Family(
            "opt",  # learned absolute positions with OPT's offset of 2
            transformers.OPTForCausalLM,
            lambda: transformers.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                word_embed_proj_dim=32,
                max_position_embeddings=128,
                init_std=0.15,
                pad_token_id=PAD,
                bos_token_id=1,
                eos_token_id=2,
                enable_bias=True,
            ),
        ),
        Family(
            "gpt_neox",  # fused qkv, partial rotary (25%)
            transformers.GPTNeoXForCausalLM,
            lambda: transformers.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                initializer_range=0.15,
                pad_token_id=PAD,
                bos_token_id=1,
                eos_token_id=2,
                tie_word_embeddings=False,
            ),
        ),
    ]
}

# (family, implementation) for every implementation transformers offers: the parametrisation of the
# equivalence tests
FAMILY_IMPLEMENTATIONS = [(name, impl) for name, family in FAMILIES.items() for impl in family.implementations]


def build(name: str, attn_implementation: str = "eager", seed: int = SEED) -> PreTrainedModel:
    """A float32, eval-mode tiny model of family ``name`` whose generation never stops early."""
    family = FAMILIES[name]
    config = family.config()
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = family.model_class(config).float().eval()
    assert model.config._attn_implementation == attn_implementation
    generation = model.generation_config
    generation.pad_token_id = PAD
    generation.eos_token_id = None  # random models would stop at random points; keep lengths fixed
    generation.bos_token_id = None
    generation.do_sample = False
    return model


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, max(lengths)]``: random real tokens, left padding."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids from a left-padded mask as ``generate()`` derives them (padding columns get 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def kv_geometry(config: PretrainedConfig) -> tuple[int, int]:
    """``(H_kv, head_dim)`` of a config, read from the config alone (independent of evictlayers)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def unpad_row(ids: torch.Tensor, mask: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row`` of a left-padded batch alone, without padding: ``[1, length]``."""
    return ids[row][mask[row].bool()][None]


def greedy(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **kwargs):
    """Greedy ``generate()`` returning sequences and the logits of every generated token."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )


class CharTokenizer:
    """A stand-in tokenizer over the tiny models' vocabulary: id ``i`` decodes to one character, so which
    ids end a sentence is known."""

    TEXT = "abcdefghij.klmnopq!rstuvw?xyz\n" * 4

    def __len__(self) -> int:
        return VOCAB

    def batch_decode(self, sequences):
        return ["".join(self.TEXT[i % len(self.TEXT)] for i in ids) for ids in sequences]
