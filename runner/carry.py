"""A regenerated set carried from one GPU window into the next: `stages.regenerate.reuse`.

The carried set is the regenerate stage's shards (data/regen_store.py) concatenated into one file,
`regen-<spec name>.jsonl.gz` (gzip members end to end are one gzip stream), with a `sha256sum`
sidecar next to it, PATH + ".sha256" ("<hex>  <name>"), made where the set was written
(scripts/gpu/pays.sh regen). It is kept outside the repository (the git-ignored .stage/regen/)
and staged again with its sidecar.

- File there: its sha256 must be the sidecar's (`problem`: validate and plan, through the
  registry row's `file_check`, and the stage itself, say a missing sidecar or a mismatch, naming
  both hashes and the fix). The stage loads no target and generates nothing: it writes the
  set's records as its shards (data/regen_store.py `reuse_set`). Its cache key is the file's sha256
  (runner/stages.py), so another carried set reruns what reads it, and it runs no target
  (runner/engines.py stage_role: no engine, no memory estimate, no GPU check).
- File missing: the stage regenerates, with the key it has without the field (declaring a set
  that is not there yet never reruns a finished regeneration).
- Which target made it: a second sidecar, PATH + ".json" (`PROVENANCE`), the regenerate
  stage's state record of the run that generated the set (runner/job.py writes it under
  <work_dir>/state/; pays.sh copies it next to the set): its inputs.files.target (the target's
  content identity, runner/files.py file_identity) and its spec slice (target, regenerate). A
  set another target made is refused (`problem`): training on another model's answers is a
  drafter for that model, silently. Sampling settings that differ from the spec's (temperature,
  max_new_tokens, ...) and a set without the sidecar are warned about (`warnings`).
- Grown (`stages.regenerate.extend: true`, `EXTEND`): with the file there, the stage writes the
  set's records as its shards and then regenerates what the set does not hold (jobs/regenerate.py
  run, data/regen_store.py carry_into): new conversations, and the later turns (up to max_turns)
  of carried conversations the data has more turns of (jobs/regen_turns.py later_turns); it runs
  the target, its key is the file's sha256 with the generation's inputs, and its state record
  names the target: the union it outputs is carried into the next window like a regenerated set
  (`extends`; `reuses` is the plain reuse).
`note` is the plan's line about it. Torch-free.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

from eagle3_runner.runner.errors import EnvVarError
from eagle3_runner.runner.files import GZIP_MAGIC, expand_path, file_identity, sha256_file

FIELD = "stages.regenerate.reuse"
EXTEND = "stages.regenerate.extend"
SIDECAR = ".sha256"
PROVENANCE = ".json"  # the generating run's regenerate state record
# the stage's settings that shape the set's text: a set made with others is warned about
SHAPING = ("temperature", "top_p", "max_new_tokens", "max_turns", "synthetic_prompts",
           "synthetic_max_tokens", "synthetic_temperature", "synthetic_top_p")
_LINE = re.compile(r"^\\?([0-9a-fA-F]{64})(?:\s+\*?(.*))?$")  # sha256sum's "<hex>  <name>"


def declared(spec) -> Path | None:
    """stages.regenerate.reuse expanded, or None when the stage or the field is not set (or its
    variables do not expand: the spec's path check says so)."""
    p = getattr(spec.stages, "regenerate", None)
    if p is None or p.reuse is None:
        return None
    try:
        return expand_path(p.reuse)
    except (EnvVarError, ValueError):
        return None


def present(spec) -> Path | None:
    """The carried set's path when it is declared and there (a file): the stage reuses it."""
    p = declared(spec)
    return p if p is not None and p.is_file() else None


def extends(spec) -> Path | None:
    """The carried set's path when it is there and stages.regenerate.extend is on: the stage
    writes its records and regenerates on top of them (runs the target)."""
    p = present(spec)
    return p if p is not None and spec.stages.regenerate.extend else None


def reuses(spec) -> Path | None:
    """The carried set's path when it is there and only reused (extend off): the stage writes
    its records and runs no target."""
    p = present(spec)
    return p if p is not None and not spec.stages.regenerate.extend else None


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR)


@lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return sha256_file(path)


def file_sha256(path: Path) -> str:
    """The file's sha256, hashed once per process while its (size, mtime, inode) stay the same
    (the plan asks for it for the key, the check and the note; a new process hashes again)."""
    st = os.stat(path)
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def sidecar_sha256(path: Path) -> str | None:
    """The sha256 the sidecar gives for `path` (lower case), or None when there is no sidecar.
    A sha256sum line "<hex>  <name>" (or "<hex> *<name>", or the hex alone); of several lines, the
    one naming the file. Raises ValueError when it holds no such line."""
    side = sidecar(path)
    try:
        text = side.read_text(errors="replace")
    except FileNotFoundError:
        return None
    found = [m for m in map(_LINE.match, (ln.strip() for ln in text.splitlines())) if m]
    if len(found) > 1:
        found = [m for m in found if m.group(2) and Path(m.group(2)).name == path.name]
    if len(found) != 1:
        raise ValueError(f"{side} holds no sha256sum line for {path.name} (\"<64 hex digits>  "
                         f"{path.name}\")")
    return found[0].group(1).lower()


def provenance(path: Path) -> dict | None:
    """The carried set's PROVENANCE sidecar (the generating run's regenerate state record), or
    None when there is none. Raises ValueError when it is not such a record."""
    side = path.with_name(path.name + PROVENANCE)
    try:
        rec = json.loads(side.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{side} is not readable JSON ({e})")
    if not _is_regenerate_record(rec):
        raise ValueError(f"{side} is not a regenerate stage's state record (a JSON object with "
                         "inputs.files.target, a string, and spec.regenerate, an object: "
                         "<work_dir>/state/base.regenerate.json of the run that made the set)")
    return rec


def _is_regenerate_record(rec) -> bool:
    """Whether `rec` has the shape of a regenerate stage's state record (runner/plan.py
    write_state of a generating run): what provenance() relies on, each part of its type."""
    spec = rec.get("spec") if isinstance(rec, dict) else None
    inputs = rec.get("inputs") if isinstance(rec, dict) else None
    files = inputs.get("files") if isinstance(inputs, dict) else None
    return (isinstance(spec, dict) and isinstance(spec.get("regenerate"), dict)
            and isinstance(spec.get("target", {}), dict) and isinstance(files, dict)
            and isinstance(files.get("target"), str))


def _target_identity(spec) -> str | None:
    try:
        return file_identity(expand_path(spec.target.path))
    except (EnvVarError, ValueError, OSError):
        return None


def target_problem(spec, path: Path) -> str | None:
    """Why the set at `path` was made by another target than spec's (its PROVENANCE's target
    identity against file_identity of target.path, naming both paths and the fix), or why its
    sidecar is unreadable; None when they agree, or when either side is unknown."""
    head = f"{FIELD} = {spec.stages.regenerate.reuse!r}"
    try:
        rec = provenance(path)
    except ValueError as e:
        return f"{head}: {e}. Stage the set's sidecars as the window that made it wrote them."
    if rec is None:
        return None
    made, ours = rec["inputs"]["files"]["target"], _target_identity(spec)
    if ours in (None, "missing") or made == ours:
        return None
    was = (rec["spec"].get("target") or {}).get("path", "?")
    return (f"{head}: {path} was generated by another target ({was}, identity {made[:12]}...) "
            f"than target.path = {spec.target.path!r} (identity {ours[:12]}...): a drafter "
            f"trained on it would learn that model's answers. Remove {FIELD} to regenerate with "
            "this target, or point target.path at the model that made the set.")


def warnings(spec) -> list[str]:
    """What the plan and validate say about a carried set that is there and passes `problem`:
    no PROVENANCE sidecar (which target made it cannot be checked), or settings of the
    regenerate stage (SHAPING) that differ from the run that made it, naming each."""
    path = present(spec)
    if path is None:
        return []
    head = f"{FIELD} = {spec.stages.regenerate.reuse!r}"
    try:
        rec = provenance(path)
    except ValueError:
        return []  # problem() says it
    if rec is None:
        return [f"{head}: {path} has no {path.name}{PROVENANCE} (the state record of the run "
                "that made it), so which target generated it cannot be checked; it is reused "
                "as it is."]
    made = rec["spec"].get("regenerate") or {}
    ours = spec.stages.regenerate.model_dump()
    diff = [f"{k} {made[k]!r} (this spec: {ours.get(k)!r})" for k in SHAPING
            if k in made and made[k] != ours.get(k)]
    out = [] if not diff else [
        f"{head}: the set was made with other stages.regenerate settings: "
        f"{', '.join(diff)}; it is reused as it was made (they shape only new sets"
        + (", and the answers extend adds to it" if spec.stages.regenerate.extend else "")
        + ")."]
    if spec.stages.regenerate.extend and (why := _data_differs(spec, rec)):
        out.append(f"{EXTEND}: the set was made from other data ({why}): its real conversations "
                   "are named by data order (real-NNNNNN), so growing it may skip conversations "
                   "of this data or answer one it holds again (the train stage drops exact "
                   "duplicates); a carried one gets later turns only where its turns are this "
                   "data's (the others count as carried_unlike_data). Point data at the set's "
                   "data or at the same conversations with more turns (scripts/gpu/"
                   "sharegpt_subset.py --keep-as), or remove stages.regenerate.extend.")
    return out


# data settings that do not change which conversation a real-NNNNNN id names: the bad-record
# bound, and max_samples (the training conversations are a prefix of one seeded order after the
# holdout, data/conversations.py load_conversations: more samples add ids, fewer keep the carried
# ones, so raising it is how a grown set takes in more real conversations)
_ID_FREE = ("max_bad_fraction", "max_samples")


def _data_differs(spec, rec: dict) -> str | None:
    """How the data of the run that made the set (its state record `rec`: the spec's data
    section but _ID_FREE, and the data file's identity) differs from spec's, or None (same, or
    unknown)."""
    made = rec["spec"].get("data")
    ours = {k: v for k, v in spec.data.model_dump(mode="json").items() if k not in _ID_FREE}
    if isinstance(made, dict):
        diff = [f"data.{k} {made.get(k)!r} (this spec: {v!r})" for k, v in ours.items()
                if k in made and made[k] != v]
        if diff:
            return ", ".join(diff)
    was = rec["inputs"]["files"].get("data")
    try:
        now = file_identity(expand_path(spec.data.path)) if spec.data.path else None
    except (EnvVarError, ValueError, OSError):
        now = None
    if isinstance(was, str) and now not in (None, "missing") and was != now:
        return f"the data file's content (identity {was[:12]}..., now {now[:12]}...)"
    return None


def problem(spec) -> str | None:
    """Why the declared carried set cannot be reused, naming the field, the file, both hashes
    and the fix; None when it is fine or not there (the stage then regenerates)."""
    p = declared(spec)
    if p is None or not p.exists():
        return None
    head = f"{FIELD} = {spec.stages.regenerate.reuse!r}"
    fix = (f"Stage it again together with its {SIDECAR} (both as the window that made them "
           f"wrote them), or remove {FIELD} to regenerate.")
    if not p.is_file():
        return (f"{head}: {p} is a folder; point it at the carried gzip JSONL file "
                f"(regen-<spec name>.jsonl.gz), or remove {FIELD} to regenerate.")
    with open(p, "rb") as f:
        if f.read(2) != GZIP_MAGIC:
            return (f"{head}: {p} is not a gzip file (a carried set is the regenerate stage's "
                    "shards, part-*.jsonl.gz, joined with `cat`). Carry that file, or remove "
                    f"{FIELD} to regenerate.")
    digest = file_sha256(p)
    try:
        want = sidecar_sha256(p)
    except (ValueError, OSError) as e:
        return f"{head}: the checksum file is unreadable ({e}); {p} has sha256 {digest}. {fix}"
    if want is None:
        return (f"{head}: {p} has no checksum file {sidecar(p)} (the file's sha256 is {digest}, "
                f"with nothing to check it against). {fix}")
    if want != digest:
        return (f"{head}: {p} has sha256 {digest}, but {sidecar(p).name} says {want}: the file "
                f"changed or was staged incompletely. {fix}")
    return target_problem(spec, p)


def note(spec) -> str | None:
    """The plan's line about the carried set: `reuses PATH (sha256 ...)`, `extends PATH (sha256
    ...)` or `regenerates: PATH not found`; None when the field is not set."""
    p = declared(spec)
    if p is None:
        return None
    if p.is_file() and spec.stages.regenerate.extend:
        return (f"extends {p} (sha256 {file_sha256(p)[:12]}...: its records, continued with "
                "the data's later turns, then new conversations regenerated on top)")
    if p.is_file():
        return f"reuses {p} (sha256 {file_sha256(p)[:12]}..., no target run)"
    return f"regenerates: {p} not found ({FIELD})"


def explain(old: dict, new: dict) -> str | None:
    """The plan's rerun reason when a stage's key slice went from generating to reusing or
    extending or back, or to another carried set (runner/plan.py _explain); None for any other
    change."""
    def mode(s: dict) -> str | None:
        return "reuse" if "reuse" in s else "extend" if "extend" in s else None
    was, now = mode(old), mode(new)
    if was != now:
        if "extend" in (was, now):
            what = {"extend": "the carried set is there: grows it", "reuse": "reuses the carried "
                    "set as it is", None: "no carried set: regenerates"}[now]
            return f"spec changed: {EXTEND} ({what})"
        what = "the carried set is there" if now else "no carried set: regenerates"
        return f"spec changed: {FIELD} ({what})"
    if now is not None and old[now] != new[now]:
        return f"input changed: {FIELD} holds another set"
    return None
