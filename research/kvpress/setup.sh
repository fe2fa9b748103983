#!/usr/bin/env bash
# A venv beside the main install for NVIDIA kvpress 0.5.5 (research/kvpress/run_presses.py runs in it).
#   bash research/kvpress/setup.sh [VENV]     # default: .venv-kvpress in the repository root
#
# kvpress 0.5.5 requires (its wheel's METADATA): transformers>=4.56.0,<5.3, torch>=2.3.1,<3,
# accelerate>=1.0,<2, cachetools>=5.5.2,<6, datasets>=2.21, fire>=0.6,<0.7, numpy>=2,<3, pandas>=2.2.2,<3,
# peft>=0.20, requests>=2.32.3,<3. The venv is made with --system-site-packages so it reuses the main
# install's torch 2.13.0 (CPU build), pinned here and in constraints.txt so that pip never swaps it for
# another build; it gets its own transformers, the newest kvpress allows (5.2.0), and whatever else
# kvpress needs that the main install lacks or holds at a version kvpress refuses (pandas 3). gguf reads
# the models' GGUF files (transformers' GGUF loader).
#
# pip then warns that evictlayers (the main install's, seen through the system site) requires
# transformers>=5.14: expected; the venv never runs evictlayers' cache code, only run_presses.py.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root

VENV=${1:-.venv-kvpress}
KVPRESS_VERSION=0.5.5
KVPRESS_TRANSFORMERS=5.2.0   # the newest transformers release below kvpress 0.5.5's bound (<5.3)

python -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c research/kvpress/constraints.txt \
    "kvpress==$KVPRESS_VERSION" "transformers==$KVPRESS_TRANSFORMERS" "torch==2.13.0" "gguf>=0.10.0"
"$VENV/bin/python" - <<PY
import importlib.metadata as m
import torch, transformers, kvpress  # noqa: F401
print("kvpress venv:", "$VENV", "| kvpress", m.version("kvpress"), "| transformers", transformers.__version__,
      "| torch", torch.__version__, "| gguf", m.version("gguf"))
assert m.version("kvpress") == "$KVPRESS_VERSION", m.version("kvpress")
assert transformers.__version__ == "$KVPRESS_TRANSFORMERS", transformers.__version__
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
PY
git check-ignore -q "$VENV" || echo "note: $VENV is not ignored by git (.gitignore ignores .venv/, .venv-compat/ and .venv-kvpress/)"
