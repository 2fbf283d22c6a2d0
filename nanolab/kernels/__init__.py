"""Triton kernels.

Triton compiles for a GPU. On a machine without one it has only its interpreter, which it reads
from TRITON_INTERPRET when a kernel is decorated, that is when a module here is imported. So on
such a machine this package turns the interpreter on before any kernel exists, and a CPU run of
the streamed read works (slowly: each program runs as Python) instead of failing for want of a
driver. An explicit TRITON_INTERPRET in the environment is left as it is.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Whether kernels here run in Triton's interpreter (CPU tensors) rather than compiled (CUDA tensors).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
