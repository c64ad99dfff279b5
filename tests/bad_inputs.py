"""A generator of bad inputs: malformed specs (every field of the schema, walked from the
Pydantic models, so a new field is covered without editing this file), YAML oddities, bad
`-o` overrides, names, paths and environment variables; and malformed data files.

A case is plain data. `check_spec_case` runs one through `load_spec` and `build_plan` (pure
calls, milliseconds) and returns what went wrong, or None when the case got a clear error (every
problem one line, naming a field or file, the one the case is about among them) or a correct
result (accepted, and the value read is the value written). tests/test_bad_inputs.py runs every
case in CI; `python tests/bad_inputs.py` prints the counts per class.
"""

from __future__ import annotations

import copy
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel

from eagle3_runner.runner.errors import RunnerError, SpecError
from eagle3_runner.runner.plan import build_plan
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.spec.schema import Spec

MISSING = object()


@dataclass(frozen=True)
class Case:
    """One bad input. kind: "data" (a spec dict), "yaml" (spec file text or bytes), "override"
    (a valid spec plus `-o` items). `field`: what the error must name (a dotted field, or a
    substring of the message for file-level problems). `accept`: when not None the input may
    also be accepted, and then accept(spec) must be true (the value read is the one meant)."""

    cls: str
    id: str
    kind: str
    payload: Any
    field: str
    accept: Callable[[Spec], bool] | None = None
    overrides: tuple[str, ...] = ()
    files: dict = field(default_factory=dict, compare=False)  # name -> bytes, written first


# ----------------------------------------------------------------------------------------------
# the valid base


def base_files(tmp: Path) -> dict:
    """A target folder (config.json shaped like SmolLM2-135M, no weights) and a data file."""
    (tmp / "hf").mkdir(exist_ok=True)
    (tmp / "hf" / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
        "max_position_embeddings": 8192}))
    (tmp / "data.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}, '
                                    '{"from": "gpt", "value": "hello"}]}\n')
    return {"target": str(tmp / "hf"), "data": str(tmp / "data.jsonl")}


def base_spec(tmp: Path, executor: str = "local") -> dict:
    """A valid spec with every section and stage block present (so every field is reachable)."""
    f = base_files(tmp)
    ex = {"kind": "local"} if executor == "local" else {
        "kind": "slurm", "partition": "gpu", "account": "a", "qos": "q", "constraint": "c",
        "log_dir": str(tmp / "slurm"), "stages": {"train": {"gpus_per_node": 1}},
        "extra_sbatch": {"comment": "x"}}
    return {
        "name": "bad", "work_dir": str(tmp / "work" / "${name}"),
        "target": {"path": f["target"], "sglang": {"extra_args": ["--log-level", "info"]}},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
        "data": {"source": "jsonl", "path": f["data"], "max_samples": 10},
        "stages": {"regenerate": {}, "extract": {}, "train": {"num_samples": None},
                   "export": {}, "bench": {"configs": [{"num_steps": 3}],
                                           "sglang": {"extra_args": ["--log-level", "info"]}}},
        "executor": ex, "results": {"path": str(tmp / "r.duckdb")},
        "variants": [{"name": "v1", "overrides": {"stages.train.lr": 1e-3}}]}


# ----------------------------------------------------------------------------------------------
# walking the schema


def _models(ann) -> list[type]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in _models(a)]


def _scalar_kinds(ann) -> set:
    if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return set().union(*(_scalar_kinds(a) for a in typing.get_args(ann)))
    if typing.get_origin(ann) is typing.Literal:
        return {"literal"}
    if typing.get_origin(ann) is list:
        return {"list"}
    if typing.get_origin(ann) is dict:
        return {"dict"}
    if ann is type(None):
        return {"none"}
    return {ann} if ann in (int, float, bool, str) else set()


def leaf_fields(model: type, data: dict, prefix: str = ""):
    """(dotted path, FieldInfo, annotation) of every scalar/list/dict field of `model` present
    in (or defaulted under) the valid `data`; nested models are walked (list items at index 0,
    the executor through its own kind)."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        value = data.get(name, MISSING) if isinstance(data, dict) else MISSING
        subs = _models(info.annotation)
        if typing.get_origin(info.annotation) is dict and subs:  # executor.stages: {train: ...}
            if isinstance(value, dict):
                for k, v in value.items():
                    yield from leaf_fields(subs[0], v, f"{path}.{k}.")
            continue
        if subs and typing.get_origin(info.annotation) is list:
            if isinstance(value, list) and value:
                yield from leaf_fields(subs[0], value[0], f"{path}.0.")
            continue
        if subs:
            if isinstance(value, dict):
                kind = value.get("kind")
                sub = next((m for m in subs if "kind" in m.model_fields
                            and m.model_fields["kind"].default == kind), subs[0])
                yield from leaf_fields(sub, value, f"{path}.")
            continue
        yield path, info, info.annotation


def _bounds(info) -> dict:
    out = {}
    for m in info.metadata:
        for k in ("ge", "gt", "le", "lt"):
            if getattr(m, k, None) is not None:
                out[k] = getattr(m, k)
    return out


def get_path(spec: Any, dotted: str) -> Any:
    node = spec
    for k in dotted.split("."):
        node = node[int(k)] if k.isdigit() else (
            node[k] if isinstance(node, dict) else getattr(node, k))
    return node


def _set(data: dict, dotted: str, value: Any) -> dict:
    d = copy.deepcopy(data)
    node = d
    *parents, last = dotted.split(".")
    for k in parents:
        node = node[int(k)] if k.isdigit() else node.setdefault(k, {})
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    return d


def _equals(dotted: str, want: Any) -> Callable[[Spec], bool]:
    def ok(spec: Spec) -> bool:
        got = get_path(spec, dotted)
        if isinstance(want, float) and isinstance(got, (int, float)):
            return math.isclose(got, want)
        return got == want
    return ok


def field_cases(base: dict, cls: str = "schema") -> list[Case]:
    """For every leaf field: wrong types, out-of-range numbers, NaN/inf/huge, booleans for
    numbers, null for required fields, an unknown sibling key."""
    out = []
    for path, info, ann in leaf_fields(Spec, base):
        kinds = _scalar_kinds(ann)
        optional = "none" in kinds
        data = lambda v: _set(base, path, v)  # noqa: E731

        want = "variants" if path.startswith("variants.0.") else path  # named by variant name

        def add(tag, value, accept=None):
            out.append(Case(f"{cls}:{tag}", f"{path}={tag}", "data", data(value), want, accept))

        out.append(Case(f"{cls}:unknown_key", f"{path}_typo", "data",
                        _set(base, path + "_typo", 1), path + "_typo"))
        add("null", None, (lambda spec: True) if optional else None)  # null = the documented
        # default of an optional field (read from the target, derived, or none)
        add("dict", {"nested": 1})
        if "list" not in kinds:
            add("list", [1, 2])
        if kinds & {int, float}:
            add("string", "not-a-number")
            add("bool", True, _equals(path, True) if bool in kinds else None)
            add("nan", float("nan"))
            add("inf", float("inf"))
            add("huge", 10 ** 30)
            if int in kinds and float not in kinds:
                add("fraction", 2.5)
            b = _bounds(info)
            for k, v in b.items():
                step = 1 if int in kinds and float not in kinds else 1e-9
                bad = {"ge": v - step, "gt": v, "le": v + step, "lt": v}[k]
                add(f"{k}_violated", bad)
            if not b:  # unbounded numbers: a negative one is read as written, or refused
                add("negative", -1, _equals(path, -1))
        if str in kinds:
            add("int", 12345)
            add("empty", "")
            add("blank", "  ")
            add("nul", "x\0y")
        if "literal" in kinds:
            add("bogus_choice", "bogus-choice")
        if bool in kinds and not kinds & {int, float}:
            add("word", "maybe")
            add("two", 2)
        if "list" in kinds:
            add("scalar", "x")
            add("wrong_items", [{"a": 1}])
        if "dict" in kinds:
            add("scalar_not_dict", "x")
    return out


# ----------------------------------------------------------------------------------------------
# hand-written classes: names, paths, environment variables, YAML, overrides


def name_cases(base: dict) -> list[Case]:
    bad = ["", "../up", ".hidden", "a/b", "a b", "ü", "a" * 101, "a\nb", "a$b", "a" * 300, "..",
           "a:b", "a*b"]
    out = [Case("names", f"name={n[:12]!r}", "data", _set(base, "name", n), "name") for n in bad]
    for n in ["", "base", "a/b", "v" * 65, ".x"]:
        out.append(Case("names", f"variant={n[:12]!r}", "data",
                        _set(base, "variants", [{"name": n, "overrides": {"data.seed": 1}}]),
                        "variants"))
    out.append(Case("names", "variant-duplicate", "data", _set(base, "variants", [
        {"name": "a", "overrides": {"data.seed": 1}}, {"name": "a", "overrides": {}}]),
        "variants"))
    for k in ("name", "work_dir", "results.path", "executor.kind", "variants"):
        out.append(Case("names", f"variant-changes-{k}", "data", _set(base, "variants", [
            {"name": "a", "overrides": {k: "x"}}]), "variants.a.overrides"))
    out.append(Case("names", "variant-path-missing", "data", _set(base, "variants", [
        {"name": "a", "overrides": {"stages.nope.lr": 1}}]), "variants.a"))
    return out


def path_cases(base: dict, tmp: Path) -> list[Case]:
    os.environ.pop("EAGLE3_BAD_UNSET", None)
    out = []
    for fld in ("work_dir", "results.path", "data.path", "target.path"):
        for tag, v in (("unset_braced", "/x/${EAGLE3_BAD_UNSET}/y"),
                       ("unset_plain", "/x/$EAGLE3_BAD_UNSET"),
                       ("unclosed", "/x/${HOME"), ("not_a_name", "/x/${1x}"),
                       ("empty", ""), ("long_part", str(tmp / ("p" * 300))),
                       ("nul_byte", str(tmp / "a\0b"))):
            out.append(Case("paths", f"{fld}={tag}", "data", _set(base, fld, v), fld))
    (tmp / "a_file").write_text("x")
    (tmp / "not-duck.duckdb").write_text("hello, not a database\n" * 3)
    (tmp / "empty.duckdb").write_bytes(b"")
    (tmp / "rnd.gguf").write_bytes(os.urandom(256))
    (tmp / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 12)
    (tmp / "badcfg").mkdir(exist_ok=True)
    (tmp / "badcfg" / "config.json").write_text("{not json")
    (tmp / "listcfg").mkdir(exist_ok=True)
    (tmp / "listcfg" / "config.json").write_text("[1, 2]")
    (tmp / "emptydir").mkdir(exist_ok=True)
    (tmp / "binfolder").mkdir(exist_ok=True)  # a folder whose config.json is not text
    (tmp / "binfolder" / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    _truncated_duckdb(tmp / "cut.duckdb")
    (tmp / "two_ggufs").mkdir(exist_ok=True)  # two real headers: which one is the target?
    for q in ("Q4_1", "Q8_0"):
        _tiny_gguf(tmp / "two_ggufs" / f"model.{q}.gguf")
    for fld, tag, v in (
            ("work_dir", "under_a_file", str(tmp / "a_file" / "w")),
            ("results.path", "a_folder", str(tmp)),
            ("results.path", "not_duckdb", str(tmp / "not-duck.duckdb")),
            ("results.path", "empty_file", str(tmp / "empty.duckdb")),
            ("results.path", "under_a_file", str(tmp / "a_file" / "r.duckdb")),
            ("results.path", "truncated_duckdb", str(tmp / "cut.duckdb")),
            ("data.path", "missing", str(tmp / "missing.jsonl")),
            ("target.path", "missing", str(tmp / "missing.gguf")),
            ("target.path", "random_bytes", str(tmp / "rnd.gguf")),
            ("target.path", "truncated_gguf", str(tmp / "trunc.gguf")),
            ("target.path", "bad_json_config", str(tmp / "badcfg")),
            ("target.path", "list_config", str(tmp / "listcfg")),
            ("target.path", "folder_without_config", str(tmp / "emptydir")),
            ("target.path", "unknown_suffix", str(tmp / "a_file")),
            ("target.path", "two_ggufs_in_a_folder", str(tmp / "two_ggufs")),
            ("target.path", "binary_config", str(tmp / "binfolder")),
            ("data.path", "a_folder", str(tmp / "binfolder"))):
        out.append(Case("paths", f"{fld}={tag}", "data", _set(base, fld, v), fld))
    return out


def _tiny_gguf(path: Path) -> None:
    """A GGUF file holding only the header keys of a llama target shaped like SmolLM2-135M
    (written with the `gguf` package's own writer; no tensors)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 30), ("embedding_length", 576), ("vocab_size", 49152),
                 ("feed_forward_length", 1536), ("attention.head_count", 9),
                 ("attention.head_count_kv", 3), ("context_length", 8192)):
        w.add_uint32(f"llama.{k}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _truncated_duckdb(path: Path) -> None:
    """A real results file cut to 300,000 bytes (its header whole, its last pages gone), as a
    full disk or an interrupted copy leaves it."""
    from eagle3_runner.runner.store import Store
    whole = path.with_name(path.name + ".whole")
    if not whole.exists():
        store = Store(whole)
        store.emit("runs", {"run_id": "r", "status": "done"})
        store.ingest()
    path.write_bytes(whole.read_bytes()[:300_000])


YAML_CASES = {  # text -> what the error names (the file, or a field)
    "tabs": ("name: x\ntarget:\n\tpath: /m\n", "spec.yaml"),
    "duplicate_key": ("name: x\nname: y\n", "spec.yaml"),
    "python_tag": ("name: !!python/object/apply:os.system ['true']\n", "spec.yaml"),
    "list_root": ("- a\n- b\n", "spec.yaml"),
    "scalar_root": ("just a string\n", "spec.yaml"),
    "empty": ("", "spec.yaml"),
    "comments_only": ("# nothing\n", "spec.yaml"),
    "two_documents": ("name: x\n---\nname: y\n", "spec.yaml"),
    "unclosed_bracket": ("name: [x\n", "spec.yaml"),
    "alias_bomb": ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, "
                   "*a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, "
                   "*c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
                   "f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n", "spec.yaml"),
    "deep_nesting": ("a: " + "[" * 2000 + "]" * 2000 + "\n", "spec.yaml"),
    "yes_for_a_number": (None, "stages.train.epochs"),  # filled from the base below
    "string_for_a_section": ("name: x\ntarget: /m\ndrafter: {draft_vocab_size: 1}\n", "target"),
    "missing_required": ("name: x\n", "target"),
    "complex_key": ("name: x\n? [a, b]\n: c\n", "spec.yaml"),
    "complex_key_flow": ("{? {a: 1} : 2}\n", "spec.yaml"),
    "local_tag": ("name: !custom x\n", "spec.yaml"),
}


def yaml_cases(base: dict) -> list[Case]:
    out = []
    for tag, (text, what) in YAML_CASES.items():
        if text is None:
            text = yaml.safe_dump(base).replace("num_samples: null", "num_samples: null\n"
                                                "    epochs: yes")
        out.append(Case("yaml", tag, "yaml", text, what))
    for tag, raw in (("binary", b"\x00\x01\x02\xff" * 10), ("latin1", b"name: caf\xe9\n"),
                     ("nul_byte", b"name: a\x00b\n"), ("utf16", "name: x\n".encode("utf-16"))):
        out.append(Case("yaml", tag, "yaml", raw, "spec.yaml"))
    out.append(Case("yaml", "bom", "yaml", ("\ufeff" + yaml.safe_dump(base)).encode(), "",
                    accept=lambda s: s.name == "bad"))
    # the standard merge key: merged values, the mapping's own keys winning (YAML 1.1)
    rest = {k: v for k, v in base.items() if k != "drafter"}
    merged = yaml.safe_dump(rest) + ("drafter:\n  <<: {aux_layer_ids: [1, 14, 26], "
                                     "draft_vocab_size: 4096}\n  draft_vocab_size: 2048\n")
    out.append(Case("yaml", "merge_key", "yaml", merged, "", accept=lambda s: (
        s.drafter.draft_vocab_size == 2048 and list(s.aux_ids) == [1, 14, 26])))
    return out


OVERRIDES = [
    ("no_equals", "stages.train.lr", "stages.train.lr"),
    ("empty_key", "=1", "=1"),
    ("empty_part", "stages..lr=1", "stages..lr=1"),
    ("unknown_section", "nope.x=1", "nope"),
    ("unknown_field", "stages.train.lrr=1", "stages.train.lrr"),
    ("bad_yaml_value", "stages.train.lr=[", "stages.train.lr"),
    ("index_out_of_range", "stages.bench.configs.5.num_steps=2", "stages.bench.configs.5"),
    ("index_not_a_number", "stages.bench.configs.x.num_steps=2", "stages.bench.configs.x"),
    ("into_a_scalar", "name.x=1", "name.x"),
    ("nan", "stages.train.lr=.nan", "stages.train.lr"),
    ("bool", "stages.train.batch_size=on", "stages.train.batch_size"),
    ("section_to_scalar", "drafter=3", "drafter"),
]


def override_cases(base: dict) -> list[Case]:
    return [Case("overrides", tag, "override", base, what, overrides=(item,))
            for tag, item, what in OVERRIDES]


def stage_cases(base: dict) -> list[Case]:
    """Specs whose stages cannot run as written: a stage without the upstream it reads, ports
    past 65535, a bench backend this machine does not have."""
    stages = base["stages"]
    no = lambda *names: _set(base, "stages", {k: v for k, v in stages.items()  # noqa: E731
                                              if k not in names})
    return [
        Case("stages", "bench_without_export", "data", no("export"), "stages.bench"),
        Case("stages", "export_without_train", "data", no("train", "bench"), "stages.export"),
        Case("stages", "sglang_port_past_65535", "data", _set(_set(
            base, "stages.bench.sglang.port", 65000), "stages.bench.sglang.parallel", 300),
             "stages.bench.sglang.port"),
        # SGLang 0.5.14 takes --port + 10000 as its gRPC port and refuses one past 65535
        Case("stages", "sglang_port_whose_grpc_port_is_past_65535", "data", _set(
            base, "stages.bench.sglang.port", 60000), "stages.bench.sglang.port"),
        Case("stages", "sglang_not_importable", "data", _set(_set(
            base, "stages.bench.backend", "sglang"), "stages.bench.sglang.python",
            "/nonexistent/python3"), "stages.bench.backend"),
    ]


def spec_cases(tmp: Path) -> list[Case]:
    """Every spec case, for the base spec under `tmp` (files are created there)."""
    base = base_spec(tmp)
    slurm = base_spec(tmp, "slurm")
    return (field_cases(base) + [c for c in field_cases(slurm, "schema-slurm")
                                 if c.field.startswith("executor.")]
            + name_cases(base) + path_cases(base, tmp) + yaml_cases(base)
            + override_cases(base) + stage_cases(base))


# ----------------------------------------------------------------------------------------------
# running a case


def _names(problem_field: str, msg: str, want: str) -> bool:
    return problem_field == want or problem_field.startswith(want + ".") or \
        want.startswith(problem_field + ".") or want in msg or (want and want in problem_field)


def check_spec_case(case: Case, tmp: Path) -> str | None:
    """None when the case got a clear error naming case.field, or a correct result; else what
    went wrong (a traceback-worthy exception, an error that names nothing, a silent accept)."""
    try:
        if case.kind == "yaml":
            path = tmp / "spec.yaml"
            raw = case.payload if isinstance(case.payload, bytes) else case.payload.encode()
            path.write_bytes(raw)
            spec = load_spec(path)
        else:
            spec = load_spec(data=case.payload, overrides=list(case.overrides))
        build_plan(spec)
    except SpecError as e:
        lines = e.problems
        bad = [f"{f}: {m}" for f, m in lines if not f or not m or "\n" in m or len(m) > 800]
        if bad:
            return f"unclear problem lines: {bad[:2]}"
        if not any(_names(f, m, case.field) for f, m in lines):
            return f"no problem names {case.field!r}: {lines[:3]}"
        return None
    except RunnerError as e:
        msg = str(e)
        if "\n" in msg or not msg:
            return f"not one line: {msg!r}"
        if case.field and case.field not in msg:
            return f"error does not name {case.field!r}: {msg}"
        return None
    except Exception as e:  # noqa: BLE001 - a user would see a traceback
        return f"{type(e).__name__} (a traceback for the user): {e}"
    if case.accept is None:
        return "accepted silently"
    try:
        ok = case.accept(spec)
    except Exception as e:  # noqa: BLE001
        return f"accepted, and the value cannot be read back ({type(e).__name__}: {e})"
    return None if ok else "accepted with another value than written"


# ----------------------------------------------------------------------------------------------
# data files


@dataclass(frozen=True)
class DataCase:
    """A data file of `total` records of which `good` are usable (by the project's rules)."""

    id: str
    raw: bytes
    total: int
    good: int


def _rec(i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"question {i}"},
                              {"from": "gpt", "value": f"answer {i}"}]}


# valid JSON nested deeper than Python's parser goes (a RecursionError, not a JSONDecodeError)
DEEP = '{"conversations": ' + "[" * 100_000 + "]" * 100_000 + "}"


def data_cases() -> list[DataCase]:
    """Malformed records, truncated arrays, wrong encodings, wrong shapes."""
    good = [json.dumps(_rec(i)) for i in range(40)]
    jsonl = lambda lines: ("\n".join(lines) + "\n").encode()  # noqa: E731
    arr = lambda items: ("[" + ",\n".join(items) + "]").encode()  # noqa: E731
    out = [
        DataCase("array_one_malformed_record", arr(good[:20] + ['{"conversations": [}']
                                                   + good[20:39]), 40, 39),
        DataCase("array_truncated", arr(good)[:-40], 40, 39),
        DataCase("jsonl_one_malformed_line", jsonl(good[:20] + ["{oops"] + good[20:39]), 40, 39),
        DataCase("jsonl_truncated_last_line", jsonl(good)[:-30], 40, 39),
        DataCase("latin1_record", jsonl(good[:39]) + json.dumps(_rec(99)).replace(
            "answer 99", "caf\\u00e9").encode().replace(b"caf\\u00e9", b"caf\xe9") + b"\n",
            40, 39),
        DataCase("nul_bytes", jsonl(good[:39]) + b'{"conversations": \x00}\n', 40, 39),
        DataCase("record_not_an_object", jsonl(good[:39] + ["42"]), 40, 39),
        DataCase("turns_not_a_list", jsonl(good[:39] + ['{"conversations": "hi"}']), 40, 39),
        DataCase("turn_missing_value", jsonl(good[:39] + ['{"conversations": [{"from": "human"}'
                                                          ', {"from": "gpt"}]}']), 40, 39),
        DataCase("value_not_a_string", jsonl(good[:39] + ['{"conversations": [{"from": "human",'
                                                          ' "value": 3}, {"from": "gpt", '
                                                          '"value": [1]}]}']), 40, 39),
        DataCase("no_assistant_turn", jsonl(good[:39] + ['{"conversations": [{"from": "human", '
                                                         '"value": "hi"}]}']), 40, 39),
        DataCase("empty_file", b"", 0, 0),
        DataCase("only_whitespace", b"\n\n  \n", 0, 0),
        DataCase("json_scalar", b"42", 1, 0),
        DataCase("json_object_root", json.dumps(_rec(0)).encode(), 1, 1),
        DataCase("utf16", jsonl(good[:5]).decode().encode("utf-16"), 5, 5),
        DataCase("binary", os.urandom(512), 1, 0),
        DataCase("jsonl_too_deep_record", jsonl(good[:20] + [DEEP] + good[20:39]), 40, 39),
        DataCase("array_too_deep_record", arr(good[:20] + [DEEP] + good[20:39]), 40, 39),
    ]
    return out


if __name__ == "__main__":
    import collections
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        cases = spec_cases(Path(d))
    print(collections.Counter(c.cls for c in cases), len(cases), "spec cases;",
          len(data_cases()), "data cases")
