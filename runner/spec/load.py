"""Loading a spec: YAML with the safe loader only, `-o a.b=value` overrides, variants, and the
target's geometry read from its own config. `load_spec` is the one entry point: YAML and
overrides both go through it, and it re-validates the whole spec (runner/spec/schema.py).

Raises SpecError (runner/errors.py) with (field path, message) pairs. No torch.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from eagle3_runner.runner.errors import EnvVarError, SpecError, TargetConfigError
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.spec.geometry import draft_geometry
from eagle3_runner.runner.spec.messages import format_errors
from eagle3_runner.runner.drafts.families import family_evidence
from eagle3_runner.runner.spec.schema import PATH_FIELDS, Spec
from eagle3_runner.runner.spec.sections import Results
from eagle3_runner.runner.chat import KNOWN, template_family
from eagle3_runner.runner.target_config import (chat_template_source, read_chat_template,
                                                read_target_config, remote_code_problem)

MAX_YAML_NODES = 100_000  # a real spec has a few hundred; aliases count once per use


def _check_yaml_size(node, path: Path) -> None:
    """Refuse alias bombs ("billion laughs") and recursive aliases before constructing: count
    nodes as if every alias were expanded. Raises SpecError naming the file."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in active:
            raise SpecError([(str(path), "a YAML alias refers to itself (recursive anchor); "
                                         "write the value out instead")])
        active.add(id(n))
        total = 1
        if isinstance(n, yaml.SequenceNode):
            kids = n.value
        elif isinstance(n, yaml.MappingNode):
            kids = [x for kv in n.value for x in kv]
        else:
            kids = []
        for k in kids:
            total += size(k)
            if total > MAX_YAML_NODES:
                raise SpecError([(str(path), f"YAML expands to more than {MAX_YAML_NODES} values "
                                             "(nested anchors/aliases?); a spec is a few hundred. "
                                             "Write the values out instead of nesting aliases")])
        active.discard(id(n))
        sizes[id(n)] = total
        return total

    size(node)


MERGE_TAG = "tag:yaml.org,2002:merge"


def _strict_loader():
    """yaml.SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently,
    so a second `drafter:` block would quietly replace the first) and keys that are not scalars
    (`? [a, b] : c`: a list or mapping as a key names no field). The standard merge key `<<`
    works as YAML 1.1 defines it: the mapping's own keys override the merged ones."""

    class StrictSafeLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:  # merged by construct_mapping (flatten_mapping)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise yaml.constructor.ConstructorError(
                    None, None, f"a {kind} used as a mapping key; keys are field names",
                    key_node.start_mark)
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    StrictSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictSafeLoader


def _load_yaml(text: str, where) -> Any:
    """Safe-load one YAML document, refusing alias bombs and very deep nesting (SpecError
    naming `where`); YAML syntax errors propagate as yaml.YAMLError."""
    loader = _strict_loader()(text)  # a SafeLoader subclass: python tags never run
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_yaml_size(node, where)
        return loader.construct_document(node) if node is not None else None
    except RecursionError:
        raise SpecError([(str(where), "YAML nested too deeply; a spec is a few levels deep")])
    finally:
        loader.dispose()


def read_yaml(path: Path) -> dict:
    """Read YAML with the safe loader only (a !!python tag is an error and never runs).
    Duplicate keys are an error. Raises SpecError naming the file (and line)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError([(str(path), f"cannot read spec file: {e.strerror}")])
    except UnicodeDecodeError:
        raise SpecError([(str(path), "not a text file (expected a YAML spec)")])
    try:
        data = _load_yaml(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "constructor for the tag" in what:  # !!python/..., !custom: no code runs, say so
            what += " (only plain YAML values: tags other than the standard ones are refused)"
        raise SpecError([(str(path), f"not valid YAML for the safe loader: {what}{where}")])
    if data is None:
        raise SpecError([(str(path), "the spec file is empty; start from specs/smollm2-sharegpt."
                                     "yaml (see docs/spec-reference.md)")])
    if not isinstance(data, dict):
        raise SpecError([(str(path), f"the spec must be a YAML mapping (name: ..., target: ...), "
                                     f"got a {type(data).__name__}")])
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`stage.field=value` -> (dotted path, YAML-parsed value)."""
    if "=" not in item:
        raise SpecError([(item, "override must look like section.field=value")])
    key, value = item.split("=", 1)
    if not key.strip() or "" in key.strip().split("."):
        raise SpecError([(item, "override must look like section.field=value (empty field name)")])
    try:
        parsed = _load_yaml(value, item[:60]) if value != "" else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def apply_override(data: dict, dotted: str, value: Any) -> dict:
    """Set data[a][b][c] = value for dotted 'a.b.c' (creating mappings); returns data."""
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        if isinstance(node, list):
            node = node[_index(p)]
            continue
        if node.get(p) is None:
            node[p] = {}
        node = node[p]
    if isinstance(node, list):
        node[_index(parts[-1])] = value
    else:
        node[parts[-1]] = value
    return data


def _index(p: str) -> int:
    """A list index in a dotted override path: 0, 1, ... (no negative or named indices)."""
    if not p.isdigit():
        raise ValueError(p)
    return int(p)


def _rebase(p: Any, base: Path) -> Any:
    """`p` made absolute against `base` when it is a relative path after expanding `~` and
    variables (`${name}` counts as a plain name); absolute paths, `~` and `${EAGLE3_CACHE}/...`
    stay as written. Non-strings and paths with an unset variable are left for validation."""
    if not isinstance(p, str) or not p:
        return p
    try:
        expanded = expand_path(p.replace("${name}", "name"))
    except EnvVarError:
        return p  # validation names the variable
    return p if expanded.is_absolute() else os.path.abspath(base / p)


def resolve_spec_paths(data: dict, base: Path) -> dict:
    """Make the spec's relative paths (PATH_FIELDS, in the spec, in `-o` overrides and in
    variants' overrides) absolute against `base`, the spec file's folder, so that a spec runs
    the same from any current directory. The one place where spec paths are resolved; every
    reader then calls runner.files.expand_path on an absolute path. The defaults of work_dir and
    results.path are filled in first, so they too are relative to the spec. Mutates and returns
    data."""
    data.setdefault("work_dir", Spec.model_fields["work_dir"].default)
    if data.get("results") is None:
        data["results"] = {}
    if isinstance(data["results"], dict):
        data["results"].setdefault("path", Results.model_fields["path"].default)
    for dotted in PATH_FIELDS:
        node = data
        *parents, last = dotted.split(".")
        for k in parents:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            node[last] = _rebase(node[last], base)
    for v in data.get("variants") or []:
        ov = v.get("overrides") if isinstance(v, dict) else None
        if not isinstance(ov, dict):
            continue
        for k, val in list(ov.items()):
            if k in PATH_FIELDS:
                ov[k] = _rebase(val, base)
            elif isinstance(val, dict):  # a whole section, e.g. data: {source: jsonl, path: x}
                resolve_spec_paths({k: val}, base)
    return data


def _fill_target_geometry(data: dict) -> tuple[list[tuple[str, str]], dict | None]:
    """Read the target's own config (config.json or GGUF header) and merge it into data['target'].
    Returns (problems, the config or None when there is none to read).

    A declared value that disagrees with the model's config is an error."""
    tgt = data.get("target")
    if not isinstance(tgt, dict) or not isinstance(tgt.get("path"), str):
        return [], None
    try:
        cfg = read_target_config(expand_path(tgt["path"]))
    except (FileNotFoundError, EnvVarError):  # a missing target is a plan error; a variable
        return [], None                       # a validation one (Spec._path_problems)
    except OSError as e:
        return [("target.path", f"cannot read {tgt['path']}: {e.strerror or e}")], None
    except TargetConfigError as e:
        return [("target.path", str(e))], None
    problems = []
    fam, why = family_evidence(cfg)
    if tgt.get("family") is None:
        tgt["family"] = fam
    elif tgt["family"] != fam:
        problems.append(("target.family", f"declared {tgt['family']}, but the model's config "
                                          f"says {fam} ({why}). Fix the spec or point target.path "
                                          "at the intended model."))
    remote = remote_code_problem(cfg, tgt.get("trust_remote_code") is True)
    if remote:
        problems.append(("target.trust_remote_code", remote))
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
        have = cfg.get(f)
        if have is None:
            continue
        declared = tgt.get(f)
        if declared is not None and declared != have:
            problems.append((f"target.{f}", f"declared {declared}, but the model's config says "
                                            f"{have}. Fix the spec or point target.path at the "
                                            "intended model."))
        elif declared is None:
            tgt[f] = have
    return problems, cfg


def _check_chat_template(data: dict) -> list[tuple[str, str]]:
    """A regenerate stage renders prompts with the target's chat template: one must exist
    (tokenizer_config.json / chat_template.jinja, or the GGUF header's tokenizer.chat_template,
    read without loading the model). A target.chat_template named in runner/chat.py KNOWN must
    mark assistant turns as the target's own template does (runner/chat.py template_family: the
    stages would find no assistant turn and stop after loading the target). Unknown (no target
    files, a template no KNOWN name matches) is not an error here."""
    tgt, stages = data.get("target"), data.get("stages")
    if not (isinstance(tgt, dict) and isinstance(tgt.get("path"), str)):
        return []
    try:
        text, where = chat_template_source(expand_path(tgt["path"]))
    except (SpecError, EnvVarError, OSError):  # a bad target.path: the path checks report it
        return []
    named, found = tgt.get("chat_template"), template_family(text)
    if isinstance(named, str) and named in KNOWN and found and KNOWN[found] != KNOWN[named]:
        return [("target.chat_template", f"{named!r} marks assistant turns with "
                 f"{KNOWN[named][0]!r}, but the target's own template ({where}) uses {found}'s "
                 f"{KNOWN[found][0]!r}: no assistant turn would be found. Set "
                 f"target.chat_template: {found} (or auto).")]
    if not (isinstance(stages, dict) and stages.get("regenerate") is not None):
        return []
    try:
        has = read_chat_template(expand_path(tgt["path"]))
    except (SpecError, EnvVarError, OSError):
        return []
    if has is False:
        return [("target.chat_template", f"the target at {tgt['path']} has no chat template "
                 "(tokenizer_config.json, chat_template.jinja or the GGUF header's "
                 "tokenizer.chat_template); stages.regenerate needs one. Use an instruct "
                 "model, or add a chat_template to its tokenizer_config.json.")]
    return []


def load_spec(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None,
              check_target: bool = True) -> Spec:
    """Load, override and validate a spec. YAML and `-o a.b=value` overrides go through this one
    function, which re-validates the whole spec. A spec read from `path` has its relative paths
    made absolute against the file's folder (resolve_spec_paths); with `data` alone they stay
    relative to the current directory.

    Raises SpecError with (field path, message) pairs."""
    if data is None:
        data = read_yaml(Path(path))
    data = copy.deepcopy(data)
    for item in overrides:
        k, v = parse_override(item)
        try:
            apply_override(data, k, v)
        except (KeyError, IndexError, ValueError, TypeError, AttributeError):
            raise SpecError([(k, "override path does not exist in the spec")])
    if path is not None:  # relative paths (overrides included) are relative to the spec file
        resolve_spec_paths(data, Path(os.path.abspath(path)).parent)
    problems, cfg = _fill_target_geometry(data) if check_target else ([], None)
    if check_target:
        problems += _check_chat_template(data)
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems + format_errors(e, data))
    if problems:
        raise SpecError(problems)
    problems = _geometry_problems(spec, cfg, "")
    for v in spec.variants:
        for k in v.overrides:
            if k.split(".")[0] in ("name", "work_dir", "results", "variants", "executor"):
                raise SpecError([(f"variants.{v.name}.overrides.{k}", "variants may not change "
                                  "name, work_dir, results, executor or variants")])
        vspec = variant_spec(spec, v.name, data)
        problems += [p for p in _geometry_problems(vspec, cfg, f"variants.{v.name}: ")
                     if p[1] not in {m for _, m in problems}]
    if problems:
        raise SpecError(problems)
    return spec


def _geometry_problems(spec: Spec, cfg: dict | None, prefix: str) -> list[tuple[str, str]]:
    """The drafter geometry's problems against the target's config (runner/spec/geometry.py)."""
    _, problems = draft_geometry(spec.drafter, cfg, spec.target.hidden_size)
    return [(prefix + f, m) for f, m in problems]


def variant_spec(spec: Spec, name: str, raw: dict | None = None) -> Spec:
    """The spec with variant `name`'s overrides applied (re-validated)."""
    v = next(v for v in spec.variants if v.name == name)
    data = copy.deepcopy(spec.model_dump(mode="json") if raw is None else raw)
    data["variants"] = []
    for k, val in v.overrides.items():
        try:
            apply_override(data, k, val)
        except (KeyError, IndexError, ValueError, TypeError, AttributeError):
            raise SpecError([(f"variants.{name}.overrides.{k}", "path does not exist")])
    try:
        out = Spec.model_validate(data)
    except ValidationError as e:
        raise SpecError([(f"variants.{name}", m) if m.startswith(p) else
                         (f"variants.{name}: {p}", m) for p, m in format_errors(e, data)])
    return out.model_copy(update={"variants": spec.variants})
