"""Shared pytest fixtures. Add yours below; keep heavy ones session-scoped."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton kernels (kernels/) run on CPU tensors only through Triton's interpreter, which must
# be chosen before triton is first imported (kernels/_triton.py says why).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- target model (jobs/target.py) -------------------------------------------------------------


def _asset_or_skip(name: str):
    from runner.assets import FetchError, asset_path
    try:
        return asset_path(name)
    except FetchError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_path():
    """The fetched SmolLM2 GGUF; skips when `runner fetch smollm2` has not run."""
    return _asset_or_skip("smollm2")


@pytest.fixture(scope="session")
def sharegpt_path():
    """The fetched ShareGPT JSON; skips when `runner fetch sharegpt` has not run."""
    return _asset_or_skip("sharegpt")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model float32 on CPU, eval, no grad; tokenizer; config dict) through the cached loader
    jobs.target.load_target (the GGUF is converted once to cache_dir()/converted/)."""
    import torch
    from jobs.target import load_target
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_target(smollm2_path, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from jobs.target import load_tokenizer
    return load_tokenizer(smollm2_path)
