"""Checks before a stage runs, said by `runner validate` and `runner plan` alike: what would make
a stage fail at once, checkable now (`stage_problems`: its required upstreams, input files, the
data's verdicts, the registry's `file_check`, `preflight` and `check`, the device), sorted into
errors and warnings; the registry's `notes` on a stage's settings (`stage_notes`) (`sort_problems`: on Slurm a problem about this machine is a warning,
`MACHINE_FIELDS`); what is valid but likely a mistake (`spec_warnings`); where the run writes
(`output_problems`: work_dir, results.path). `input_problems` is validate's whole look;
runner/plan.py build_plan calls the same functions on the stages it runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_runner.runner import placement
from eagle3_runner.runner.errors import PlanError, RunnerError, StoreError
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.spec.load import variant_spec
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.stages import (data_problems, enabled_stages, reads_data, stage_files,
                                         stage_kind, stage_module)


def declared_path(spec: Spec, name: str) -> str | None:
    """The spec path of external input `name`: target.path, data.path, stages.bench.drafter."""
    if name == "drafter":
        return spec.stages.bench.drafter if spec.stages.bench else None
    return spec.target.path if name == "target" else spec.data.path


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
        declared = declared_path(spec, f)
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


def stage_notes(spec: Spec, stage: str, manifests: dict | None = None,
                sid: str | None = None) -> list[str]:
    """The registry's `notes` of `stage`: warnings about settings that are valid but do not do
    what they say on the stage's input (train: a batch larger than its samples, a warm-up
    longer than its steps), counted from its upstream artifacts (manifests, as stage_problems)
    or, before the run, from the data; [] when the count is not known."""
    kind = stage_kind(stage)
    return kind.notes(spec, manifests, sid or stage) if kind.notes is not None else []


def sort_problems(spec: Spec, problems: list[str]) -> tuple[list[str], list[str]]:
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
    from eagle3_runner.runner.spec.stage_blocks import PROMPT_SET_SIZES
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
    SGLang's default plus one (runner/drafts/checks.py aux_shift_note); a bench num_prompts
    above a prompt set's size, per variant (prompt_count_notes); a tokenizer eos_token that
    is not the model's end of turn (stop_id_notes); a carried regenerated set declared but not
    there (carry_note: regenerate then runs the target, as the plan says)."""
    from eagle3_runner.runner.drafts.checks import aux_shift_note
    note = aux_shift_note(spec.drafter.aux_layer_ids, spec.num_layers,
                          spec.target.family or "standard")
    notes = [note] if note else []
    notes += prompt_count_notes(spec)
    notes += stop_id_notes(spec)
    notes += carry_note(spec)

    def bench_of(s):
        b = s.stages.bench
        return b and (b.num_prompts, tuple(b.prompt_sets), s.data.holdout)
    for v in spec.variants:  # a variant that changes the bench's prompts says so itself
        vspec = variant_spec(spec, v.name)
        if bench_of(vspec) != bench_of(spec):
            notes += prompt_count_notes(vspec, f"variants[{v.name}].stages.bench")
    return list(dict.fromkeys(notes))


def carry_note(spec: Spec) -> list[str]:
    """[a warning] when stages.regenerate.reuse names a file that is not there (a typo, or a set
    not staged yet): the stage then regenerates, which is valid but costs the target's time;
    for a set that is there, runner/carry.py `warnings` (no provenance, other settings)."""
    from eagle3_runner.runner import carry
    p = carry.declared(spec)
    if p is None:
        return []
    if carry.present(spec) is not None:
        return carry.warnings(spec)
    return [f"{carry.FIELD} = {spec.stages.regenerate.reuse!r}: {p} is not there, so regenerate "
            "runs the target instead of reusing it. Stage the carried set (with its .sha256) "
            "there, or remove the field."]


def input_problems(spec: Spec) -> tuple[list[str], list[str]]:
    """`runner validate`'s look at the machine: stage_problems of every enabled stage of the
    spec and of each variant, as (errors, warnings) (sort_problems), each once, then their
    stage_notes and spec_warnings."""
    found, notes = [], []
    for vname, vspec in [("base", spec)] + [(v.name, variant_spec(spec, v.name))
                                            for v in spec.variants]:
        for stage in enabled_stages(vspec):
            sid = stage if vname == "base" else f"{stage}@{vname}"
            found += stage_problems(vspec, stage, None, sid)
            notes += stage_notes(vspec, stage, None, sid)
    errors, warnings = sort_problems(spec, found)
    errors += output_problems(spec)
    return list(dict.fromkeys(errors)), list(dict.fromkeys(warnings + notes +
                                                           spec_warnings(spec)))


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
    """An existing results.path must be a DuckDB file (its header says DUCK at byte 8, store.py
    `not_duckdb`; DuckDB refuses an empty file too), readable and the runner's (store.py
    `check_readable`); a missing one is created by the first ingest. Raises PlanError."""
    from eagle3_runner.runner.store import check_readable, not_duckdb
    if not path.exists():
        return
    try:
        why = not_duckdb(path)
    except OSError as e:
        raise PlanError(f"results.path: cannot read {path} ({e.strerror}); point results.path "
                        "at a DuckDB file or a new path.")
    if why is not None:
        raise PlanError(f"results.path: {path} exists and is not a DuckDB file"
                        f"{' (it is empty)' if why == 'it is empty' else ''}; point "
                        "results.path at a DuckDB file or a new path (e.g. runs/results.duckdb).")
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
