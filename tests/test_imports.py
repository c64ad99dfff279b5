"""The import graph of the project, read with ast by the same walker the cache key uses
(runner/plan.py module_imports): no circles, lazy imports inside functions included; the folders
stand in one order (FLOORS) and no import runs from a lower floor to a higher one; runner/ never
imports jobs/: the stage code is reached only through the stage registry (runner/stages.py
`stage_module`, importlib by name)."""

from __future__ import annotations

import re
from pathlib import Path

import eagle3_runner.runner.plan as plan_mod

ROOT = Path(__file__).resolve().parent.parent
PKG = plan_mod.PACKAGE
# The folders of the package from the ground floor up (DEVELOPERS.md "Layout"): a module may import
# its own folder and the folders below it, never one above. runner/ is the torch-free ground (its
# CLI reaches the stages only through the registry); the models sit below the kernels that fuse
# them; the stage modules (jobs/) stand on top.
FLOORS = ("runner", "data", "models", "kernels", "targets", "engine", "trainer", "jobs")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """{module name (eagle3_runner.<folder>...): file} of every module of the package's folders."""
    out = {}
    for folder in FLOORS:
        for f in sorted((root / folder).rglob("*.py")):
            parts = (PKG,) + f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def folder(module: str) -> str:
    return module.split(".")[1]


def import_graph(root: Path = ROOT) -> dict[str, list[tuple[str, bool]]]:
    """{module: [(imported module, at module level)]}, without the implicit edges to the
    packages above a module (importing a.b.c runs a/__init__.py: not a choice of the author)."""
    return {m: [(t, top) for t, top in plan_mod.module_imports(f)
                if t != m and not m.startswith(t + ".")]
            for m, f in project_modules(root).items()}


def find_cycle(graph: dict[str, list[tuple[str, bool]]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t, _ in graph.get(m, []):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_the_walker_sees_lazy_and_module_level_imports():
    edges = dict(import_graph()["eagle3_runner.runner.cli"])
    assert edges[f"{PKG}.runner.errors"] is True  # module level
    assert edges[f"{PKG}.runner.spec.load"] is False  # inside a function


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_one():
    g = {"a": [("b", True)], "b": [("c", False)], "c": [("a", True)], "d": []}
    assert find_cycle(g) == ["a", "b", "c", "a"]


def test_runner_never_imports_jobs():
    """Not at module level, not lazily: runner/ calls stage code only through the registry."""
    bad = sorted((m, t) for m, edges in import_graph().items() if folder(m) == "runner"
                 for t, _ in edges if folder(t) == "jobs")
    assert bad == []
    users = sorted(m for m, f in project_modules().items() if folder(m) == "runner"
                   and "import_module(" in f.read_text())
    assert users == [f"{PKG}.runner.stages"]


def upward_arrows(graph: dict[str, list[tuple[str, bool]]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs whose imported module stands on a higher floor (FLOORS)."""
    return sorted((m, t) for m, edges in graph.items() for t, _ in edges
                  if FLOORS.index(folder(t)) > FLOORS.index(folder(m)))


def test_no_import_runs_upward_between_folders():
    assert upward_arrows(import_graph()) == []


def test_upward_arrows_finds_one():
    g = {f"{PKG}.kernels.a": [(f"{PKG}.models.b", True)],
         f"{PKG}.models.b": [(f"{PKG}.engine.c", False)]}
    assert upward_arrows(g) == [(f"{PKG}.models.b", f"{PKG}.engine.c")]


def test_every_folder_with_code_has_a_floor():
    """A new folder of code must be placed in FLOORS (and in pyproject.toml's packages)."""
    skip = {"tests", "scripts", "docs", "specs"}
    code = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")
            if not p.relative_to(ROOT).parts[0].startswith(".")}
    assert sorted(code - skip) == sorted(FLOORS)


def layout_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, whole row) of every table row of DEVELOPERS.md's "Layout" section."""
    sec = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return [(ln.split("|")[1].strip(), ln) for ln in sec.splitlines()
            if ln.startswith("| `")]


def unlisted_modules(text: str, root: Path = ROOT) -> list[str]:
    """Module files of the package that DEVELOPERS.md's layout table does not name: a row names a
    file by its path in backticks, or a folder row (`a/b/`) names it by its file name."""
    rows = layout_rows(text)
    out = []
    for f in sorted({p for folder in FLOORS for p in (root / folder).rglob("*.py")}):
        rel = f.relative_to(root).as_posix()
        folder_rows = [r for c, r in rows if f"`{f.parent.relative_to(root).as_posix()}/`" in c]
        if f"`{rel}`" not in "".join(r for _, r in rows) and \
                not any(f"`{f.name}`" in r for r in folder_rows):
            out.append(rel)
    return out


def test_the_layout_table_names_every_module_and_only_real_paths():
    """DEVELOPERS.md "Layout" matches the tree: every module of the package has a row (or its
    folder's row names it), and every path a first cell names exists."""
    text = (ROOT / "DEVELOPERS.md").read_text()
    assert unlisted_modules(text) == []
    named = [p for c, _ in layout_rows(text) for p in re.findall(r"`([\w./-]+)`", c)]
    assert named and [p for p in named if not (ROOT / p.rstrip("/")).exists()] == []
