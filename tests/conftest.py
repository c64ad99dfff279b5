"""Shared pytest fixtures. Add yours below; keep heavy ones session-scoped."""

from __future__ import annotations

import pytest


# ---- target model (jobs/target.py) -------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_path():
    """The fetched SmolLM2 GGUF; skips when `runner fetch smollm2` has not run."""
    from runner.assets import FetchError, asset_path
    try:
        return asset_path("smollm2")
    except FetchError as e:
        pytest.skip(str(e))


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
