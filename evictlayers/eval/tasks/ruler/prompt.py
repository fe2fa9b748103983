"""A RULER prompt from its parts: rendering (plain or through the tokenizer's chat template), the split
between context and question, and sizing the haystack to a length in tokens.

RULER's prompt is ``model template(task input) + answer prefix``, where the task input is the
instruction, the haystack and the question, and the model template is a hand-written string per
model family (``scripts/data/template.py``; ``base`` = no template). Here the template is the
tokenizer's own chat template, with the task input as the user message and RULER's answer prefix
after the generation prompt (its leading space dropped there, as kvpress does, since the assistant
turn starts on a fresh line). Worked examples (common-words extraction) become earlier user/assistant
turns, as RULER wraps each of them in the model template too.

Lengths follow RULER: the prompt's tokens (template included) plus the tokens the task may generate
must fit the requested length, and the haystack is the largest that does (RULER's binary search over
the haystack size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

__all__ = ["Parts", "count_tokens", "fit", "render", "split_ids"]


@dataclasses.dataclass(frozen=True)
class Parts:
    """One task input before rendering.

    Attributes:
        context: everything before the question (instruction and haystack), as RULER writes it.
        question: the question (after the context; left out of the compression in the
            query-agnostic setting).
        answer_prefix: RULER's answer prefix, with its leading space.
        answers: the reference strings RULER scores against.
        shots: worked examples shown before the task, ``(input, answer)`` pairs.
        haystack: the haystack size the parts were built with (words, lines or list entries).
    """

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    shots: tuple[tuple[str, str], ...] = ()
    haystack: int = 0


def render(tokenizer, parts: Parts, chat: bool) -> tuple[str, int]:
    """``(prompt text, index of the character where the question starts)``."""
    if not chat:
        # RULER: each worked example is the full template with its answer, one per line, then the task
        head = "".join(user + answer + "\n" for user, answer in parts.shots)
        text = head + parts.context + parts.question + parts.answer_prefix
        return text, len(head) + len(parts.context)
    messages = []
    for user, answer in parts.shots:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer.lstrip()}]
    messages.append({"role": "user", "content": parts.context + parts.question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += parts.answer_prefix.lstrip()
    split = text.rfind(parts.question)
    if split < 0:
        raise ValueError("the tokenizer's chat template changed the question's text; it cannot be split from the context")
    return text, split


def count_tokens(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's token ids: a chat template writes its own special tokens; plain text gets the
    tokenizer's usual ones (a BOS where the tokenizer adds one)."""
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def split_ids(tokenizer, text: str, split: int, chat: bool) -> tuple[list[int], int]:
    """``(ids of the whole prompt, number of leading ids that are the context)``.

    The whole prompt is tokenised once, so both settings feed the same tokens; the context is the
    longest prefix of those ids that the text before the question also tokenises to.
    """
    ids = count_tokens(tokenizer, text, chat)
    head = count_tokens(tokenizer, text[:split], chat)
    n = 0
    while n < min(len(ids), len(head)) and ids[n] == head[n]:
        n += 1
    return ids, n


def fit(make: Callable[[int], Parts], size: Callable[[Parts], int], limit: int, smallest: int,
        what: str, strict: bool = True) -> Parts:
    """The parts with the largest haystack ``n >= smallest`` whose ``size`` is at most ``limit`` tokens
    (doubling, then bisection, as RULER's search; token counts grow with the haystack almost
    monotonically). With ``strict=False`` the smallest haystack is returned when none fits (RULER's
    fallback for its worked examples).

    Raises:
        ValueError: ``strict`` and even the smallest haystack does not fit (``what`` names the task
            and length).
    """
    best = make(smallest)
    need = size(best)
    if need > limit:
        if not strict:
            return best
        raise ValueError(f"{what}: the smallest prompt takes {need} tokens, more than the {limit} available; "
                         "ask for a longer length")
    low, high = smallest, smallest * 2
    while True:
        parts = make(high)
        if size(parts) > limit:
            break
        low, best, high = high, parts, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        parts = make(mid)
        if size(parts) <= limit:
            low, best = mid, parts
        else:
            high = mid
    return best


def join_queries(queries: Sequence[str]) -> str:
    """RULER's list of asked keys: ``a``, ``a, and b``, ``a, b, and c``."""
    return queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
