"""Every module path a docstring, comment, message or developer doc names resolves (issue 48):
after a layout move, 21 docstrings and comments still named modules that no longer existed
(`jobs.engine.default_width`, `jobs.llama.from_hf_model`, `jobs.generate.Generator`, ...), and
target/ has since become targets/.

Read with tokenize and ast, never imported. What counts as a reference:
- a dotted name `F.m...` (or `eagle3_runner.F.m...`) whose first part F is one of the package's
  folders and is not itself the tail of a longer dotted name (`stages.bench.kernels` is a spec
  field, not the folder kernels/). It must resolve: `F.m` a module file or subpackage of F,
  then each further part a module of a subpackage, a top-level name of the module (def, class,
  assignment, import), and past a class, a name defined in its body. The spec's own
  fields are no module paths: `data.max_length` (the data block shares the data/ folder's
  name) and `target.path` are left alone; `target.<a module of targets/>` that is no field of
  the target block is the folder's old name.
- a file path `F/...` under a folder of the repository (the package's folders, scripts/,
  tests/, docs/, specs/, and the old target/): the file or folder must exist. Placeholders and
  globs (`jobs/<stage>.py`, `tests/test_*.py`) are not paths.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "eagle3_runner"
FOLDERS = ("runner", "data", "models", "kernels", "targets", "engine", "trainer", "jobs")
PATH_ROOTS = FOLDERS + ("scripts", "tests", "docs", "specs", "target")
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "yml", "txt", "sh", "toml", "gz", "zst",
                 "csv", "png", "log", "safetensors", "gguf", "duckdb", "whl", "pt", "bin"}

DOTTED = re.compile(r"(?<![\w./-])(?:eagle3_runner\.)?(%s)((?:\.[A-Za-z_]\w*)+)"
                    % "|".join(FOLDERS + ("target",)))
PATH = re.compile(r"(?<![\w./~$-])(?:%s)/[\w./-]*" % "|".join(PATH_ROOTS))


@lru_cache(maxsize=None)
def spec_fields(model: str) -> frozenset[str]:
    """The fields of a spec block model (runner/spec/sections.py), read from its class body."""
    tree = ast.parse((ROOT / "runner" / "spec" / "sections.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == model)
    return frozenset(n.target.id for n in cls.body
                     if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """{name: node} of the names a module or class body binds (descending into if/try/with)."""
    out: dict[str, ast.AST] = {}
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for x in ast.walk(t):
                    if isinstance(x, ast.Name):
                        out[x.id] = n
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                out[(a.asname or a.name).split(".")[0]] = n
        elif isinstance(n, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for part in ("body", "orelse", "finalbody"):
                out.update(_bound(getattr(n, part, []) or []))
            for h in getattr(n, "handlers", []):
                out.update(_bound(h.body))
    return out


@lru_cache(maxsize=None)
def module_names(path: Path) -> dict[str, ast.AST]:
    return _bound(ast.parse(path.read_text()).body)


def resolve(parts: list[str]) -> str | None:
    """None when the dotted name resolves (module docstring), else what is missing."""
    path, i = ROOT / parts[0], 1
    while i < len(parts) and path.is_dir():
        nxt = parts[i]
        if (path / nxt).is_dir():
            path = path / nxt
        elif (path / f"{nxt}.py").is_file():
            path = path / f"{nxt}.py"
        elif (path / "__init__.py").is_file():
            path = path / "__init__.py"
            break
        else:
            return f"no module {'.'.join(parts[:i + 1])}"
        i += 1
    if i >= len(parts):
        return None
    names = module_names(path)
    if parts[i] not in names:
        return f"{path.relative_to(ROOT)} defines no {parts[i]}"
    node = names[parts[i]]
    if i + 1 < len(parts) and isinstance(node, ast.ClassDef) and \
            parts[i + 1] not in _bound(node.body):
        return f"class {'.'.join(parts[:i + 1])} defines no {parts[i + 1]}"
    return None


def dotted_problem(folder: str, rest: str, explicit: bool) -> str | None:
    """What is wrong with the dotted reference folder + rest, or None (also when it is no
    module path at all: a spec field, a file name)."""
    parts = [folder] + rest.lstrip(".").split(".")
    if parts[1] in FILE_SUFFIXES:  # `runner.py`, `data.md`: a file name, not a module
        return None
    if folder == "target":  # the old folder name, or the spec's target block
        modules = {p.stem for p in (ROOT / "targets").glob("*.py")} | \
            {p.name for p in (ROOT / "targets").iterdir() if p.is_dir()}
        if explicit or (parts[1] in modules and parts[1] not in spec_fields("Target")):
            return "target/ is now targets/"
        return None
    if not explicit and folder == "data" and parts[1] in spec_fields("Data") and \
            not (ROOT / "data" / f"{parts[1]}.py").exists():
        return None  # a field of the spec's data block
    return resolve(parts)


CODE_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml")


def path_problem(ref: str) -> str | None:
    """What is wrong with a file path, or None (also when it is no path of ours: prose like
    `data/target`, or a data file a command writes). A path counts when it names a code or doc
    file (CODE_SUFFIXES), a folder (a trailing /), a file name with a dot, or runs two folders
    deep; a module may be named without .py, and `a/b.py`'s names as `a/b.name`
    (`runner/drafts/rules.by_rows`)."""
    cut = ref.endswith(".")  # `specs/smollm2-sharegpt."` "yaml`: the literal goes on
    ref = ref.rstrip(".-")
    if not (ref.endswith(CODE_SUFFIXES) or ref.endswith("/") or ref.count("/") >= 2
            or "." in ref.rsplit("/", 1)[1]):
        return None
    if ref.split("/")[0] == "target":
        return "target/ is now targets/"
    p = ROOT / ref
    if p.exists() or p.with_name(p.name + ".py").is_file():
        return None
    if cut and any(p.parent.glob(p.name + ".*")):
        return None
    head, _, tail = ref.rpartition("/")
    module, _, attrs = tail.partition(".")
    if attrs and not tail.endswith(CODE_SUFFIXES):
        if (ROOT / head / f"{module}.py").is_file():
            return resolve(head.split("/") + [module] + attrs.split("."))
        if tail.rsplit(".", 1)[1] in FILE_SUFFIXES:
            return None  # a data file (a command's output, say), not code or docs
    return "no such file or folder"


def texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a file says in words: a Python file's comments and string literals
    (docstrings, messages), a markdown file whole."""
    src = path.read_text()
    if path.suffix != ".py":
        return list(enumerate(src.splitlines(), 1))
    keep = {tokenize.COMMENT, tokenize.STRING} | {getattr(tokenize, "FSTRING_MIDDLE", -1)}
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in keep:
            for k, line in enumerate(tok.string.splitlines(), tok.start[0]):
                out.append((k, line))
    return out


def problems_in(path: Path) -> list[str]:
    return problems_in_lines(str(path.relative_to(ROOT)), texts(path))


def problems_in_lines(where: str, lines: list[tuple[int, str]]) -> list[str]:
    out = []
    for k, line in lines:
        for m in DOTTED.finditer(line):
            if line[m.end():m.end() + 1] in ("/", "*", "<", "{", "("):
                continue  # `kernels.attention(` is a call; a path or a pattern follows
            why = dotted_problem(m[1], m[2], m[0].startswith(PKG + "."))
            if why:
                out.append(f"{where}:{k}: {m[0]}: {why}")
        for m in PATH.finditer(line):
            if line[m.end():m.end() + 1] in ("*", "<", "{", "["):
                continue  # a glob or a placeholder follows
            why = path_problem(m[0])
            if why:
                out.append(f"{where}:{k}: {m[0]}: {why}")
    return out


def scanned_files() -> list[Path]:
    files = [ROOT / "__init__.py"]
    for folder in FOLDERS + ("scripts",):
        files += sorted((ROOT / folder).rglob("*.py"))
    files += [ROOT / "DEVELOPERS.md", ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return files


def test_every_module_path_named_in_words_resolves():
    problems = [p for f in scanned_files() for p in problems_in(f)]
    assert problems == [], "\n".join(problems)


def test_the_matcher_flags_stale_names_and_leaves_spec_fields_alone():
    bad = {"jobs.engine.default_width", "jobs.bench_results.lossless_verdict",
           "jobs.llama.from_hf_model", "jobs.data", "jobs.generate.Generator",
           "eagle3_runner.jobs.data", "target.load.tokenizer_only", "target.capture",
           "engine.generate.NoSuchThing", "runner.spec.no_such_name",
           "engine.generate.Generator.no_such_method", "eagle3_runner.data.max_length",
           "runner.spec.load_spec", "kernels.resolve_kernels"}
    good = {"engine.generate.Generator", "engine.generate.Generator.run", "data.max_length",
            "data.path", "data.max_bad_fraction", "target.path", "target.sglang.server",
            "target.device", "runner.spec.load.load_spec", "runner.drafts.rules.RULES",
            "runner.py",
            "eagle3_runner.targets.survey", "data.conversations.read_records",
            "runner.stages.data_problems", "jobs.bench", "kernels.attention"}
    for ref in bad | good:
        m = DOTTED.fullmatch(ref)
        assert m, ref
        got = dotted_problem(m[1], m[2], ref.startswith(PKG + "."))
        assert (got is not None) == (ref in bad), (ref, got)
    for line in ("stages.bench.kernels: auto", "spec.data.path", "x = stages.train.lr",
                 "the `data.seed` field", "jobs/<stage>.py", "tests/test_*.py",
                 "see docs/data.md.", "~/models/Qwen3-8B", "https://x.org/models/y",
                 "python -m eagle3_runner.runner.launch", "scripts/bench/",
                 "unusable data/target", "ms per kernels/call", "runner/drafts/rules.by_rows",
                 "via runner/drafts/safetensors)", "tests/data/out/new.json"):
        assert not problems_in_text(line), line
    for line in ("in jobs/engine.py", "targets/nope.py", "target/load.py", "see jobs.llama.",
                 "(eagle3_runner.jobs.generate)", "jobs/draft_model.Eagle3Draft.cached_step",
                 "runner/drafts/rules.no_such", "scripts/gpu/gone.sh", "a/b engine/nope/"):
        assert problems_in_text(line), line


def problems_in_text(line: str) -> list[str]:
    """problems_in for one line of words (tests of the matcher)."""
    return problems_in_lines("text", [(1, line)])
