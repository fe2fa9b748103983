"""Shared pieces of the eval tests: a character-level Hugging Face tokenizer and a tiny random Llama
built from a config (no hub access), small enough that a streamed document takes milliseconds."""

from __future__ import annotations

import string

import torch
import transformers

CHARS = string.ascii_letters + string.digits + " \n.,:;?!'\"<>-_()"
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character (unknown characters -> ``<unk>``), left padding, decode joins tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side="left",
    )


def tiny_llama(vocab_size: int, seed: int = 0, attn_implementation: str = "sdpa") -> transformers.LlamaForCausalLM:
    """A 2-layer float32 Llama (4 query / 2 KV heads, GQA), eval mode, generation never stops early."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.15, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    return model


def save_tiny_checkpoint(path):
    """A tiny Llama and its character tokenizer saved in ``path`` like any local checkpoint; returns ``path``."""
    tok = char_tokenizer()
    tiny_llama(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_char_tokenizer_round_trips():
    tok = char_tokenizer()
    text = "line torpid-kid: REGISTER_CONTENT is <4021>\nThe pass key is 12345."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text)


def tiny_mistral(vocab_size: int, sliding_window: int | None, seed: int = 0) -> transformers.MistralForCausalLM:
    """A 2-layer Mistral; with ``sliding_window`` the unmodified model attends to the last
    ``sliding_window`` positions (itself included): the banded-attention reference for a local window."""
    config = transformers.MistralConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, initializer_range=0.15,
        sliding_window=sliding_window, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM(config).float().eval()


def teacher_forced_perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) of ``ids`` [B, L] from one full-attention forward of the unmodified model."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return float(torch.exp(nll))
