"""Passkey retrieval (Mohtashami & Jaggi, 2023, "Landmark Attention"): find a 5-digit key in filler.

A prompt is an instruction, a haystack of repeated filler sentences with one key sentence
("The pass key is 48213. Remember it. 48213 is the pass key.") inserted at a controlled depth, and
the question "What is the pass key? The pass key is". A model passes when the first number it
generates is the key (:func:`score_passkey`). Everything is generated here from a seed: no data set.

``haystack="prose"`` replaces the filler with consecutive sentences of a book (PG-19 by default, read
at run time from the data directory, never stored): each prompt takes a slice of a different book at a
seeded offset, and the key sentence goes between two sentences at the requested depth. Repeated filler
makes the key sentence the odd one out by its keys; in prose every sentence is different, so a scorer
must find the key by what the question attends to (no single kvpress press holds on both).
With SmolLM2-135M-Instruct and a full cache (8 prompts of ~1,300 tokens, seed 0), the raw format finds
3/8 prose keys and the chat format 6/8, so the retrieval experiment asks prose in the chat format.

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

HAYSTACKS = ("filler", "prose")

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


def _render(tokenizer, chat: bool, sentences: Sequence[str], n_before: int, answer: str) -> str:
    """Prompt text with the haystack ``sentences``, the key sentence after the first ``n_before``."""
    haystack = " ".join([*sentences[:n_before], key_sentence(answer), *sentences[n_before:]])
    if not chat:
        return f"{INSTRUCTION} {haystack} {QUESTION} {ANSWER_PREFIX}"
    messages = [{"role": "user", "content": f"{INSTRUCTION} {haystack} {QUESTION}"}]
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return head + ANSWER_PREFIX


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def filler_sentences(n: int) -> list[str]:
    """The first ``n`` sentences of the repeated filler."""
    return [FILLER_SENTENCES[i % len(FILLER_SENTENCES)] for i in range(n)]


def prose_sentences(text: str, offset: int, limit: int = 2000) -> list[str]:
    """Up to ``limit`` whole sentences of ``text`` from the first sentence start after ``offset``
    (whitespace collapsed, so a book's line breaks do not reach the prompt)."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text[offset : offset + limit * 200].split()))
    return [s for s in sentences[1:] if s][:limit]  # the first piece is the tail of a cut sentence


def _one_prompt(tokenizer, target_tokens: int, depth: float, answer: str, chat: bool,
                pool: Sequence[str] | None = None) -> PasskeyPrompt:
    """Size the haystack to ~``target_tokens``: take sentences from ``pool`` (default: the filler) while
    the estimated length fits, then correct from the measured length, at most 3 passes (token counts
    are near-additive over sentences)."""
    pool = list(pool) if pool is not None else filler_sentences(4 * target_tokens)
    overhead = _n_tokens(tokenizer, _render(tokenizer, chat, [], 0, answer))
    n, total = 0, overhead
    while n < len(pool) and total + _n_tokens(tokenizer, " " + pool[n]) <= target_tokens:
        total += _n_tokens(tokenizer, " " + pool[n])
        n += 1
    for _ in range(3):
        text = _render(tokenizer, chat, pool[:n], round(depth * n), answer)
        n_tokens = _n_tokens(tokenizer, text)
        per_sentence = max((n_tokens - overhead) / max(n, 1), 1.0)
        step = round((target_tokens - n_tokens) / per_sentence)
        step = max(-n, min(step, len(pool) - n))
        if step == 0:
            break
        n += step
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
    haystack: str = "filler",
    texts: Sequence[tuple[str, str]] | None = None,
) -> list[PasskeyPrompt]:
    """Passkey prompts of about ``target_tokens`` tokens each, deterministic for ``seed``.

    Args:
        tokenizer: anything with ``encode(text) -> list[int]`` (and ``apply_chat_template`` when
            ``chat`` is used); lengths are measured with it.
        n_prompts: number of prompts (>= 1).
        target_tokens: wanted prompt length in tokens, including instruction, question and template;
            each prompt lands within about one haystack sentence of it. Must exceed the length of a
            prompt with no haystack.
        depth: fraction (0 = start, 1 = end of the haystack) where the key sentence goes; ``None``
            spreads the prompts evenly over 0..1 (``linspace``; a single prompt gets 0.5).
        seed: seeds the keys (uniform 5-digit numbers, 10000..99999) and the prose offsets.
        chat: wrap in the tokenizer's chat template (see the module docstring for why the default
            is raw text).
        haystack: ``"filler"`` (repeated sentences) or ``"prose"`` (sentences of ``texts``).
        texts: ``[(name, text)]`` books for ``"prose"`` (``documents.read_texts``); prompt ``i`` takes
            book ``i % len(texts)`` from a seeded offset in its first 60%.

    Returns:
        ``n_prompts`` :class:`PasskeyPrompt`.
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"passkey haystack={haystack!r}: expected one of {HAYSTACKS}")
    if haystack == "prose" and not texts:
        raise ValueError("passkey haystack='prose' needs texts: [(name, text)] books, e.g. documents.read_texts()")
    depths = spread_depths(n_prompts, depth)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=True needs a tokenizer with a chat template; this one has none (use chat=False)")
    rng = random.Random(seed)
    answers = [str(rng.randint(10000, 99999)) for _ in range(n_prompts)]
    minimum = _n_tokens(tokenizer, _render(tokenizer, chat, [], 0, answers[0]))
    if target_tokens <= minimum:
        raise ValueError(f"target_tokens={target_tokens} is too short: a prompt without haystack takes {minimum} tokens")
    prompts = []
    for i, (d, answer) in enumerate(zip(depths, answers)):
        pool = None
        if haystack == "prose":
            name, text = texts[i % len(texts)]
            pool = prose_sentences(text, rng.randint(0, max(0, int(len(text) * 0.6))))
            if not pool:
                raise ValueError(f"passkey haystack='prose': {name} has no sentences at the chosen offset")
        prompts.append(_one_prompt(tokenizer, target_tokens, d, answer, chat, pool))
    return prompts


def passkey_grid(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    per_cell: int = 1,
    seed: int = 0,
    chat: bool = False,
    haystack: str = "filler",
    texts: Sequence[tuple[str, str]] | None = None,
) -> dict[tuple[int, float], list[PasskeyPrompt]]:
    """Prompts for a length x depth grid (the "needle in a haystack" heat map); ``haystack`` and
    ``texts`` as in :func:`passkey_prompts` (a prose grid takes cell ``c``'s books from ``texts[c:]``).

    Returns:
        ``{(target_tokens, depth): [per_cell prompts]}`` for every pair, in ``lengths`` x ``depths``
        order. Each cell has its own keys, derived deterministically from ``seed`` and the cell index.
    """
    grid = {}
    for i, length in enumerate(lengths):
        for j, d in enumerate(depths):
            cell_seed = seed * 1_000_003 + i * len(depths) + j
            cell = i * len(depths) + j
            books = [*texts[cell % len(texts):], *texts[: cell % len(texts)]] if texts else None
            grid[(int(length), float(d))] = passkey_prompts(
                tokenizer, n_prompts=per_cell, target_tokens=length, depth=d, seed=cell_seed, chat=chat,
                haystack=haystack, texts=books,
            )
    return grid


def score_passkey(generated_text: str, answer: str) -> bool:
    """True when the first number (run of digits) in ``generated_text`` equals ``answer``."""
    match = re.search(r"\d+", generated_text)
    return match is not None and match.group() == str(answer)
