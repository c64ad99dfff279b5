"""The one `kernels` switch of the fused decode paths (kernels/ holds Triton kernels with PyTorch
references: the GPU fast paths).

The fused decode paths (kernels/llama_decode.py, kernels/draft_decode.py) are selected by ONE
switch, `kernels`: "triton" (the fused Triton kernels), "torch" (the models' own PyTorch forward,
the reference), or "auto" = torch on every device, CUDA included: Triton is an explicit opt-in.
Why (measured on one H200, SmolLM2-135M bf16): a 1-row decode call took 1.79 ms on the fused
Triton path against 1.37 ms on the torch path (compiled with CUDA graphs); each fused qkv kernel
alone ran ~24 us, and torch.compile of the fused path failed, so it cannot be graphed the same
way. The regenerate stage's decode attention (engine/generate.py) follows the same switch.
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
    """"auto" -> "torch" (on CUDA too: the module docstring's measurement); "triton"/"torch" as
    given. Raises ValueError for another value, or "triton" on a CPU device without
    TRITON_INTERPRET=1 (Triton kernels run on CPU only through its interpreter)."""
    import os

    import torch
    if kernels not in KERNELS:
        raise ValueError(f"kernels = {kernels!r}: expected one of {KERNELS}")
    if kernels == "auto":
        return "torch"
    cpu = torch.device(device).type != "cuda"
    if kernels == "triton" and cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels = 'triton' on a CPU device needs TRITON_INTERPRET=1 (Triton's "
                         "interpreter); use 'torch'")
    return kernels
