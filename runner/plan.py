"""Planning: a pure, frozen value saying which stages run, in what order, and why.

Cache key of a stage = sha256 of (its slice of the resolved spec, its upstream keys and input
file identities, the hash of its code: the stage module plus every project module it imports,
transitively, runner/ included). Reasons (Snakemake style): up to date, missing output,
incomplete (resuming), spec changed (naming the fields), input changed, code changed, forced. The
last completed key of each (variant, stage) slot is kept in work_dir/state/ to explain what
changed. What each stage reads and needs comes from the stage registry (runner/stages.py); what
would make a stage fail at once, and the plan's warnings: runner/plan_checks.py.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from eagle3_runner.runner import carry, disk, engines, placement
from eagle3_runner.runner.errors import PlanError
from eagle3_runner.runner.files import atomic_write, expand_path, file_identity, json_hash
from eagle3_runner.runner.plan_checks import (declared_path, output_problems, sort_problems,
                                              spec_warnings, stage_notes, stage_problems)
from eagle3_runner.runner.spec.load import variant_spec
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.stage import artifact_identity, read_manifest
from eagle3_runner.runner.stages import (STAGE_ORDER, enabled_stages, stage_files, stage_kind,
                                         stage_needs, stage_slice)

ROOT = Path(__file__).resolve().parent.parent  # the repository root = the package eagle3_runner
PACKAGE = "eagle3_runner"  # every project module is PACKAGE.<folder>...; their sources are hashed


@dataclass(frozen=True)
class PlannedStage:
    variant: str
    stage: str
    key: str
    action: str  # "run" | "skip"
    reason: str
    artifact: str  # final artifact dir
    partial: str  # where the stage writes while running
    needs: tuple[tuple[str, str], ...]  # (variant, stage) of upstream entries
    shared_with: str | None = None  # another variant computes this exact stage
    parts: dict = field(default_factory=dict, compare=False, hash=False)
    # one line on what the stage will do beyond its reason (regenerate with
    # stages.regenerate.reuse: `reuses PATH (sha256 ...)` or `regenerates: PATH not found`)
    note: str | None = None

    @property
    def id(self) -> str:
        return self.stage if self.variant == "base" else f"{self.stage}@{self.variant}"


@dataclass(frozen=True)
class Plan:
    spec_name: str
    work_dir: str
    results: str
    executor: str
    stages: tuple[PlannedStage, ...]
    warnings: tuple[str, ...] = ()  # problems the executor's machines may not have
    disk: dict = field(default_factory=dict, compare=False)  # runner/disk.py report
    memory: dict = field(default_factory=dict, compare=False)  # runner/placement.py report
    engines: tuple = ()  # (stage id, engine, why) of each stage that runs the target

    def to_json(self) -> str:
        d = asdict(self)
        for s in d["stages"]:
            s.pop("parts", None)
        return json.dumps(d, indent=2, sort_keys=True)


def module_file(name: str) -> Path | None:
    """The source of project module `name` under ROOT (`a/b.py` or `a/b/__init__.py`), or None
    when `name` is not a project module (torch, a function imported from a module, ...)."""
    parts = name.split(".")
    if parts[0] != PACKAGE or len(parts) < 3:
        return None  # not ours, or the package / a folder (no code of its own)
    parts = parts[1:]
    f = ROOT.joinpath(*parts).with_suffix(".py")
    if f.is_file():
        return f
    init = ROOT.joinpath(*parts) / "__init__.py"
    return init if init.is_file() else None


def module_imports(path: Path) -> list[tuple[str, bool]]:
    """(module name, at module level) for every project module an import statement of the file
    names, lazy imports inside functions included (at module level = False), each with the
    packages above it (importing a.b.c runs a/__init__.py and a/b/__init__.py too). Imports under
    `if TYPE_CHECKING:` never run and are left out."""
    out: list[tuple[str, bool]] = []

    def names(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: resolve against this file's package
            pkg = (PACKAGE,) + path.with_suffix("").relative_to(ROOT).parts[:-1]
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ((base,) if base else ()))
        return [base] + [f"{base}.{a.name}" for a in node.names]

    def walk(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # never runs
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for n in names(child):
                    parts = n.split(".")
                    for i in range(1, len(parts) + 1):
                        m = ".".join(parts[:i])
                        if module_file(m) is not None:
                            out.append((m, top))
            walk(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda)))

    walk(ast.parse(path.read_bytes()), True)
    return list(dict.fromkeys(out))


@lru_cache(maxsize=None)
def code_hash(stage: str) -> str:
    """sha256 over the source of the stage's module (jobs/<stage>.py) and every project module
    (any folder of the package) it imports, transitively, lazy imports included. Code outside the
    project (torch, transformers) is not hashed."""
    seen: set[Path] = set()
    todo = [module_file(stage_kind(stage).module)]
    while todo:
        p = todo.pop()
        if p in seen or not p.exists():
            continue
        seen.add(p)
        todo += [module_file(m) for m, _ in module_imports(p)]
    h = hashlib.sha256()
    for p in sorted(seen):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def input_files(spec: Spec, stage: str) -> dict:
    """External files a stage reads (their content is part of the key): the registry row's
    `files`, "target" = target.path, "data" = data.path when set, "drafter" =
    stages.bench.drafter (a small draft directory: each file's content, not file_identity's
    names and sizes, so a retrained drafter of the same shapes is a new key)."""
    out = {}
    for f in stage_files(spec, stage):
        declared = declared_path(spec, f)
        if not declared:
            continue
        p = expand_path(declared)
        out[f] = ({q.name: file_identity(q) for q in sorted(p.iterdir()) if q.is_file()}
                  if f == "drafter" and p.is_dir() else file_identity(p))
    return out


def _flat(d, prefix="") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _explain(old: dict, parts: dict) -> str:
    if (why := carry.explain(old.get("spec", {}), parts["spec"])) is not None:
        return why
    if old.get("spec") != parts["spec"]:
        a, b = _flat(old.get("spec", {})), _flat(parts["spec"])
        changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return "spec changed: " + ", ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")
    if old.get("code") != parts["code"]:
        return "code changed"
    if old.get("inputs") != parts["inputs"]:
        return "input changed"
    return "missing output"


# ----------------------------------------------------------------------------------------------
# planning


def build_plan(spec: Spec, force: tuple[str, ...] = (), only: tuple[str, ...] = (),
               variants: tuple[str, ...] = ()) -> Plan:
    """Plan every enabled stage of the base spec and of each variant.

    force/only take stage names (or stage@variant ids). variants (names; "base" is the spec
    itself) restricts the run to those variants' stages, including the shared stages they need,
    which still run under the variant that computes them first. With only, force reruns the
    stages only selects; a forced stage outside them is an error (_check_force_in_only).
    Raises PlanError."""
    for s in (*force, *only):
        if s.split("@")[0] not in STAGE_ORDER:
            import difflib
            close = difflib.get_close_matches(s.split("@")[0], STAGE_ORDER, n=1, cutoff=0.5)
            raise PlanError(f"--force/--only {s!r}: unknown stage"
                            f"{f' (did you mean {close[0]!r}?)' if close else ''}; stages are "
                            f"{', '.join(STAGE_ORDER)}")
    names = ["base"] + [v.name for v in spec.variants]
    for v in variants:
        if v not in names:
            raise PlanError(f"--variant {v!r}: no such variant; this spec has {', '.join(names)}")
    picked = set(variants or names)
    for s in (*force, *only):  # stage@variant ids must lie inside the --variant selection
        v = s.split("@")[1] if "@" in s else None
        if variants and v is not None and v not in picked:
            raise PlanError(f"--force/--only {s!r}: variant {v!r} is not selected by --variant "
                            f"{' '.join(variants)}; add --variant {v} or drop {s!r}")
    work, results = spec.resolved_work_dir(), expand_path(spec.results.path)
    if problems := output_problems(spec):  # before any path below work_dir is looked at
        raise PlanError(problems[0])
    vspecs = [("base", spec)] + [(v.name, variant_spec(spec, v.name)) for v in spec.variants]
    planned: list[PlannedStage] = []
    by_key: dict[tuple[str, str], PlannedStage] = {}
    keys: dict[tuple[str, str], str] = {}
    entries = []  # (vname, stage, key, parts, needs, forced, selected) in plan order
    notes: dict[tuple[str, str], str | None] = {}
    for vname, vspec in vspecs:
        for stage in enabled_stages(vspec):
            needs = tuple((vname, n) for n in stage_needs(vspec, stage))
            parts = {"spec": stage_slice(vspec, stage),
                     "inputs": {"upstream": {n: keys[(vname, n)] for _, n in needs},
                                "files": input_files(vspec, stage)},
                     "code": code_hash(stage)}
            key = json_hash(parts)
            keys[(vname, stage)] = key
            sid = stage if vname == "base" else f"{stage}@{vname}"
            notes[(vname, stage)] = stage_note(vspec, stage)
            selected = (not only or stage in only or sid in only) and vname in picked
            forced = (stage in force or sid in force) and selected  # inside --only, --variant
            entries.append((vname, stage, key, parts, needs, forced, selected))
    ids = {e[1] for e in entries} | {e[1] if e[0] == "base" else f"{e[1]}@{e[0]}" for e in entries}
    for s in (*force, *only):
        if s not in ids:
            raise PlanError(f"--force/--only {s!r}: no such stage in this spec; its stages are "
                            f"{', '.join(sorted(ids))}")
    _check_force_in_only(force, only, entries)
    # entries with the same (stage, key) are computed once, by the first; --force/--only of any
    # of them applies to that one
    forced_keys = {(e[1], e[2]) for e in entries if e[5]}
    selected_keys = {(e[1], e[2]) for e in entries if e[6]}
    by_slot: dict[tuple[str, str], PlannedStage] = {}  # (variant, stage) -> its entry
    for vname, stage, key, parts, needs, _, _ in entries:
        artifact = work / stage / key[:16]
        partial = work / stage / f".partial-{key[:16]}"
        if (stage, key) in by_key:
            first = by_key[(stage, key)]
            by_slot[(vname, stage)] = PlannedStage(
                vname, stage, key, "skip", f"same as {first.id}", str(artifact), str(partial),
                needs, first.variant, parts, notes[(vname, stage)])
            planned.append(by_slot[(vname, stage)])
            continue
        manifest = read_manifest(artifact)
        complete = manifest is not None
        stale = _stale(manifest, [_source(by_slot, n) for n in needs]) if complete else None
        if (stage, key) in forced_keys:
            action, reason = "run", "forced"
        elif stale and (stage, key) in selected_keys:
            action, reason = "run", stale
        elif complete:
            action, reason = "skip", "up to date"
        elif (stage, key) not in selected_keys:
            action, reason = "skip", ("not selected (--variant)" if vname not in picked and not only
                                      else "not selected (--only)")
        elif Path(partial).exists():
            action, reason = "run", _incomplete(stage, Path(partial))
        else:
            state = _read_state(work, vname, stage)
            action = "run"
            reason = "missing output" if state is None else _explain(state, parts)
        ps = PlannedStage(vname, stage, key, action, reason, str(artifact), str(partial),
                          needs, None, parts, notes[(vname, stage)])
        by_key[(stage, key)] = by_slot[(vname, stage)] = ps
        planned.append(ps)
    # --only: a selected stage whose upstream is neither complete nor running is an error
    running = {(p.variant, p.stage) for p in planned if p.action == "run"}
    for p in planned:
        if p.action != "run":
            continue
        for need in p.needs:
            up = next(q for q in planned if (q.variant, q.stage) == need)
            src = up if up.shared_with is None else next(
                q for q in planned if (q.variant, q.stage) == (up.shared_with, up.stage))
            if (src.variant, src.stage) not in running and read_manifest(Path(src.artifact)) is None:
                raise PlanError(f"{p.id} needs {src.id}, which has no complete output; run it "
                                f"first (drop --only or add --only {src.stage})")
    specs = dict(vspecs)
    warnings = []
    for p in planned:
        if p.action == "run":
            manifests = {n: read_manifest(Path(_source(by_slot, (v, n)).artifact))
                         for v, n in p.needs}
            errors, warn = sort_problems(spec, stage_problems(specs[p.variant], p.stage,
                                                               manifests, p.id))
            if errors:
                raise PlanError(errors[0])
            warnings += warn + stage_notes(specs[p.variant], p.stage, manifests, p.id)
    ex = spec.executor.kind
    extracts = [(p.id, specs[p.variant]) for p in planned
                if p.stage == "extract" and p.action == "run"]
    online = [(p.id, specs[p.variant]) for p in planned if p.stage == "train"
              and p.shared_with is None and specs[p.variant].stages.train.features == "online"]
    cfg = engines.target_cfg(spec)
    holds = [(p.id, specs[p.variant], cfg) for p in planned if p.action == "run"
             and p.shared_with is None
             and placement.stage_target(specs[p.variant], p.stage, cfg)]
    chosen, checked = [], set()
    for p in planned:
        if p.action != "run" or p.shared_with is not None:
            continue
        vspec = specs[p.variant]
        try:
            c = engines.choose_engine(vspec, p.stage, cfg)
        except ValueError as e:
            raise PlanError(str(e))
        if c is None:
            continue
        chosen.append((p.id, c.engine, c.why))
        role = engines.stage_role(vspec, p.stage)
        seen = (role, vspec.target.sglang_options.model_dump_json())
        if c.engine == engines.SGLANG and seen not in checked:
            checked.add(seen)
            for problem in engines.check_sglang(vspec, role):
                if ex == "slurm" and vspec.target.sglang_options.server is None:
                    warnings.append(problem + " (checked here; the stage runs on a compute node)")
                else:
                    raise PlanError(f"{p.id}: {problem}")
    return Plan(spec.name, str(work), str(results), ex, tuple(planned),
                tuple(dict.fromkeys(warnings + spec_warnings(spec))),
                disk.report(extracts, online, work), placement.report(holds), tuple(chosen))


def _check_force_in_only(force: tuple[str, ...], only: tuple[str, ...], entries: list) -> None:
    """With --only, every --force must name a stage --only runs: a forced stage outside it ran
    while the stages --only names were skipped as up to date, without a word (and --force has
    no documented meaning there). entries: build_plan's (vname, stage, ..., forced, selected).
    Raises PlanError naming both flags and the fix."""
    if not only:
        return
    for s in force:
        if not any(e[6] and s in (e[1], e[1] if e[0] == "base" else f"{e[1]}@{e[0]}")
                   for e in entries):
            raise PlanError(f"--force {s} with --only {' '.join(only)}: {s} is not a stage "
                            f"--only runs, and --force reruns only what --only selects. Add "
                            f"--only {s} to rerun it too (e.g. --force {s} --only {s}), or drop "
                            f"--force {s}.")


def stage_note(spec: Spec, stage: str) -> str | None:
    """The plan's note on `stage` (PlannedStage.note): for regenerate with
    stages.regenerate.reuse, whether it reuses the carried set (its sha256) or regenerates
    because the file is not there (runner/carry.py note)."""
    return carry.note(spec) if stage == "regenerate" else None


def _incomplete(stage: str, partial: Path) -> str:
    """The reason of a stage whose partial dir exists: it resumes, unless it never resumes
    (export: the registry's `resumes`), resumes from a file (the registry's
    resume_file: train's checkpoint) that is not there yet, or kept nothing."""
    kind = stage_kind(stage)
    if not kind.resumes:
        return "incomplete: an earlier run stopped; it runs again from the beginning"
    f = kind.resume_file
    if f is not None and not (partial / f).is_file():
        return f"incomplete: no {f} yet, restarts from the beginning"
    try:
        kept = any(partial.iterdir())
    except OSError:
        kept = False
    if not kept:  # stopped before writing anything (a failed data check, say)
        return "incomplete: nothing kept, runs again from the beginning"
    return "incomplete: resuming partial output"


def _source(by_slot: dict, need: tuple[str, str]) -> PlannedStage:
    """The entry that computes the artifact of slot `need` (itself, or the entry it shares)."""
    up = by_slot[need]
    return up if up.shared_with is None else by_slot[(up.shared_with, up.stage)]


def _stale(manifest: dict, sources: list[PlannedStage]) -> str | None:
    """Why a complete artifact is out of date although its key is not: an upstream it needs
    reruns in this plan (forced, say: its new output is this stage's new input), or was rebuilt
    since this artifact was made (its content identity differs from the one recorded in
    `inputs`). None when it is current."""
    for up in sources:
        if up.action == "run":  # name the root cause: the first stage that reruns
            return up.reason if up.reason.startswith("upstream ") else \
                f"upstream {up.id} reruns ({up.reason})"
    seen = manifest.get("inputs")
    if not isinstance(seen, dict):  # made before inputs were recorded
        return None
    for up in sources:
        m = read_manifest(Path(up.artifact))
        if m is not None and up.stage in seen and seen[up.stage] != artifact_identity(m):
            return f"input changed: {up.id} was rebuilt since"
    return None


def _read_state(work: Path, variant: str, stage: str) -> dict | None:
    try:
        return json.loads((work / "state" / f"{variant}.{stage}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_state(work: Path, p: PlannedStage) -> None:
    """Remember the parts of the last completed key of a (variant, stage) slot."""
    d = work / "state"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / f"{p.variant}.{p.stage}.json",
                 json.dumps({"key": p.key, **p.parts}, sort_keys=True, default=str))


def source_entry(plan: Plan, p: PlannedStage) -> PlannedStage:
    """The entry that actually produces p's artifact (itself unless shared)."""
    if p.shared_with is None:
        return p
    return next(q for q in plan.stages if q.variant == p.shared_with and q.stage == p.stage)
