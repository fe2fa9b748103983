"""``python -m research.transfer``: the tuning / held-out retrieval report (:mod:`research.transfer_report`)
from RULER runs of the protocol's splits, with streamed perplexity runs for the perplexity bound.

    python -m research.transfer RESULT... [--setting query_aware query_agnostic] [--out REPORT.md] [--plot P.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evictlayers.eval.ruler_report import plot_ruler
from evictlayers.eval.ruler_run import SETTINGS
from research.transfer_report import held_out_results, load, merge, settings_of, transfer_report

PROG = "python -m research.transfer"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Put RULER runs of the protocol's tuning and held-out splits (evictlayers eval --task ruler "
                    "--split ...) side by side per model, with streamed perplexity runs for the bounds check; "
                    "writes markdown.")
    parser.add_argument("results", nargs="+", type=Path, metavar="RESULT",
                        help="ruler.json / perplexity.json files or directories holding them")
    parser.add_argument("--setting", nargs="+", choices=SETTINGS, default=None,
                        help="settings to report, a section each (default: every setting the runs hold)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write (default: print only)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw the held-out score against the compression ratio, one row of panels per model")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
