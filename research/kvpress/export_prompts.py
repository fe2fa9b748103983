"""The RULER prompts ``evictlayers eval --task ruler --split held_out`` runs, written to JSON for kvpress.

Runs in the main install (it imports evictlayers)::

    python -m research.kvpress.export_prompts --model default --lengths 4096 --ruler-samples 20 \\
        --out out/kvpress/default-4096/prompts.json

The prompts come from evictlayers' own generation: the ``ruler`` task is built with ``make_task`` from the
options the command line would pass it (the split's books, seed and tasks, the chat template, the per-task
generation lengths), each prompt comes from :func:`evictlayers.eval.tasks.ruler.ruler_samples` with that
task's settings, and the export is refused unless its token ids are, prompt for prompt, the ones the task
feeds the model (``RulerTask.rows()``). Nothing here generates or tokenises a prompt.

Per prompt the file holds the token ids (the chat template's special tokens included, as evictlayers feeds
them), the references, the task's ``max_new_tokens`` and two splits of the ids:

- ``n_context``: evictlayers' context / question split (``RulerSample.n_context``): the query-agnostic
  setting compresses these ids, then feeds the rest (question, end of the chat template, answer prefix);
- ``n_question_end``: the ids up to the end of the question. kvpress's query-aware setting (its
  evaluation's ``--query_aware``: ``context = context + question``, ``question = ""``) compresses these and
  feeds the rest, the end of the chat template and the answer prefix, after compression, as its pipeline
  does. evictlayers' own query-aware run compresses the whole prompt instead; the README says so.

The question's end is located from the prompt's own parts: while ``ruler_samples`` runs, evictlayers'
``render`` is wrapped (not replaced) to note the parts each rendered text came from. ``--text`` adds each
prompt's text: it quotes the books' sentences, so keep such a file out of the repository (``out/`` is
ignored by git).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FORMAT", "export_prompts", "main", "packaged_model_info"]

FORMAT = "evictlayers-kvpress-prompts/1"
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _rendered_parts():
    """While active, ``{text: (parts, question start)}`` of every prompt evictlayers' RULER code renders."""
    import evictlayers.eval.tasks.ruler as ruler

    original = ruler.render
    seen: dict[str, tuple] = {}

    def render(tokenizer, parts, chat):
        text, split = original(tokenizer, parts, chat)
        seen[text] = (parts, split)
        return text, split

    ruler.render = render
    try:
        yield seen
    finally:
        ruler.render = original


def _question_end(tokenizer, sample, parts, split: int, chat: bool) -> int:
    """How many leading ids of ``sample`` are its context and question (evictlayers' ``split_ids`` at the
    question's last character), checked against the sample's ids and context split."""
    from evictlayers.eval.tasks.ruler.prompt import split_ids

    end = split + len(parts.question)
    if sample.text[split:end] != parts.question:
        raise ValueError(f"{sample.task} sample {sample.index}: the question is not where the prompt's parts put it")
    ids, n_context = split_ids(tokenizer, sample.text, split, chat)
    same_ids, n_end = split_ids(tokenizer, sample.text, end, chat)
    if list(sample.input_ids) != ids or ids != same_ids or n_context != sample.n_context:
        raise ValueError(f"{sample.task} sample {sample.index}: re-splitting the prompt gave other ids")
    if not sample.n_context <= n_end < len(ids):
        raise ValueError(f"{sample.task} sample {sample.index}: the question ends at id {n_end} of {len(ids)} "
                         f"(context: {sample.n_context}); kvpress needs ids after it")
    return n_end


def packaged_model_info(name: str) -> dict | None:
    """Where the packaged model ``name`` (``default`` = SmolLM2) lives: the GGUF's name, the module that holds
    (or joins) it and its pip requirements; the GGUF's path and size where it is one file. ``None`` for a
    checkpoint directory or hub id."""
    from evictlayers import models

    model = models.SMOLLM2 if name == "default" else models.PACKAGED_MODELS.get(name)
    if model is None:
        return None
    info = {"name": model.name, "gguf": model.gguf, "module": model.module, "requirements": list(model.requirements),
            "chunked": model.chunked}
    if not model.chunked:
        path = models._packaged_file(model)  # evictlayers' own lookup: the file `evictlayers eval` converts
        info |= {"path": str(path), "size": path.stat().st_size}
    return info


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def cli_command(model_name: str, options: dict) -> str:
    """The ``evictlayers eval`` command line that runs the same prompts (recipes and budgets left to fill)."""
    flags = {"tasks": "--ruler-tasks", "lengths": "--lengths", "samples": "--ruler-samples", "split": "--split",
             "template": "--ruler-template", "max_new_tokens": "--max-new-tokens", "data": "--data-dir"}
    parts = ["evictlayers eval RECIPE... --budget BUDGET... --task ruler", f"--model {model_name}"]
    for key, flag in flags.items():
        value = options.get(key)
        if value is not None:
            parts.append(f"{flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    return " ".join(parts + ["--ruler-setting query_aware query_agnostic"])


def export_prompts(
    tokenizer,
    model_name: str,
    *,
    lengths: Sequence[int] | None = None,
    samples: int | None = None,
    tasks: Sequence[str] | None = None,
    split: str | None = "held_out",
    template: str | None = None,
    max_new_tokens: int | None = None,
    data=None,
    model=None,
    model_info: dict | None = None,
    text: bool = False,
) -> dict:
    """The prompts of ``evictlayers eval --task ruler`` with these options (``None``: the command line's
    default), as the JSON document :mod:`research.kvpress.run_presses` reads.

    ``model``, where given, is checked as the command line checks it (a length above its
    ``max_position_embeddings`` is refused). ``model_info`` (:func:`packaged_model_info`) tells
    run_presses which GGUF to load. ``text=True`` adds each prompt's text.

    Raises:
        ValueError: an option the ``ruler`` task refuses (its own message), or prompts that differ from the
            ones the task runs.
    """
    from evictlayers.eval.suite import make_task
    from evictlayers.eval.tasks.ruler import group_of, ruler_samples

    given = {"lengths": None if lengths is None else list(lengths), "samples": samples,
             "tasks": None if tasks is None else list(tasks), "split": split, "template": template,
             "max_new_tokens": max_new_tokens, "data": None if data is None else str(data)}
    options = {k: v for k, v in given.items() if v is not None}
    task = make_task("ruler", tokenizer, **options)  # the command line's task: its checks, books, seed, template
    if model is not None:
        task.check_model(model)
    prompts = []
    for length in task.lengths:
        for name in task.tasks:
            with _rendered_parts() as seen:
                made = ruler_samples(tokenizer, name, length, task.samples, task.seed, task.chat, task.books,
                                     task.max_new_tokens)
            for sample in made:
                parts, split_at = seen[sample.text]
                prompt = {
                    "id": f"{sample.task}/{sample.length}/{sample.index}", "task": sample.task,
                    "group": group_of(sample.task), "length": sample.length, "sample": sample.index,
                    "input_ids": list(sample.input_ids), "n_context": sample.n_context,
                    "n_question_end": _question_end(tokenizer, sample, parts, split_at, task.chat),
                    "answers": list(sample.answers), "max_new_tokens": sample.max_new_tokens,
                    "n_tokens": sample.n_tokens, "haystack": sample.haystack,
                }
                if text:
                    prompt["text"] = sample.text
                prompts.append(prompt)
    # the prompts the command line feeds the model, in its order (one setting: the rows repeat per setting)
    rows = [r for r in task.rows() if r["setting"] == task.setting[0]]
    theirs = [(r["task"], r["length"], r["sample"], r["input_ids"], r["n_context"], r["answers"], r["max_new_tokens"])
              for r in rows]
    ours = [(p["task"], p["length"], p["sample"], p["input_ids"], p["n_context"], p["answers"], p["max_new_tokens"])
            for p in prompts]
    if ours != theirs:
        raise ValueError("the exported prompts differ from the ones `evictlayers eval --task ruler` runs with these "
                         "options; the export would not compare like with like")
    settings = task.settings()
    settings.pop("setting", None)  # the settings kvpress runs are chosen by run_presses
    settings.pop("n_bins", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {
        "format": FORMAT,
        "model": model_name,
        "packaged_model": model_info,
        "tokenizer": {"eos_token_id": eos, "pad_token_id": getattr(tokenizer, "pad_token_id", None),
                      "chat_template": bool(getattr(tokenizer, "chat_template", None))},
        "settings": settings,
        "cli": cli_command(model_name, options),
        "evictlayers_commit": _git_commit(),
        "prompts": prompts,
    }


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    from evictlayers.eval.protocol import SPLITS
    from evictlayers.eval.tasks.ruler import TASKS, TEMPLATES

    parser = argparse.ArgumentParser(prog="python -m research.kvpress.export_prompts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="as `evictlayers eval --model` (default: %(default)s)")
    parser.add_argument("--lengths", nargs="+", type=_positive, default=None, help="as evictlayers eval (4096)")
    parser.add_argument("--ruler-samples", type=_positive, default=None, help="prompts per task and length (10)")
    parser.add_argument("--ruler-tasks", nargs="+", choices=list(TASKS), default=None, metavar="NAME",
                        help="RULER tasks (default: all of the split's)")
    parser.add_argument("--split", choices=list(SPLITS), default="held_out", help="(default: %(default)s)")
    parser.add_argument("--ruler-template", choices=TEMPLATES, default=None, help="as evictlayers eval (auto)")
    parser.add_argument("--max-new-tokens", type=_positive, default=None,
                        help="tokens generated per prompt, also reserved out of the length (RULER's per task)")
    parser.add_argument("--data-dir", default=None, help="the books (default: as evictlayers eval)")
    parser.add_argument("--text", action="store_true", help="also write each prompt's text (it quotes the books)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)

    from evictlayers.cli import load_model

    model, tokenizer = load_model(args.model, prog=parser.prog)
    try:
        doc = export_prompts(tokenizer, args.model, lengths=args.lengths, samples=args.ruler_samples,
                             tasks=args.ruler_tasks, split=args.split, template=args.ruler_template,
                             max_new_tokens=args.max_new_tokens, data=args.data_dir, model=model,
                             model_info=packaged_model_info(args.model), text=args.text)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc))
    counts: dict[str, int] = {}
    for p in doc["prompts"]:
        counts[p["task"]] = counts.get(p["task"], 0) + 1
    print(f"wrote {args.out}: {len(doc['prompts'])} prompts of {args.model} "
          f"({', '.join(f'{t} {n}' for t, n in counts.items())}), lengths {doc['settings']['lengths']}, "
          f"split {doc['settings']['split']}, chat template {doc['settings']['chat']}")
    print(f"the same prompts: {doc['cli']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
