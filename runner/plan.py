"""Planning: a pure, frozen value saying which stages run, in what order, and why.

Cache key of a stage = sha256 of (its slice of the resolved spec, its upstream keys and input
file identities, the hash of its code: the stage module plus every project module it imports,
transitively, runner/ included). Reasons (Snakemake style): up to date, missing output,
incomplete (resuming), spec changed (naming the fields), input changed, code changed, forced. The
last completed key of each (variant, stage) slot is kept in work_dir/state/ to explain what
changed. What each stage reads and needs comes from the stage registry (runner/stages.py).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from eagle3_runner.runner import carry, disk, engines, placement
from eagle3_runner.runner.errors import PlanError, RunnerError, StoreError
from eagle3_runner.runner.files import HASHED_BELOW, atomic_write, expand_path, sha256_memo
from eagle3_runner.runner.spec.load import variant_spec
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.stage import artifact_identity, read_manifest
from eagle3_runner.runner.stages import (STAGE_ORDER, data_problems, enabled_stages, reads_data,
                                         stage_files, stage_kind, stage_module, stage_needs,
                                         stage_slice)

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


# ----------------------------------------------------------------------------------------------
# hashing


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


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


def file_identity(path: Path) -> str:
    """Content identity of an input file or folder. Files under HASHED_BELOW (1 GiB) are hashed
    whole (sha256_memo); larger files and folders use names, sizes and any config.json (hashing
    a 1 TB target is not practical). Missing paths hash as 'missing'."""
    p = Path(path)
    if not p.exists():
        return "missing"
    if p.is_file():
        if p.stat().st_size < HASHED_BELOW:
            return sha256_memo(p)
        return f"size:{p.stat().st_size}"
    items = []
    for q in sorted(p.rglob("*")):
        if q.is_file():
            items.append((str(q.relative_to(p)), q.stat().st_size,  # (a binary one: replaced)
                          q.read_text(errors="replace") if q.name == "config.json" else None))
    return _h(items)


def _declared(spec: Spec, name: str) -> str | None:
    """The spec path of external input `name`: target.path, data.path, stages.bench.drafter."""
    if name == "drafter":
        return spec.stages.bench.drafter if spec.stages.bench else None
    return spec.target.path if name == "target" else spec.data.path


def input_files(spec: Spec, stage: str) -> dict:
    """External files a stage reads (their content is part of the key): the registry row's
    `files`, "target" = target.path, "data" = data.path when set, "drafter" =
    stages.bench.drafter (a small draft directory: each file's content, not file_identity's
    names and sizes, so a retrained drafter of the same shapes is a new key)."""
    out = {}
    for f in stage_files(spec, stage):
        declared = _declared(spec, f)
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
    which still run under the variant that computes them first. Raises PlanError."""
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
            key = _h(parts)
            keys[(vname, stage)] = key
            sid = stage if vname == "base" else f"{stage}@{vname}"
            notes[(vname, stage)] = stage_note(vspec, stage)
            entries.append((vname, stage, key, parts, needs,
                            (stage in force or sid in force) and vname in picked,
                            (not only or stage in only or sid in only) and vname in picked))
    ids = {e[1] for e in entries} | {e[1] if e[0] == "base" else f"{e[1]}@{e[0]}" for e in entries}
    for s in (*force, *only):
        if s not in ids:
            raise PlanError(f"--force/--only {s!r}: no such stage in this spec; its stages are "
                            f"{', '.join(sorted(ids))}")
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
            errors, warn = _sort_problems(spec, stage_problems(specs[p.variant], p.stage,
                                                               manifests, p.id))
            if errors:
                raise PlanError(errors[0])
            warnings += warn
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


# problems about what this machine has (files, installed packages): on Slurm the compute nodes
# may have what the login node lacks, so there they are warnings (the plan cannot see a node)
MACHINE_FIELDS = ("target.", "data.", "stages.bench.backend")


def stage_problems(spec: Spec, stage: str, manifests: dict | None = None,
                   sid: str | None = None) -> list[str]:
    """What would make `stage` fail at once, checkable now, each a line naming its field and
    the fix: an upstream stage it requires that the spec lacks (registry `requires`), an input
    file (target.path, data.path, the fetched ShareGPT) that does not exist, what the stage's
    own data check would refuse in the data file it reads (runner/stages.py data_problems: no
    usable conversation, data.max_bad_fraction, data.holdout), the registry's `file_check`
    (regenerate: the carried set's checksum, runner/carry.py), its `preflight`
    (bench: sglang importable), target.device: cuda on a machine without a GPU
    (runner/placement.py device_problem), and the registry's `check` of its upstream
    artifacts when every one is complete (manifests: {stage: artifact.json or None}; None = not
    looked at, as in `runner validate`). sid names the stage in messages (stage@variant)."""
    out = []
    kind, sid = stage_kind(stage), sid or stage
    on = enabled_stages(spec)
    for need in kind.requires(spec):
        if need not in on:
            out.append(f"stages.{stage}: set, but the spec has no stages.{need}, so {stage} "
                       f"has nothing to work on ({need}: {stage_kind(need).description}) Add a "
                       f"stages.{need} block, or remove stages.{stage}.")
    for f in stage_files(spec, stage):
        declared = _declared(spec, f)
        n = len(out)
        if declared is None and f == "data" and spec.data.source == "sharegpt":
            from eagle3_runner.runner.assets import asset_path
            from eagle3_runner.runner.errors import FetchError
            try:
                asset_path("sharegpt")
            except FetchError as e:
                out.append(f"data.source = sharegpt ({sid} reads it): {e}")
        elif declared is not None and not expand_path(declared).exists():
            field = "stages.bench.drafter" if f == "drafter" else f"{f}.path"
            out.append(f"{field} = {declared!r}: {expand_path(declared)} does not exist "
                       f"({sid} reads it). Fix the path"
                       + (", or run `runner fetch all` for the demo assets." if f == "target"
                          else "."))
        elif f == "data" and declared is not None and expand_path(declared).is_dir():
            out.append(f"data.path = {declared!r}: a folder ({sid} reads one file); point it at "
                       "the JSONL or JSON file of conversations (plain, .gz or .zst).")
        if f == "data" and len(out) == n and reads_data(spec, stage):
            out += data_problems(spec)  # the stages' own count and verdicts, said the same way
    if kind.file_check is not None and (why := kind.file_check(spec)) is not None:
        out.append(why)  # regenerate: the carried set's checksum (runner/carry.py)
    if (why := placement.device_problem(spec, stage, sid)) is not None:
        out.append(why)
    # (a module without it, a test's stand-in, has nothing to check; tests/test_plan.py holds
    # every registry preflight to a function of the real module)
    check = getattr(stage_module(stage), kind.preflight, None) if kind.preflight else None
    if check is not None:
        try:
            check(spec)
        except RunnerError as e:
            out.append(str(e))
    if kind.check is not None and manifests and all(m is not None for m in manifests.values()):
        problem = kind.check(spec, manifests)
        if problem:
            out.append(f"{sid}: {problem}")
    return out


def _sort_problems(spec: Spec, problems: list[str]) -> tuple[list[str], list[str]]:
    """(errors, warnings): on Slurm a problem about this machine (MACHINE_FIELDS) is a warning,
    said as such; everything else is an error."""
    errors, warnings = [], []
    for problem in problems:
        if spec.executor.kind == "slurm" and problem.startswith(MACHINE_FIELDS):
            warnings.append(problem + " (checked on this machine; the compute nodes may have it)")
        else:
            errors.append(problem)
    return errors, warnings


def prompt_count_notes(spec: Spec, where: str = "stages.bench") -> list[str]:
    """stages.bench.num_prompts above the size of a chosen prompt set (MT-bench has 80,
    HumanEval 164, sharegpt data.holdout): the bench takes the whole set, fewer than asked."""
    bench = spec.stages.bench
    if bench is None or bench.num_prompts is None:
        return []
    from eagle3_runner.runner.stages import PROMPT_SET_SIZES
    sizes = {**PROMPT_SET_SIZES, "sharegpt": spec.data.holdout}
    return [f"{where}.num_prompts = {bench.num_prompts}: {name} has {sizes[name]} prompts"
            f"{' (data.holdout)' if name == 'sharegpt' else ''}; the bench takes those "
            f"{sizes[name]}. Lower num_prompts (null = the whole set) to say what runs."
            for name in bench.prompt_sets if bench.num_prompts > sizes[name]]


# the stages that generate, and so stop at the target's end-of-turn ids
GENERATING = ("regenerate", "bench")


def stop_id_notes(spec: Spec) -> list[str]:
    """A target whose tokenizer names an eos_token that is not among the model's end-of-turn
    ids (runner/target_config.py stop_ids_note: e.g. SmolLM2's GGUF converted by transformers
    5.17), when a stage that generates (GENERATING) runs on it, per distinct target.path of
    the spec and its variants. Reads the tokenizer files as text: no transformers."""
    from eagle3_runner.runner.target_config import stop_ids_note
    notes, seen = [], set()
    for vspec in [spec] + [variant_spec(spec, v.name) for v in spec.variants]:
        path = expand_path(vspec.target.path)
        if path in seen or not set(GENERATING) & set(enabled_stages(vspec)):
            continue
        seen.add(path)
        if (note := stop_ids_note(path)) is not None:
            notes.append(f"target.path = {vspec.target.path!r}: {note}")
    return notes


def spec_warnings(spec: Spec) -> list[str]:
    """What is valid but likely a mistake, said by validate and plan alike: aux ids that are
    SGLang's default plus one (runner/drafts/rules.py aux_shift_note); a bench num_prompts
    above a prompt set's size, per variant (prompt_count_notes); a tokenizer eos_token that
    is not the model's end of turn (stop_id_notes)."""
    from eagle3_runner.runner.drafts.rules import aux_shift_note
    note = aux_shift_note(spec.drafter.aux_layer_ids, spec.num_layers,
                          spec.target.family or "standard")
    notes = [note] if note else []
    notes += prompt_count_notes(spec)
    notes += stop_id_notes(spec)
    def bench_of(s):
        b = s.stages.bench
        return b and (b.num_prompts, tuple(b.prompt_sets), s.data.holdout)
    for v in spec.variants:  # a variant that changes the bench's prompts says so itself
        vspec = variant_spec(spec, v.name)
        if bench_of(vspec) != bench_of(spec):
            notes += prompt_count_notes(vspec, f"variants[{v.name}].stages.bench")
    return list(dict.fromkeys(notes))


def input_problems(spec: Spec) -> tuple[list[str], list[str]]:
    """`runner validate`'s look at the machine: stage_problems of every enabled stage of the
    spec and of each variant, as (errors, warnings) (_sort_problems), each once, then
    spec_warnings."""
    found = []
    for vname, vspec in [("base", spec)] + [(v.name, variant_spec(spec, v.name))
                                            for v in spec.variants]:
        for stage in enabled_stages(vspec):
            found += stage_problems(vspec, stage, None,
                                    stage if vname == "base" else f"{stage}@{vname}")
    errors, warnings = _sort_problems(spec, found)
    errors += output_problems(spec)
    return list(dict.fromkeys(errors)), list(dict.fromkeys(warnings + spec_warnings(spec)))


def output_problems(spec: Spec) -> list[str]:
    """Where the run writes: work_dir and results.path's folder must be writable folders and an
    existing results file a DuckDB file (the checks build_plan makes first), as messages."""
    results = expand_path(spec.results.path)
    try:
        _check_dir("work_dir", spec.resolved_work_dir(), spec.work_dir)
        _check_length("results.path", Path(os.path.abspath(results)), spec.results.path)
        if results.is_dir():
            raise PlanError(f"results.path: {results} is a folder; set it to a .duckdb file, "
                            f"e.g. {results / 'results.duckdb'}")
        _check_dir("results.path", results.parent, spec.results.path)
        _check_results_file(results)
    except PlanError as e:
        return [str(e)]
    return []


def _check_results_file(path: Path) -> None:
    """An existing results.path must be a DuckDB file (its header says DUCK at byte 8; DuckDB
    refuses an empty file too); a missing one is created by the first ingest. Raises
    PlanError."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except FileNotFoundError:
        return
    except OSError as e:
        raise PlanError(f"results.path: cannot read {path} ({e.strerror}); point results.path "
                        "at a DuckDB file or a new path.")
    if head[8:12] != b"DUCK":
        raise PlanError(f"results.path: {path} exists and is not a DuckDB file"
                        f"{' (it is empty)' if not head else ''}; point "
                        "results.path at a DuckDB file or a new path (e.g. runs/results.duckdb).")
    from eagle3_runner.runner.store import check_readable
    try:
        check_readable(path)
    except StoreError as e:
        raise PlanError(f"results.path: {e}") from None


def _check_length(field: str, path: Path, declared: str) -> None:
    """Raise PlanError when a part of `path` is longer than a file name may be (255 bytes) or
    the whole leaves too little of PATH_MAX (4096) for the artifacts below it."""
    long = [part for part in Path(path).parts if len(part.encode()) > 255]
    if long or len(str(path).encode()) > 3800:
        what = f"its part {long[0][:40]!r}... has {len(long[0].encode())} bytes (at most 255)" \
            if long else f"it has {len(str(path).encode())} bytes (at most 3800)"
        raise PlanError(f"{field} = {declared[:80]!r}: {what}; use a shorter path.")


def _check_dir(field: str, path: Path, declared: str) -> None:
    """Raise PlanError unless `path` is (or can be created as) a writable folder: its nearest
    existing ancestor must be a folder where a file can be made, tried with a nameless
    temporary file (permission bits alone pass root under /proc or on a read-only mount)."""
    p = Path(os.path.abspath(path))
    _check_length(field, p, declared)
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise PlanError(f"{field} = {declared!r}: {p} is a file, not a folder. Point {field} "
                        "somewhere else or move the file away.")
    import tempfile
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise PlanError(f"{field} = {declared!r}: {p} is not writable ({e.strerror}). Point "
                        f"{field} at a folder you can write to.") from None


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
