"""RULER's synthetic tasks, generated offline (Hsieh et al. 2024, "RULER: What's the Real Context Size
of Your Long-Context Language Models?"; NVIDIA/RULER ``scripts/data/synthetic``).

Eleven tasks (:data:`~evictlayers.eval.tasks.ruler.spec.TASKS`): ``niah_single_1/2/3``,
``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery`` (:mod:`.niah`), ``vt``
(:mod:`.variable_tracking`), ``cwe`` and ``fwe`` (:mod:`.words`). RULER's QA tasks are left out:
their haystacks are SQuAD and HotpotQA paragraphs, which cannot be downloaded here.

:func:`ruler_samples` builds seeded, deterministic prompts of any length in tokens, measured with the
model's tokenizer; :mod:`.scoring` scores answers as RULER does. The single-needle tasks
(:data:`SINGLE_NEEDLE`) also take a fixed needle depth (``depth=``, :func:`check_depths`), for the
depth x length heat map (:mod:`evictlayers.eval.needle_map`). Deviations from RULER, each said where
it happens: book sentences instead of Paul Graham's essays and a vocabulary from the books instead
of ``wonderwords`` (:mod:`.sources`); the tokenizer's chat template instead of RULER's hand-written
per-model templates (:mod:`.prompt`); distinct keys and values within a prompt (:mod:`.niah`); a
regular-expression sentence splitter instead of nltk's punkt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from evictlayers.eval.tasks.ruler.niah import niah_sampler
from evictlayers.eval.tasks.ruler.prompt import Parts, count_tokens, fit, render, split_ids
from evictlayers.eval.tasks.ruler.scoring import postprocess, sample_score, string_match_all, string_match_part
from evictlayers.eval.tasks.ruler.sources import Books
from evictlayers.eval.tasks.ruler.spec import GROUPS, LEFT_OUT, TASKS, TaskSpec, group_of
from evictlayers.eval.tasks.ruler.variable_tracking import vt_sampler
from evictlayers.eval.tasks.ruler.words import cwe_sampler, fwe_sampler

__all__ = [
    "GROUPS", "LEFT_OUT", "SINGLE_NEEDLE", "TASKS", "TEMPLATES", "Books", "Parts", "RulerSample", "TaskSpec",
    "check_depths", "group_of", "postprocess", "ruler_samples", "sample_score", "string_match_all",
    "string_match_part", "use_chat",
]

TEMPLATES = ("auto", "chat", "base")

# the tasks whose prompt holds one needle (one key, one value, one question, no haystack of distractor
# needles): the ones a depth applies to
SINGLE_NEEDLE = tuple(
    name for name, spec in TASKS.items()
    if spec.family == "niah" and spec.args["haystack"] != "needle"
    and max(spec.args["num_keys"], spec.args["num_queries"]) * spec.args["num_values"] == 1
)


def check_depths(depths: Sequence[int], tasks: Sequence[str] | None = None) -> list[int]:
    """Needle depths (``--ruler-depths``), sorted and without repeats, checked against ``tasks`` (``None``:
    the tasks are not chosen yet; the caller then runs the single-needle ones).

    Raises:
        ValueError: every problem at once: no depth, a depth that is not a whole percentage in 0..100, a
            task with several needles or none.
    """
    problems = []
    depths = list(depths)
    bad = [d for d in depths if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 100]
    if not depths:
        problems.append("no depth given")
    if bad:
        problems.append(f"{bad} not whole percentages from 0 to 100 (0: the needle before the whole haystack, "
                        "100: after it)")
    other = [t for t in tasks or () if t not in SINGLE_NEEDLE]
    if other:
        problems.append(f"task(s) {other} (--ruler-tasks) do not hold exactly one needle; a depth applies only to "
                        f"the single-needle tasks {', '.join(SINGLE_NEEDLE)}")
    if problems:
        raise ValueError("ruler depths (--ruler-depths): " + "; ".join(problems))
    return sorted(set(depths))


@dataclasses.dataclass(frozen=True)
class RulerSample:
    """One prompt: its text, its token ids (whole prompt), how many leading ids are the context (the
    rest is the question, the end of the chat template and the answer prefix), the references, and
    how many tokens the task may generate."""

    task: str
    length: int
    index: int
    text: str
    input_ids: tuple[int, ...]
    n_context: int
    answers: tuple[str, ...]
    max_new_tokens: int
    haystack: int
    depth: int | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


def use_chat(tokenizer, template: str) -> bool:
    """Whether prompts go through the chat template: ``auto`` = where the tokenizer has one, ``chat`` =
    always (an error without one), ``base`` = never (RULER's ``base`` template: the plain task input).

    Raises:
        ValueError: an unknown ``template``, or ``chat`` with a tokenizer that has no chat template.
    """
    if template not in TEMPLATES:
        raise ValueError(f"ruler template={template!r} (--ruler-template): expected one of {', '.join(TEMPLATES)}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has:
        raise ValueError(
            "ruler template='chat' (--ruler-template chat) needs a tokenizer with a chat template, and this one "
            "has none; use 'auto' (the chat template where there is one, else plain text) or 'base' (plain text)"
        )
    return has if template == "auto" else template == "chat"


def _sampler(spec: TaskSpec, key: str, books: Books | None, tokenizer, length: int, generate: int,
             depth: int | None = None):
    if spec.family == "niah":
        return niah_sampler(spec.args, key, books, depth)
    if spec.family == "vt":
        # RULER measures its worked example as plain text, without special tokens
        return vt_sampler(spec.args, key, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    if spec.family == "cwe":
        return cwe_sampler(spec.args, key, books.vocabulary, length)
    return fwe_sampler(spec.args, key, length, generate)


def ruler_samples(
    tokenizer,
    task: str,
    length: int,
    n_samples: int = 1,
    seed: int = 0,
    chat: bool = False,
    books: Books | None = None,
    max_new_tokens: int | None = None,
    depth: int | None = None,
) -> list[RulerSample]:
    """``n_samples`` prompts of RULER task ``task`` for a context of ``length`` tokens.

    As RULER: the prompt's tokens plus the tokens the task may generate (RULER's ``tokens_to_generate``,
    or ``max_new_tokens``) fit in ``length``, with the largest haystack that does. Sample ``i`` is
    drawn from a generator seeded by ``(seed, task, length, i)``, so it does not depend on which other
    tasks or how many samples are asked for.

    ``depth`` (percent, single-needle tasks only, :data:`SINGLE_NEEDLE`) puts the needle after
    ``floor(units * depth / 100)`` of the haystack's units (essay sentences, noise lines): 0 = first,
    100 = last. Sample ``i`` is then seeded by ``(seed, task, length, depth, i)``, so a depth's prompts do
    not depend on which other depths are asked; without it (default) the needle's depth is drawn as in
    RULER, with the same prompts as before depths existed.

    Args:
        tokenizer: a Hugging Face tokenizer (``__call__``, and ``apply_chat_template`` with ``chat``).
        chat: render through the chat template (see :func:`use_chat`).
        books: the PG-19 books (:class:`~.sources.Books`), needed by tasks with essay haystacks or word
            keys and by ``cwe``.

    Raises:
        ValueError: unknown task (the message lists the tasks), a length too short for the task,
            missing books, or a depth outside 0..100 or for a task without exactly one needle.
    """
    spec = TASKS.get(task)
    if spec is None:
        left = f"; {', '.join(LEFT_OUT)} are left out ({'; '.join(LEFT_OUT.values())})" if task in LEFT_OUT else ""
        raise ValueError(f"unknown RULER task {task!r}{left}; the tasks: {', '.join(TASKS)}")
    if n_samples < 1:
        raise ValueError(f"ruler samples must be >= 1, got {n_samples}")
    if spec.needs_books and books is None:
        raise ValueError(f"RULER task {task} needs books (its essay haystack or word list): pass books=Books(read_texts())")
    if depth is not None:
        check_depths([depth], [task])
    generate = spec.tokens_to_generate if max_new_tokens is None else max_new_tokens
    what = f"RULER task {task} at length {length} (with {generate} tokens to generate)"
    if depth is not None:
        what += f" at depth {depth}%"
    if length - generate < 1:
        raise ValueError(f"{what}: the length leaves no room for a prompt")

    def size(parts: Parts) -> int:
        return len(count_tokens(tokenizer, render(tokenizer, parts, chat)[0], chat))

    samples = []
    for i in range(n_samples):
        key = f"ruler:{seed}:{task}:{length}:{i}" if depth is None else f"ruler:{seed}:{task}:{length}:depth{depth}:{i}"
        make, smallest = _sampler(spec, key, books, tokenizer, length, generate, depth)
        parts = fit(make, size, length - generate, smallest, what)
        text, split = render(tokenizer, parts, chat)
        ids, n_context = split_ids(tokenizer, text, split, chat)
        samples.append(RulerSample(task=task, length=length, index=i, text=text, input_ids=tuple(ids),
                                   n_context=n_context, answers=parts.answers, max_new_tokens=generate,
                                   haystack=parts.haystack, depth=depth))
    return samples
