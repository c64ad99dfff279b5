"""What kernels/ needs to know about Triton: whether it is there, and whether a launch on
`device` can run. CUDA tensors run compiled kernels; CPU tensors run only through Triton's
interpreter, which must be chosen (TRITON_INTERPRET=1) before triton is first imported, because
triton.language's own reductions are decorated at that import (triton/runtime/jit.py, 3.6 and
3.9). tests/conftest.py sets it on machines without CUDA.
"""

from __future__ import annotations

import os


def available() -> bool:
    """Whether triton is importable (it is on CUDA machines; a CPU machine may lack it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run through the interpreter in this process (CPU tensors)."""
    return available() and os.environ.get("TRITON_INTERPRET") == "1"


def check_device(device) -> None:
    """Raise a one-line error (with the fix) when a kernel cannot run on `device`."""
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"a Triton kernel got {device.type} tensors: set TRITON_INTERPRET=1 "
                           "before importing triton (the interpreter), or use impl='torch'")
