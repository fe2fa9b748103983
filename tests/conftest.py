"""Session-wide test settings.

Triton kernels run here on its CPU interpreter. ``TRITON_INTERPRET`` is set before any test module
imports triton (torch.compile imports it too): a kernel module first loaded without it cannot be run
by the interpreter later in the same process. On a machine with CUDA the variable is left alone.

``exact_float32``: a GPU computes float32 matrix products in TF32 unless told otherwise; tests that hold CUDA
results to float32 references ask for exact products with this fixture.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def exact_float32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
