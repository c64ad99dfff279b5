"""The regenerate stage's output: gzip JSONL shards, written atomically, read back by one reader
(the extract stage, the online training, a resumed run). Torch-free.

Layout of the artifact directory:
  shards/part-00000.jsonl.gz, part-00001.jsonl.gz, ...   one record per line
  synthetic_prompts.jsonl.gz   the kept synthetic user turns (written once, before answering)
  report.json
A record: {"id": "real-000012" | "syn-000007", "source": "real" | "synthetic", "index": int,
"messages": [{"role", "content"}], "finish": ["stop" | "length" per assistant turn],
"answer_tokens": [tokens per assistant turn], "cut": reason | null (turns after it not
generated), "dropped": reason | null (no assistant turn: not training data)}.
Every conversation of a run ends in exactly one record, dropped ones included, so a resumed run
knows what is done: no duplicates, no losses.

Atomicity: a shard is written to `.tmp-<name>` and renamed; a shard that does not decompress
whole (a power loss before the data reached the disk) is removed on resume and its
conversations generated again. Size: gzip at level 6, ~1.3 bytes per token of text.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eagle3_runner.data.conversations import ROLE_MAP
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_path, atomic_write

# the keys of a record (module docstring); a carried set (stages.regenerate.reuse) is checked
# against them before it becomes a stage's output
RECORD_KEYS = ("id", "source", "index", "messages", "finish", "answer_tokens", "cut", "dropped")
SHARDS = "shards"
SYNTHETIC = "synthetic_prompts.jsonl.gz"
BUDGET = "time_budget"  # the cut/dropped reason of the stage's time budget (jobs/regen_turns.py)
LEGACY = "conversations.jsonl"  # artifacts of the HF-generate stage (before shards)


def write_gz_jsonl(path: Path, records: list[dict]) -> int:
    """Write records as gzip JSONL to `.tmp-<name>` and rename over `path`. Returns bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = gzip.compress("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                 for r in records).encode(), compresslevel=6, mtime=0)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def read_gz_jsonl(path: Path) -> list[dict]:
    """Records of a gzip JSONL file. Raises ValueError when it is truncated or corrupt."""
    try:
        text = gzip.decompress(Path(path).read_bytes()).decode()
        return [json.loads(line) for line in text.split("\n") if line.strip()]
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a complete gzip JSONL file ({e})") from e


class ShardWriter:
    """Buffers finished records and writes `per_shard` of them per shard (atomic).

    On open it reads the complete shards already in `out_dir/shards` (a resumed run), removes
    temp files and shards that do not decompress, and numbers new shards after the last one."""

    def __init__(self, out_dir: Path, per_shard: int):
        self.dir = Path(out_dir) / SHARDS
        self.dir.mkdir(parents=True, exist_ok=True)
        self.per_shard, self.buf, self.bytes = per_shard, [], 0
        self.done: list[dict] = []  # records of earlier runs
        last = -1
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(".tmp-"):
                p.unlink()
                continue
            try:
                self.done += read_gz_jsonl(p)
            except ValueError:
                p.unlink()
                continue
            self.bytes += p.stat().st_size
            last = max(last, int(p.name.split("-")[1].split(".")[0]))
        self.next = last + 1
        self.resumed = len(self.done)

    def add(self, record: dict) -> None:
        self.buf.append(record)
        if len(self.buf) >= self.per_shard:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.bytes += write_gz_jsonl(self.dir / f"part-{self.next:05d}.jsonl.gz", self.buf)
            self.next += 1
            self.buf = []


def read_records(out_dir: Path) -> list[dict]:
    """Every record of a regenerate artifact, ordered by (source, index): real conversations in
    data order, then synthetic ones (the order does not depend on completion order or resumes).
    Reads the legacy conversations.jsonl of older artifacts too. Raises ValueError for a corrupt
    shard, FileNotFoundError when there is neither."""
    out_dir = Path(out_dir)
    shard_dir = out_dir / SHARDS
    if not shard_dir.is_dir():
        legacy = out_dir / LEGACY
        if not legacy.is_file():
            raise FileNotFoundError(f"{out_dir}: no {SHARDS}/ and no {LEGACY}: not a regenerate "
                                    "artifact")
        return [{"id": f"real-{i:06d}", "source": "real", "index": i, **json.loads(line)}
                for i, line in enumerate(legacy.read_text().split("\n")) if line.strip()]
    recs = [r for p in sorted(shard_dir.glob("part-*.jsonl.gz")) for r in read_gz_jsonl(p)]
    return sorted(recs, key=lambda r: (r["source"] != "real", r["index"]))


def records_problem(records: list) -> str | None:
    """Why `records` are not a regenerate stage's records, or None. Checks what the stage's
    writer (jobs/regen_turns.py Conv.record) produces: the keys of RECORD_KEYS, id a string
    once, source real or synthetic, an int index, each field's type (`_fields_problem`),
    messages turns the data cleaner reads (`_messages_problem`) and not empty in every record
    that was not dropped. Names the first bad record (its number and id) and the field."""
    seen = set()
    for n, r in enumerate(records):
        where = f"record {n + 1}"
        if not isinstance(r, dict):
            return f"{where} is not an object"
        missing = [k for k in RECORD_KEYS if k not in r]
        if missing:
            return f"{where} has no {', '.join(missing)} (not a regenerate record)"
        if not isinstance(r["id"], str) or r["source"] not in ("real", "synthetic") \
                or not _count(r["index"]):
            return (f"{where}: id {r['id']!r}, source {r['source']!r}, index {r['index']!r} "
                    "(a string; real or synthetic; a non-negative integer)")
        where = f"{where} ({r['id']!r})"
        if (why := _fields_problem(r) or _messages_problem(r["messages"])) is not None:
            return f"{where}: {why}"
        if not r["dropped"] and not r["messages"]:
            return f"{where}: neither dropped nor any messages"
        if r["id"] in seen:
            return f"{where}: id {r['id']!r} twice"
        seen.add(r["id"])
    return None


def _count(v) -> bool:
    """v is a non-negative int (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _short(v, width: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def _fields_problem(r: dict) -> str | None:
    """Why a record's finish, answer_tokens, cut or dropped is not of the writer's type (finish:
    a list of strings, answer_tokens: a list of non-negative ints of the same length, one per
    assistant turn; cut, dropped: a string or null), naming the field and its value; or None."""
    if not isinstance(r["answer_tokens"], list) or not all(map(_count, r["answer_tokens"])):
        return (f"answer_tokens {_short(r['answer_tokens'])} is not a list of token counts "
                "(non-negative integers, one per assistant turn)")
    if not isinstance(r["finish"], list) or not all(isinstance(f, str) for f in r["finish"]):
        return (f"finish {_short(r['finish'])} is not a list of finish reasons (\"stop\" or "
                "\"length\", one per assistant turn)")
    if len(r["finish"]) != len(r["answer_tokens"]):
        return (f"finish has {len(r['finish'])} entries and answer_tokens "
                f"{len(r['answer_tokens'])} (one each per assistant turn)")
    for k in ("cut", "dropped"):
        if r[k] is not None and not isinstance(r[k], str):
            return f"{k} {_short(r[k])} is not a reason (a string) or null"
    return None


def _messages_problem(messages) -> str | None:
    """Why a record's messages are not a list of turns {"role", "content"} (or ShareGPT's
    {"from", "value"}) with string role and content and a role the data cleaner knows
    (data/conversations.py ROLE_MAP); None when they are. Names the turn and its value."""
    if not isinstance(messages, list):
        return f"messages {_short(messages)} is not a list of turns"
    for i, t in enumerate(messages):
        role, content = (t.get("from", t.get("role")), t.get("value", t.get("content"))) \
            if isinstance(t, dict) else (None, None)
        if not isinstance(role, str) or not isinstance(content, str):
            return (f"messages[{i}] {_short(t)} is not a turn {{\"role\": str, \"content\": "
                    "str} (or {\"from\": str, \"value\": str})")
        if role.strip().lower() not in ROLE_MAP:
            return (f"messages[{i}] has role {_short(role)}, which the data cleaner does not know "
                    "(user, assistant, system or tool; docs/data.md)")
    return None


def read_conversations(out_dir: Path) -> tuple[list[dict], dict]:
    """Training records {"messages": [...]} of a regenerate artifact (dropped conversations
    left out), and {"shards", "records", "dropped", "path"}. Used by the extract stage."""
    recs = read_records(out_dir)
    keep = [{"messages": r["messages"]} for r in recs if not r.get("dropped")]
    n = len(list((Path(out_dir) / SHARDS).glob("part-*.jsonl.gz")))
    return keep, {"path": str(out_dir), "shards": n, "records": len(recs),
                  "dropped": len(recs) - len(keep)}


def summarize(records: list, pre: Counter, syn: dict | None) -> dict:
    """Stage metrics over ALL records (resumed ones included): conversations, turns and answer
    tokens per source, mean answer length, EOS vs length-cap fractions, drops by reason."""
    m: dict = {}
    for src in ("real", "synthetic"):
        rs = [r for r in records if r["source"] == src and not r["dropped"]]
        m[f"conversations_{src}"] = len(rs)
        m[f"turns_{src}"] = sum(len(r["finish"]) for r in rs)
        m[f"answer_tokens_{src}"] = (sum(sum(r["answer_tokens"]) for r in rs), "tok")
    fin = [f for r in records for f in r["finish"]]
    toks = [t for r in records for t in r["answer_tokens"]]
    m["conversations"] = m["conversations_real"] + m["conversations_synthetic"]
    m["turns"] = len(fin)
    m["mean_answer_tokens"] = (sum(toks) / max(len(toks), 1), "tok")
    m["eos_fraction"] = sum(f == "stop" for f in fin) / max(len(fin), 1)
    m["length_cap_fraction"] = sum(f == "length" for f in fin) / max(len(fin), 1)
    drops = Counter({f"dropped_{k}": v for k, v in pre.items() if k != "cut_max_turns"})
    drops.update(f"dropped_{r['dropped']}" for r in records if r["dropped"])
    drops.update(f"cut_{r['cut']}" for r in records if r["cut"])
    for k, v in (syn or {}).get("dropped", {}).items():
        drops[f"dropped_synthetic_{k}"] += v
    m["cut_max_turns"] = pre.get("cut_max_turns", 0)
    m.update(sorted(drops.items()))
    return m


def _write_missing(out: Path, shard_conversations: int,
                   records: list[dict]) -> tuple[ShardWriter, list[dict]]:
    """Write the `records` that `out`'s shards do not hold yet (by id: a resumed run keeps what
    it wrote), in order, shard_conversations per shard. Returns (the writer: its resumed and
    bytes, every record `out` holds then)."""
    writer = ShardWriter(out, shard_conversations)
    done = {r["id"] for r in writer.done}
    for r in records:
        if r["id"] not in done:
            writer.add(r)
    writer.flush()
    return writer, read_records(out)


def reuse_set(path: Path, out: Path, shard_conversations: int) -> dict:
    """The carried set at `path` (stages.regenerate.reuse, runner/carry.py; its checksum already
    checked) as the regenerate stage's output in `out`, without the target: its records (this
    module's reader), checked to be a regenerate stage's, are written as the stage's shards
    (shard_conversations per shard, in the file's order; a resumed run keeps the shards it
    wrote), so extract and online training read them as they read a regenerated artifact.
    Returns summarize's metrics over the records (the generation's speeds and the data's drops
    belong to the run that made the set) with reused = 1; report.json says `reused` (file,
    sha256, records kept and dropped)."""
    from eagle3_runner.runner.carry import FIELD
    out = Path(out)
    fix = f"stage it again with its .sha256, or remove {FIELD} to regenerate"
    digest, records = _load_set(path)
    writer, written = _write_missing(out, shard_conversations, records)
    if sorted(r["id"] for r in written) != sorted(r["id"] for r in records):
        raise StageError(f"regenerate: {out} holds {len(written)} records for the {len(records)} "
                         f"of {path} (records of another set); remove the partial directory and "
                         "run again")
    m = summarize(written, Counter(), None)
    del m["cut_max_turns"]  # counted by the run that made the set; not in its records
    if not m["conversations"]:
        raise StageError(f"{FIELD}: {path} holds {len(records)} records and every one was "
                         f"dropped; {fix}")
    m["reused"] = 1
    m["resumed_conversations"] = writer.resumed
    m["output_bytes"] = (writer.bytes, "B")
    kept = sum(not r["dropped"] for r in written)
    atomic_write(out / "report.json", json.dumps(
        {"reused": {"file": str(path), "sha256": digest, "records": len(written), "kept": kept,
                    "dropped": len(written) - kept},
         "regenerate": {k: (v[0] if isinstance(v, tuple) else v) for k, v in m.items()}},
        indent=1))
    print(f"regenerate: reused {path} (sha256 {digest[:12]}...): {kept} conversations kept, "
          f"{len(written) - kept} dropped records", file=sys.stderr, flush=True)
    return m


def _load_set(path: Path) -> tuple[str, list[dict]]:
    """(sha256, records) of the carried set at `path`, checked to be a regenerate stage's records
    (records_problem) and not empty. Raises StageError naming stages.regenerate.reuse and the
    fix."""
    from eagle3_runner.runner.carry import FIELD, file_sha256
    fix = f"stage it again with its .sha256, or remove {FIELD} to regenerate"
    digest = file_sha256(path)
    try:
        records = read_gz_jsonl(path)
    except ValueError as e:
        raise StageError(f"{FIELD}: {e}; {fix}")
    if (why := records_problem(records)) is not None:
        raise StageError(f"{FIELD}: {path} is not a regenerated set ({why}); {fix}")
    if not records:  # e.g. the gzip of an empty shard list: nothing was carried
        raise StageError(f"{FIELD}: {path} holds no records: not the set a regenerate run "
                         f"brought back; {fix}")
    return digest, records


def _text(turn: dict) -> str:
    """A turn's text: {"role", "content"} or ShareGPT's {"from", "value"} (_messages_problem)."""
    return turn.get("content", turn.get("value"))


@dataclass(frozen=True)
class Carried:
    """A carried set written as a growing stage's first shards (carry_into). ids: the carried
    records (every record of the set but those its run never started, dropped for the time
    budget: those conversations are generated again), held ones included; prompts: the carried
    synthetic user turns (the first turn of each answered synthetic record), which no new
    prompt may repeat; next_synthetic: the first synthetic index free (the set's highest + 1,
    dropped records' included: their prompts are lost, their indices used); kept: the training
    conversations among ids (not dropped); unstarted: the never-started records left out; held:
    the records held back to be continued with the data's later turns (carry_into `later`), not
    written: the run writes each, continued or as it was; not_continued: {reason: records} of
    the others (`later`'s reasons; empty without it); info: report.json's `extended` {file,
    sha256, records, kept, unstarted, held, not_continued}."""

    ids: frozenset
    prompts: tuple
    next_synthetic: int
    kept: int
    unstarted: int
    info: dict
    held: tuple = ()
    not_continued: dict = field(default_factory=dict)


def carry_into(path: Path, out: Path, shard_conversations: int,
               later: Callable[[dict], str | None] | None = None) -> Carried:
    """The carried set at `path` (stages.regenerate.reuse with extend; its checksum already
    checked) as the first shards of a regenerate stage that then regenerates on top of them
    (jobs/regenerate.py regenerate `carried`: ShardWriter.done makes the carried conversations
    done, as a resumed run's). Writes every record but the never-started ones (dropped
    time_budget) and those held back, in the file's order, shard_conversations per shard; a
    resumed run keeps what it wrote (a record already in `out`, carried or generated, is not
    written again). later: why a record is not continued with later turns of its conversation
    (jobs/regen_turns.py carried_later), None when it is: such a record is held back
    (Carried.held) for the run to continue and write (jobs/regen_turns.py continue_carried; one
    the time budget never starts is written as it was carried), so the union holds it once.
    Raises StageError when the set is not a regenerated one, or when `out` holds records of
    another set (a carried id, not held, missing after the write)."""
    digest, records = _load_set(path)
    carried = [r for r in records if r["dropped"] != BUDGET]
    held, why = [], Counter()
    for r in carried if later is not None else ():
        if (reason := later(r)) is None:
            held.append(r)
        else:
            why[reason] += 1
    held_ids = {r["id"] for r in held}
    _, written = _write_missing(out, shard_conversations,
                                [r for r in carried if r["id"] not in held_ids])
    ids = frozenset(r["id"] for r in carried)
    if missing := ids - held_ids - {r["id"] for r in written}:
        raise StageError(f"regenerate: {out} lacks {len(missing)} records of {path} (records of "
                         "another set); remove the partial directory and run again")
    syn = [r for r in records if r["source"] == "synthetic"]
    kept = sum(not r["dropped"] for r in carried)
    info = {"file": str(path), "sha256": digest, "records": len(records), "kept": kept,
            "unstarted": len(records) - len(carried), "held": len(held),
            "not_continued": dict(sorted(why.items()))}
    later_line = "" if later is None else (
        f"; {len(held)} of them to continue with the data's later turns"
        + (f" ({why['unlike_data']} real ones unlike the data's turns, kept as they are: not "
           "the set's data?)" if why["unlike_data"] else ""))
    print(f"regenerate: extends {path} (sha256 {digest[:12]}...): {kept} conversations carried"
          f"{later_line}, {info['unstarted']} never started there generated again",
          file=sys.stderr, flush=True)
    return Carried(ids, tuple(_text(r["messages"][0]) for r in syn
                              if not r["dropped"] and r["messages"]),
                   max((r["index"] for r in syn), default=-1) + 1, kept, info["unstarted"], info,
                   tuple(held), dict(why))
