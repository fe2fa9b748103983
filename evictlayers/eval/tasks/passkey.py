"""Passkey retrieval (Mohtashami & Jaggi, 2023, "Landmark Attention"): find a 5-digit key in filler.

A prompt is an instruction, a haystack of repeated filler sentences with one key sentence
("The pass key is 48213. Remember it. 48213 is the pass key.") inserted at a controlled depth, and
the question "What is the pass key? The pass key is". A model passes when the first number it
generates is the key (:func:`score_passkey`). Everything is generated here from a seed: no data set.

Prompt format: raw text by default (``chat=False``), also for the instruct default model. Measured
with SmolLM2-135M-Instruct, full cache, greedy, 8 prompts of ~1500 tokens at depths linspace(0, 1),
seeds 0-5: raw text 45/48 correct (7, 7, 7, 8, 8, 8), the chat template (user turn = instruction +
haystack + question, assistant turn pre-filled with "The pass key is") 41/48. Raw text's misses are
all at depth 1.0, where "... is the pass key. What is the pass key? The pass key is" invites copying
"the pass key"; the chat format misses at depth ~0.14 every seed. Raw text also needs no template,
so it works unchanged for base models. ``chat=True`` gives the chat format.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence

__all__ = ["PasskeyPrompt", "passkey_grid", "passkey_prompts", "score_passkey"]

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
    """One passkey prompt.

    Attributes:
        text: the full model input as a string (chat-templated if chosen), ending with
            "The pass key is"; tokenise it with the tokenizer's defaults.
        answer: the 5-digit pass key, as a string.
        depth: the requested depth in [0, 1]: the key sentence follows ``round(depth * n)`` of the
            ``n`` filler sentences (0 = right after the instruction, 1 = right before the question).
        n_tokens: ``len(tokenizer.encode(text))``.
    """

    text: str
    answer: str
    depth: float
    n_tokens: int


def key_sentence(answer: str) -> str:
    """The sentence that hides ``answer`` in the haystack."""
    return f"The pass key is {answer}. Remember it. {answer} is the pass key."


def _render(tokenizer, chat: bool, n_filler: int, n_before: int, answer: str) -> str:
    """Prompt text with ``n_filler`` filler sentences, the key sentence after the first ``n_before``."""
    filler = [FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(n_filler)]
    haystack = " ".join(filler[:n_before] + [key_sentence(answer)] + filler[n_before:])
    if not chat:
        return f"{INSTRUCTION} {haystack} {QUESTION} {ANSWER_PREFIX}"
    messages = [{"role": "user", "content": f"{INSTRUCTION} {haystack} {QUESTION}"}]
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return head + ANSWER_PREFIX


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def _one_prompt(tokenizer, target_tokens: int, depth: float, answer: str, chat: bool) -> PasskeyPrompt:
    """Size the filler to ~``target_tokens``: estimate from the token cost per filler sentence, then
    correct from the measured length, at most 3 passes (token counts are near-additive over sentences)."""
    four, three = (_n_tokens(tokenizer, " ".join(FILLER_SENTENCES * k)) for k in (4, 3))
    per_sentence = max((four - three) / len(FILLER_SENTENCES), 1e-3)  # tokens per filler sentence
    overhead = _n_tokens(tokenizer, _render(tokenizer, chat, 0, 0, answer))
    n_filler = max(0, round((target_tokens - overhead) / per_sentence))
    for _ in range(3):
        text = _render(tokenizer, chat, n_filler, round(depth * n_filler), answer)
        n_tokens = _n_tokens(tokenizer, text)
        step = round((target_tokens - n_tokens) / per_sentence)
        if step == 0:
            break
        n_filler = max(0, n_filler + step)
    return PasskeyPrompt(text=text, answer=answer, depth=depth, n_tokens=n_tokens)


def spread_depths(n_prompts: int, depth: float | None) -> list[float]:
    """Each prompt's depth in [0, 1]: ``depth`` for all of them, or (``None``) evenly spread from
    0 to 1 (0.5 for a single prompt)."""
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1] or None (spread evenly), got {depth}")
    if depth is not None:
        return [float(depth)] * n_prompts
    if n_prompts == 1:
        return [0.5]
    return [i / (n_prompts - 1) for i in range(n_prompts)]


def passkey_prompts(
    tokenizer,
    n_prompts: int = 8,
    target_tokens: int = 1500,
    depth: float | None = None,
    seed: int = 0,
    chat: bool = False,
) -> list[PasskeyPrompt]:
    """Passkey prompts of about ``target_tokens`` tokens each, deterministic for ``seed``.

    Args:
        tokenizer: anything with ``encode(text) -> list[int]`` (and ``apply_chat_template`` when
            ``chat`` is used); lengths are measured with it.
        n_prompts: number of prompts (>= 1).
        target_tokens: wanted prompt length in tokens, including instruction, question and template;
            each prompt lands within about one filler sentence (~5 tokens) of it. Must exceed the
            length of a prompt with no filler.
        depth: fraction (0 = start, 1 = end of the filler) where the key sentence goes; ``None``
            spreads the prompts evenly over 0..1 (``linspace``; a single prompt gets 0.5).
        seed: seeds the keys (uniform 5-digit numbers, 10000..99999).
        chat: wrap in the tokenizer's chat template (see the module docstring for why the default
            is raw text).

    Returns:
        ``n_prompts`` :class:`PasskeyPrompt`.
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    depths = spread_depths(n_prompts, depth)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True needs a tokenizer with a chat template; this one has none (use chat=False)")
    rng = random.Random(seed)
    answers = [str(rng.randint(10000, 99999)) for _ in range(n_prompts)]
    minimum = _n_tokens(tokenizer, _render(tokenizer, chat, 0, 0, answers[0]))
    if target_tokens <= minimum:
        raise ValueError(f"target_tokens={target_tokens} is too short: a prompt without filler takes {minimum} tokens")
    return [_one_prompt(tokenizer, target_tokens, d, a, chat) for d, a in zip(depths, answers)]


def passkey_grid(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    per_cell: int = 1,
    seed: int = 0,
    chat: bool = False,
) -> dict[tuple[int, float], list[PasskeyPrompt]]:
    """Prompts for a length x depth grid (the "needle in a haystack" heat map).

    Returns:
        ``{(target_tokens, depth): [per_cell prompts]}`` for every pair, in ``lengths`` x ``depths``
        order. Each cell has its own keys, derived deterministically from ``seed`` and the cell index.
    """
    grid = {}
    for i, length in enumerate(lengths):
        for j, d in enumerate(depths):
            cell_seed = seed * 1_000_003 + i * len(depths) + j
            grid[(int(length), float(d))] = passkey_prompts(
                tokenizer, n_prompts=per_cell, target_tokens=length, depth=d, seed=cell_seed, chat=chat
            )
    return grid


def score_passkey(generated_text: str, answer: str) -> bool:
    """True when the first number (run of digits) in ``generated_text`` equals ``answer``."""
    match = re.search(r"\d+", generated_text)
    return match is not None and match.group() == str(answer)
