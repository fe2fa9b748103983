"""Session-wide test settings.

Triton kernels run here on its CPU interpreter. ``TRITON_INTERPRET`` is set before any test module
imports triton (torch.compile imports it too): a kernel module first loaded without it cannot be run
by the interpreter later in the same process. On a machine with CUDA the variable is left alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
