"""Shared by the kernel tests: run Triton kernels on CPU through Triton's interpreter, or on CUDA.

TRITON_INTERPRET must be set before `@triton.jit` runs (tests/conftest.py sets it when there is no
CUDA). The interpreter (triton 3.9) multiplies bfloat16 tiles as their raw uint16 bits
(InterpreterBuilder.create_dot: numpy has no bfloat16), so `patch_interpreter_bf16_dot` upcasts
bfloat16 operands of tl.dot to float32 first, exact since a bf16 product fits a float32.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (CUDA or INTERPRET),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

# float32 tl.dot runs as TF32 on CUDA tensor cores: exact float32 comparisons are interpreter-only
F32 = pytest.param(torch.float32, marks=pytest.mark.skipif(
    DEV == "cuda", reason="float32 tl.dot is TF32 on CUDA; bf16 is compared there"))


def gpu_test(f):
    """Marks a test `gpu` (run on the device) and skips it without CUDA or when interpreting."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")(f))


def patch_interpreter_bf16_dot() -> None:
    """Idempotent; a no-op unless interpreting."""
    if not INTERPRET:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as I
    if getattr(I.InterpreterBuilder.create_dot, "_bf16_fixed", False):
        return
    orig = I.InterpreterBuilder.create_dot

    def up(h):
        if h.dtype == tl.bfloat16:
            return I.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, *args):
        return orig(self, up(a), up(b), d, *args)
    create_dot._bf16_fixed = True
    I.InterpreterBuilder.create_dot = create_dot
