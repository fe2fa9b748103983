"""``python -m research.claims``: run the claims' experiments on the embedded model and write the report.

    python -m research.claims [--doc research/reports/results.md] [--quick] [--only KEYS] [--recipes NAMES]
    python -m research.claims --render-only      # rebuild the report from the saved runs

Run it from the repository root (the default paths are relative to it); ``research/scripts/results.sh``
runs the whole report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evictlayers.cli import add_model_options, positive_int
from evictlayers.eval.tasks.documents import read_texts
from research.claims.command import REPORT, REPORT_ARTIFACTS
from research.claims.command import main as run_claims

PROG = "python -m research.claims"


def _names(text: str) -> list[str]:
    """A comma-separated option's names, empty ones dropped (``a,,b,`` -> ``[a, b]``)."""
    return [name for name in text.split(",") if name]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run the claims' experiments on the embedded model and write the report.")
    parser.add_argument("--doc", type=Path, default=REPORT, help="report path (%(default)s)")
    parser.add_argument("--artifacts", type=Path, default=None,
                        help=f"directory for JSON and plots (default: {REPORT_ARTIFACTS} for the default --doc, "
                             "else <doc without .md>/ next to the report)")
    parser.add_argument("--data-dir", dest="data", type=Path, default=None, help="directory of .txt books")
    parser.add_argument("--devices", type=positive_int, default=1, help="processes (Lightning DDP on CPU)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline, not the claims")
    parser.add_argument("--only", type=_names, default=None, metavar="KEYS",
                        help="re-run only these experiments (comma-separated keys, e.g. retrieval_filler,stream); "
                             "the others are kept from the saved artifacts")
    parser.add_argument("--recipes", type=_names, default=None, metavar="NAMES",
                        help="re-run only these recipes (comma-separated); their runs replace the saved ones, "
                             "and the report says which runs were measured when")
    parser.add_argument("--render-only", action="store_true",
                        help="rebuild the report from the artifacts of an earlier run, evaluating nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_model_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if not args.render_only:
            read_texts(args.data)  # a missing --data-dir fails before the model loads
        run_claims(doc=args.doc, artifacts=args.artifacts, data=args.data, model_name=args.model,
                   devices=args.devices, threads=args.threads, quick=args.quick, progress=not args.no_progress,
                   render_only=args.render_only, compile=args.compile, only=args.only, recipes=args.recipes)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
