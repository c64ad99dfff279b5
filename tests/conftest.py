"""Shared pytest fixtures. Add yours below; keep heavy ones session-scoped."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


def _interpret_triton_without_cuda() -> None:
    """Without CUDA, Triton kernels (kernels/) run only under Triton's interpreter, and
    TRITON_INTERPRET must be set before any `@triton.jit` decorates them (at import)."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_cuda()


# ---- this session's temporary files --------------------------------------------------------------
# Everything this session and its child processes write through tempfile (TMPDIR) lands in one
# private folder, removed when the session ends, so the suite leaves nothing in /tmp but pytest's
# own last three basetemps (pyproject: tmp_path_retention_policy "failed"). A folder of the
# project's own (LEAK_PREFIXES: the target's offload folders, the launcher's job files, ...)
# still there at the end is a leak that would stay behind on a user's machine: the session fails,
# naming it. Only this session writes into its folder, so runs sharing the machine cannot make
# the check flake. pytest's basetemp and torch's compile cache stay where they were.

LEAK_PREFIXES = ("eagle3-", "bad-inputs-", "profile-train-", "bench-sglang-")


def _private_tmp() -> Path:
    real = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", real)  # pytest's basetemp: not in ours
    try:  # torch's compile cache under the real temp dir (it lasts across sessions)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    except ImportError:
        pass
    d = Path(tempfile.mkdtemp(prefix="eagle3-tests-", dir=real))
    os.environ["TMPDIR"] = str(d)  # child processes (runner apply, ranks, Slurm jobs)
    tempfile.tempdir = str(d)  # this process
    return d


SESSION_TMP = _private_tmp()
# the memo files (file hashes, data counts: runner/files.py memo_dir) of the session's throwaway
# files go with them, not into the user's ~/.cache/eagle3-runner
MEMO = SESSION_TMP / "memo"
os.environ["EAGLE3_MEMO"] = str(MEMO)


def leftovers(folder: Path) -> tuple[list[str], list[str]]:
    """(the project's folders and files left in `folder`: LEAK_PREFIXES, anything else left)."""
    names = sorted(p.name for p in folder.iterdir()
                   if p != MEMO) if folder.is_dir() else []  # the memo files are meant to be there
    ours = [n for n in names if n.startswith(LEAK_PREFIXES)]
    return ours, [n for n in names if n not in ours]


def pytest_sessionfinish(session, exitstatus):
    ours, other = leftovers(SESSION_TMP)
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    if ours:
        session.config._eagle3_leaks = ours
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if other:
        session.config._eagle3_other_tmp = other


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    ours = getattr(config, "_eagle3_leaks", None)
    other = getattr(config, "_eagle3_other_tmp", None)
    if ours:
        terminalreporter.section("temporary files left behind", red=True)
        terminalreporter.write_line(
            f"FAILED: the tests left {len(ours)} of the project's temporary folder(s) in TMPDIR "
            f"(removed now; on a user's machine they would stay): {', '.join(ours)}. Remove "
            "them where they are made (tests/conftest.py LEAK_PREFIXES).")
    if other:
        terminalreporter.section("temporary files left behind (not the project's)")
        terminalreporter.write_line(f"{len(other)} left in TMPDIR, removed now: "
                                    + ", ".join(other[:20]))
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
