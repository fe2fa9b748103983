"""LongEval-style line retrieval (Li et al., 2023, "How long can open-source LLMs truly promise on
context length?"), the task of ClusterGen's Table 2: remember many numbered lines, recall one.

A prompt is LongEval's instruction, a record of ``n_lines`` lines ``line <name>: REGISTER_CONTENT is
<number>`` (``<name>`` an adjective-noun pair such as ``torpid-kid``, ``<number>`` in 1..50000 as in
LongEval), and the question for one of the lines, ending with an answer prefix
``The <REGISTER_CONTENT> in line <name> is <`` so that the next thing generated is the number.
A model passes when the first number it generates is the queried line's value (:func:`score_lines`).
Everything is generated here from a seed: no data set.

Which line is asked for is controlled like the passkey's depth: ``depth`` 0 asks for the first line
of the record, 1 for the last; by default the prompts spread evenly over 0..1.

Prompt format: raw text (no chat template), as the passkey task. Measured with
SmolLM2-135M-Instruct, full cache, greedy, 8 prompts per setting: the model answers with *some*
number of the record almost always, but the right one only 2-4 times out of 8 at 5-40 lines
(the chat template was no better): line retrieval is hard for a 135M model, so compare policies
against the full cache's score, not against 100%.
"""

from __future__ import annotations

import dataclasses
import random
import re

from evictlayers.eval.tasks.passkey import spread_depths

__all__ = ["LinesPrompt", "line_text", "lines_prompts", "parse_record", "score_lines"]

INSTRUCTION = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and "
    "contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, "
    "memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve "
    "the corresponding <REGISTER_CONTENT> of a certain line index. Now the record start:"
)
ADJECTIVES = (
    "ancient angry bitter bold brave bright calm clever crispy dark dusty eager fancy frozen gentle golden "
    "happy hollow icy jolly kind lazy lively moaning muddy noisy orange proud purple quiet righteous rusty "
    "shiny silly tall torpid ugly vast witty wooden young zealous"
).split()
NOUNS = (
    "anchor basket candle conversation dragon engine ethernet falcon forest garden glacier hammer harbor "
    "island jacket kettle kid ladder lantern magnet meadow mountain needle orchard parrot pencil quilt "
    "ribbon river rocket saddle shovel teapot tunnel umbrella village violin walrus window yacht zebra"
).split()
MAX_VALUE = 50000
LINE_PATTERN = re.compile(r"^line ([a-z]+-[a-z]+): REGISTER_CONTENT is <(\d+)>$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class LinesPrompt:
    """One line-retrieval prompt.

    Attributes:
        text: the full model input, ending with ``... in line <name> is <``.
        answer: the queried line's value, as a string.
        name: the queried line's name (``adjective-noun``).
        line: index of the queried line in the record (0-based).
        n_lines: number of lines in the record.
        depth: the requested depth in [0, 1] (``line == round(depth * (n_lines - 1))``).
        n_tokens: ``len(tokenizer.encode(text))``.
    """

    text: str
    answer: str
    name: str
    line: int
    n_lines: int
    depth: float
    n_tokens: int


def line_text(name: str, value: int | str) -> str:
    """One record line, exactly as LongEval writes it."""
    return f"line {name}: REGISTER_CONTENT is <{value}>"


def _question(name: str) -> str:
    return (
        f"Now the record is over. Tell me what is the <REGISTER_CONTENT> in line {name}? I need the number.\n"
        f"The <REGISTER_CONTENT> in line {name} is <"
    )


def _one_prompt(tokenizer, rng: random.Random, n_lines: int, depth: float) -> LinesPrompt:
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], n_lines)
    names = [f"{a}-{n}" for a, n in pairs]
    values = [rng.randint(1, MAX_VALUE) for _ in names]
    line = round(depth * (n_lines - 1))
    record = "\n".join(line_text(n, v) for n, v in zip(names, values, strict=True))
    text = f"{INSTRUCTION}\n\n{record}\n\n{_question(names[line])}"
    return LinesPrompt(
        text=text, answer=str(values[line]), name=names[line], line=line, n_lines=n_lines, depth=depth,
        n_tokens=len(tokenizer.encode(text)),
    )


def lines_prompts(
    tokenizer, n_prompts: int = 8, n_lines: int = 20, depth: float | None = None, seed: int = 0
) -> list[LinesPrompt]:
    """Line-retrieval prompts, deterministic for ``seed``.

    Args:
        tokenizer: anything with ``encode(text) -> list[int]`` (used to report ``n_tokens``).
        n_prompts: number of prompts (>= 1).
        n_lines: lines per record (2 .. number of distinct names, 1,681). Each line costs about
            17 tokens with SmolLM2's tokenizer; the instruction and question about 110.
        depth: which line is asked for, as a fraction of the record (0 = first line, 1 = last);
            ``None`` spreads the prompts evenly over 0..1 (``linspace``; a single prompt gets 0.5).
        seed: seeds names, values and (with ``depth=None``) nothing else: depths are deterministic.

    Returns:
        ``n_prompts`` :class:`LinesPrompt`; names are distinct within a record.
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    most = len(ADJECTIVES) * len(NOUNS)
    if not 2 <= n_lines <= most:
        raise ValueError(f"n_lines must be in [2, {most}] (distinct adjective-noun names), got {n_lines}")
    depths = spread_depths(n_prompts, depth)
    rng = random.Random(seed)
    return [_one_prompt(tokenizer, rng, n_lines, d) for d in depths]


def parse_record(text: str) -> dict[str, str]:
    """``{name: value}`` of every record line in a prompt (the question line is not a record line)."""
    return {name: value for name, value in LINE_PATTERN.findall(text)}


def score_lines(generated_text: str, answer: str) -> bool:
    """True when the first number (run of digits) in ``generated_text`` equals ``answer``."""
    match = re.search(r"\d+", generated_text)
    return match is not None and match.group() == str(answer)
