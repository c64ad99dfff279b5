"""Our import names are ours alone. The repository root is the package `eagle3_runner`; its
folders (runner/, kernels/, ...) are its subpackages and carry no `__init__.py`, so no folder can
shadow an installed distribution's top-level package, whatever the working directory. The bug
this guards (2026-12-04): transformers 5.25 requires Hugging Face's own `kernels` package; ours
was also a top-level `kernels`, and which one Python found depended on sys.path (the `runner`
script got theirs, pytest from the repo root handed ours to transformers).

Each check that imports runs in a fresh interpreter: a process's imports are cached."""

import importlib.metadata as md
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from test_imports import FLOORS, PKG, project_modules

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

IMPORT_ALL = """
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    out[name] = importlib.import_module(name).__file__
import transformers  # imports Hugging Face's `kernels` (a requirement of transformers >= 5.25)
k = sys.modules.get("kernels") or importlib.import_module("kernels")
out["kernels (theirs)"] = getattr(k, "__file__", None)
print("RESULT" + json.dumps(out))
"""


def _run(code: str, *args, cwd) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def _inside(f: str | None) -> bool:
    """Whether file f is a source file of this checkout (a venv inside the checkout is not)."""
    if f is None or not Path(f).resolve().is_relative_to(ROOT):
        return False
    return Path(f).resolve().relative_to(ROOT).parts[0] in FLOORS


def test_every_module_imports_from_outside_the_repo_as_ours(tmp_path):
    """Run as the `runner` script runs (the working directory outside the repository, so only the
    installed package is on sys.path): every module of ours is the file in this checkout, and
    `kernels` is Hugging Face's, not ours."""
    names = sorted(m for m in project_modules() if not m.endswith("__main__"))
    out = _run(IMPORT_ALL, *names, cwd=tmp_path)
    stray = {n: f for n, f in out.items() if n != "kernels (theirs)" and not _inside(f)}
    assert stray == {}
    assert not _inside(out["kernels (theirs)"])


def test_from_the_repo_root_transformers_gets_its_own_kernels():
    """pytest and `python -c` put the working directory first on sys.path: from the repo root, the
    kernels/ folder (no __init__.py) must still not be what transformers imports."""
    out = _run(IMPORT_ALL, f"{PKG}.kernels.switch", cwd=ROOT)
    assert _inside(out[f"{PKG}.kernels.switch"])
    assert not _inside(out["kernels (theirs)"])


def our_top_level_names() -> set[str]:
    """Every top-level import name this checkout puts on sys.path: the package, and the modules of
    tests/ (pytest imports them by their bare names)."""
    return {PKG} | {p.stem for p in TESTS.glob("*.py")}


def distribution_top_levels() -> dict[str, set[str]]:
    """{distribution: its top-level import names} of every installed distribution but ours, from
    top_level.txt and from its file list (wheels without top_level.txt)."""
    out: dict[str, set[str]] = {}
    for d in md.distributions():
        name = d.metadata.get("Name") or "?"
        if name.lower().replace("_", "-") == "eagle3-runner":
            continue
        tops = set((d.read_text("top_level.txt") or "").split())
        for f in d.files or []:
            head = f.parts[0] if f.parts else ""
            if head and head != ".." and not head.endswith((".dist-info", ".egg-info", ".data",
                                                            ".pth")):
                tops.add(head.removesuffix(".py"))
        out[name] = tops
    return out


def test_no_installed_distribution_provides_a_name_we_use():
    ours = our_top_level_names()
    clashes = {d: sorted(t & ours) for d, t in distribution_top_levels().items() if t & ours}
    assert clashes == {}
    assert "kernels" not in ours  # the 2026-12-04 collision


def test_no_folder_of_the_repo_is_a_regular_top_level_package():
    """A top-level folder with __init__.py is importable by its bare name from the repo root."""
    assert sorted(p.parent.name for p in ROOT.glob("*/__init__.py")) == []


def test_pyproject_lists_every_folder_as_a_subpackage():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {PKG: "."}
    subs = {f"{PKG}." + ".".join(p.relative_to(ROOT).parts[:-1]) for f in FLOORS
            for p in (ROOT / f).rglob("*.py")}
    assert sorted(cfg["packages"]) == sorted({PKG} | subs)


def _requirements() -> list[str]:
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return proj["dependencies"] + [r for rs in proj["optional-dependencies"].values() for r in rs]


def test_every_dependency_has_an_upper_bound():
    """A fresh install gets only releases CI has run: every requirement of the project and its
    extras stops at an upper bound (the 2026-12-04 break: transformers>=4.56 resolved to 5.25)."""
    from packaging.requirements import Requirement
    unbounded = [r for r in _requirements()
                 if not any(s.operator in ("<", "<=", "==", "~=")
                            for s in Requirement(r).specifier)]
    assert unbounded == []


def test_the_environment_is_the_one_ci_tested():
    """scripts/env.sh installs with -c constraints.txt: every pinned package that is installed
    has the pinned version (EAGLE3_UNPINNED=1 venvs resolve today's registry instead)."""
    import os

    from packaging.requirements import Requirement
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            r = Requirement(line)
            pins[r.name.lower().replace("_", "-")] = str(r.specifier).removeprefix("==")
    assert {"transformers", "pydantic", "duckdb", "accelerate", "safetensors",
            "submitit"} <= set(pins)
    if os.environ.get("EAGLE3_UNPINNED") == "1":
        return
    have = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
    off = {n: (have[n], v) for n, v in pins.items() if n in have and have[n] != v}
    assert off == {}
