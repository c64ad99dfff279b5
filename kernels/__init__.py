"""Triton kernels with PyTorch references (GPU fast paths). No __version__ on purpose: see
pyproject.toml on why transformers must not mistake this package for the hub `kernels` library."""
