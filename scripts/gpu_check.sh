#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run on a machine that has one, with the torch, Triton and
# transformers already installed there (nothing is installed: GPU machines often reach no package registry):
#   1. tests/test_cuda.py (tiny models of three families decoding on the GPU against the CPU, every shipped
#      recipe, the captured decode step against the eager one, no host synchronisation inside a captured
#      step), tests/test_kernels_prefill_fused.py and tests/test_kernels_triton.py (the Triton kernels compiled
#      for the GPU against their PyTorch references, bfloat16 included, which the CPU interpreter cannot check);
#   2. python -m benchmarks --only prefill_kernel gpu_decode -> benchmarks/results/cuda-<gpu>.{json,md} (the
#      prefill kernels against SDPA) and cuda-<gpu>-e2e.{json,md} (Llama 1B / 8B shapes decoding end to end
#      against transformers' default and static, compiled, captured paths).
#   bash scripts/gpu_check.sh [LOG_DIR]     # under 9 minutes on one H100
# Each step has its own time limit, so a step that hangs leaves the others their time; each step's output is
# also written to LOG_DIR (default: the current directory) as gpu_tests.log and gpu_benchmarks.log; the
# script goes on after a failing step and exits non-zero if any failed.
set -uo pipefail
log_dir=$(realpath "${1:-.}")
cd "$(dirname "$0")/.."
# the repository itself, not an installed copy; tests/ for the helpers the test files import
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())" || exit 2
# the C++ CPU kernels the CPU references use, built while nothing else needs the cores
python3 -m evictlayers.kernels build > "$log_dir/gpu_kernel_build.log" 2>&1 &
status=0
SECONDS=0
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_cuda.py \
    tests/test_kernels_prefill_fused.py tests/test_kernels_triton.py 2>&1 | tee "$log_dir/gpu_tests.log" || status=1
echo "tests: ${SECONDS}s"
timeout "${GPU_BENCHMARKS_S:-300}" python3 -m benchmarks --only prefill_kernel gpu_decode 2>&1 \
    | tee "$log_dir/gpu_benchmarks.log" || status=1
echo "tests and benchmarks: ${SECONDS}s"
wait
exit $status
