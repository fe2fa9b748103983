"""``python -m research.needles``: per-head needle dumps, which layers and KV heads hold the pass key
(:mod:`research.passkey_needles`) or RULER's needles (:mod:`research.ruler_needles`) after the prompt.

    python -m research.needles RECIPE... --budget 0.2 --haystack prose --chat-format --out DIR
    python -m research.needles RECIPE... --task ruler --split held_out --lengths 1024 --out DIR

Writes ``needles.json`` and ``needles.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evictlayers.cli import add_model_options, budget_argument, load_model, positive_int
from evictlayers.eval.protocol import SPLITS
from evictlayers.eval.tasks.ruler import TASKS as RULER_TASKS

PROG = "python -m research.needles"
# option -> the only --task it applies to
TASK_OF_OPTION = {"haystack": "passkey", "chat": "passkey", "length": "passkey", "depths": "passkey",
                  "ruler_tasks": "ruler", "ruler_samples": "ruler", "lengths": "ruler", "split": "ruler",
                  "max_new_tokens": "ruler"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Prefill passkey prompts (or RULER's niah_* prompts, --task ruler) under each recipe and count, "
                    "per layer and KV head, the key's (each answer's) tokens still held (with --task ruler, also "
                    "which answers the question's own attention ranks within the budget in the unmodified model); "
                    "writes needles.json and needles.md.")
    parser.add_argument("recipes", nargs="+", metavar="RECIPE", help="shipped recipe names or YAML paths")
    parser.add_argument("--task", choices=("passkey", "ruler"), default="passkey", help="(passkey)")
    parser.add_argument("--budget", type=budget_argument, default=0.2, help="budget for every recipe but full (0.2)")
    parser.add_argument("--seed", type=int, default=None, help="prompt seed (0; ruler: the split's with --split)")
    parser.add_argument("--data-dir", dest="data", type=Path, default=None, help="directory of .txt books")
    parser.add_argument("--out", required=True, type=Path, help="directory for needles.json and needles.md")
    group = parser.add_argument_group("passkey")
    group.add_argument("--haystack", choices=("filler", "prose"), default=None, help="(prose)")
    group.add_argument("--chat-format", dest="chat", action="store_const", const=True, default=None,
                       help="wrap prompts in the chat template")
    group.add_argument("--length", type=positive_int, default=None, help="prompt length in tokens (1000)")
    group.add_argument("--depths", type=positive_int, default=None, help="prompts at evenly spaced key depths (8)")
    group = parser.add_argument_group("ruler (query-aware; the chat template where the tokenizer has one)")
    group.add_argument("--ruler-tasks", nargs="+", choices=[t for t, spec in RULER_TASKS.items() if spec.family == "niah"],
                       default=None, metavar="NAME", help="niah_* tasks (default: every one the split holds)")
    group.add_argument("--ruler-samples", type=positive_int, default=None, help="prompts per task and length (2)")
    group.add_argument("--lengths", type=positive_int, nargs="+", default=None, help="context lengths in tokens (1024)")
    group.add_argument("--split", choices=list(SPLITS), default=None, help="the protocol's split (default: none)")
    group.add_argument("--max-new-tokens", type=positive_int, default=None, help="tokens generated per prompt (64)")
    # the dumps prefill and decode eagerly, one prompt at a time: no --compile
    add_model_options(parser, with_compile=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch

    from evictlayers.compose import RecipeError
    from evictlayers.eval.runner import resolve_recipe
    from evictlayers.eval.suite import RulerTask
    from research import passkey_needles, ruler_needles

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    for option, task in TASK_OF_OPTION.items():
        if getattr(args, option) is not None and args.task != task:
            parser.error(f"--{option.replace('_', '-')} does not apply to --task {args.task} (it applies to --task {task})")
    try:
        for recipe in args.recipes:
            resolve_recipe(recipe)
    except (FileNotFoundError, RecipeError) as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, PROG)
    command = " ".join([PROG, *argv])  # written into the dump, to rerun it
    try:
        if args.task == "ruler":
            # default: every needle task (of the split's families, with --split)
            niah = [t for t in (SPLITS[args.split].tasks if args.split else RULER_TASKS) if RULER_TASKS[t].family == "niah"]
            task = RulerTask(tokenizer, tasks=args.ruler_tasks or niah, lengths=args.lengths or [1024],
                             samples=args.ruler_samples or 2, seed=args.seed, max_new_tokens=args.max_new_tokens or 64,
                             data=args.data, split=args.split)
            task.check_model(model)
            payload = ruler_needles.run_ruler_needles(model, tokenizer, args.recipes, args.budget, task, command)
            render = ruler_needles.markdown
        else:
            payload = passkey_needles.run_needles(
                model, tokenizer, args.recipes, args.budget, haystack=args.haystack or "prose", chat=bool(args.chat),
                length=args.length or 1000, depths=args.depths or 8, seed=args.seed or 0, data=args.data,
                command=command,
            )
            render = passkey_needles.markdown
    except ValueError as error:
        parser.error(str(error))
    paths = passkey_needles.write(payload, args.out, render)
    print(render(payload))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
