"""Shared pytest fixtures. Add yours below; keep heavy ones session-scoped."""

from __future__ import annotations

import os

import pytest


def _interpret_triton_without_cuda() -> None:
    """Without CUDA, Triton kernels (kernels/) run only under Triton's interpreter, and
    TRITON_INTERPRET must be set before any `@triton.jit` decorates them (at import)."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_cuda()
# specs/drafter-v2.yaml names ${USER}, and an unset variable in a spec path is an error; some CI
# containers do not set USER
os.environ.setdefault("USER", __import__("getpass").getuser())


# ---- target model (targets/load.py) -------------------------------------------------------------


def _asset_or_skip(name: str):
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.errors import FetchError
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
    targets.load.load_target (the GGUF is converted once to cache_dir()/converted/)."""
    import torch
    from eagle3_runner.targets.load import load_target
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_target(smollm2_path, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from eagle3_runner.targets.load import load_tokenizer
    return load_tokenizer(smollm2_path)
