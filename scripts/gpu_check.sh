#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run on a machine that has one, with the torch, Triton and
# transformers already installed there (nothing is installed: GPU machines often reach no package registry):
#   1. tests/test_kernels_triton.py: the Triton kernels compiled for the GPU against their PyTorch references
#      (bfloat16 cases included, which the CPU interpreter cannot check);
#   2. tests/test_cuda.py: tiny models of three families decoding on the GPU against the CPU, every shipped
#      recipe, the compiled whole forward, the eager launches;
#   3. python -m benchmarks --only kernel prefill_kernel -> benchmarks/results/cuda-<gpu>.{json,md}.
#   bash scripts/gpu_check.sh [LOG_DIR]     # about 6 minutes on an H200 (the C++ CPU kernels build first)
# Each step's output is also written to LOG_DIR (default: the current directory) as gpu_tests.log and
# gpu_benchmarks.log; the script goes on after a failing step and exits non-zero if any failed.
set -uo pipefail
log_dir=$(realpath "${1:-.}")
cd "$(dirname "$0")/.."
# the repository itself, not an installed copy; tests/ for the helpers the test files import
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())" || exit 2
status=0
SECONDS=0
python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py tests/test_cuda.py 2>&1 \
    | tee "$log_dir/gpu_tests.log" || status=1
echo "tests: ${SECONDS}s"
python3 -m benchmarks --only kernel prefill_kernel 2>&1 | tee "$log_dir/gpu_benchmarks.log" || status=1
echo "tests and benchmarks: ${SECONDS}s"
exit $status
