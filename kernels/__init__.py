"""Triton kernels with PyTorch references (GPU fast paths). No __version__ on purpose: see
pyproject.toml on why transformers must not mistake this package for the hub `kernels` library.

The fused decode paths (kernels/llama_decode.py, kernels/draft_decode.py) are selected by ONE
switch, `kernels`: "triton" (the fused Triton kernels), "torch" (the models' own PyTorch forward,
the reference), or "auto" = triton on a CUDA device when Triton imports, else torch.
"""

KERNELS = ("auto", "triton", "torch")


def geometry_problem(head_dim: int):
    """Why the fused decode forwards (llama_decode, draft_decode) cannot tile a model with this
    head_dim, or None: norm_qkv_rope rotates halves in 16-column blocks and the attention kernel
    needs a power of 2, so head_dim must be a power of 2 >= 32 (Llama/SmolLM2: 64, 128)."""
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of 2 >= 32 (the fused kernels' tiling)"
    return None


def resolve_kernels(kernels: str, device) -> str:
    """"auto" -> "triton" on CUDA (when triton imports) else "torch"; "triton"/"torch" as given.
    Raises ValueError for another value, or "triton" on a CPU device without TRITON_INTERPRET=1
    (Triton kernels run on CPU only through its interpreter)."""
    import os

    import torch
    if kernels not in KERNELS:
        raise ValueError(f"kernels = {kernels!r}: expected one of {KERNELS}")
    cuda = torch.device(device).type == "cuda"
    if kernels == "auto":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton" if cuda else "torch"
    if kernels == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels = 'triton' on a CPU device needs TRITON_INTERPRET=1 (Triton's "
                         "interpreter); use 'torch' or 'auto'")
    return kernels
