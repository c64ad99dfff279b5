"""The import graph of the project (runner/, jobs/, kernels/), read with ast by the same walker
the cache key uses (runner.plan.module_imports): no circles, lazy imports inside functions
included, and runner/ never imports jobs/: the stage code is reached only through the stage
registry (runner/stages.py `stage_module`, importlib by name)."""

from __future__ import annotations

from pathlib import Path

import runner.plan as plan_mod

ROOT = Path(__file__).resolve().parent.parent


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """{module name: file} of every module of the project packages."""
    out = {}
    for pkg in plan_mod.PROJECT_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


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
    edges = dict(import_graph()["runner.cli"])
    assert edges["runner.errors"] is True  # module level
    assert edges["runner.spec.load"] is False  # inside a function


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_one():
    g = {"a": [("b", True)], "b": [("c", False)], "c": [("a", True)], "d": []}
    assert find_cycle(g) == ["a", "b", "c", "a"]


def test_runner_never_imports_jobs():
    """Not at module level, not lazily: runner/ calls stage code only through the registry."""
    bad = sorted((m, t) for m, edges in import_graph().items() if m.split(".")[0] == "runner"
                 for t, _ in edges if t.split(".")[0] == "jobs")
    assert bad == []
    users = sorted(m for m, f in project_modules().items() if m.split(".")[0] == "runner"
                   and "import_module(" in f.read_text())
    assert users == ["runner.stages"]
