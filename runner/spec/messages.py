"""Pydantic validation errors -> (field path, message) pairs a user can act on: unknown keys with
"did you mean", misspelt names of a fixed set (Literal) with "did you mean", missing fields with their description, the executor's kind, and the cross-field
rules' own `field: message` lines (runner/spec/schema.py)."""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from eagle3_runner.runner.spec.schema import Spec


def _model_at(loc: tuple) -> Any:
    """The Pydantic model that holds the last key of `loc` (a raw pydantic error location, union
    tags such as 'slurm' included), or None. List indices and dict keys keep the current model."""
    models: list[Any] = [Spec]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        owner = next((m for m in models if part in m.model_fields), None)
        if owner is not None:
            models = _models_in(owner.model_fields[part].annotation) or models
            continue
        tagged = [m for m in models if "kind" in m.model_fields
                  and m.model_fields["kind"].default == part]  # discriminated union tag
        if tagged:
            models = tagged
    return models[0] if len(models) == 1 else None


def _did_you_mean(loc: tuple, key: str) -> str:
    """Suggest the closest field name of the model at `loc` (raw pydantic error location)."""
    model = _model_at(loc)
    names = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if close:
        return f" Did you mean '{close[0]}'?"
    return f" Known keys: {', '.join(names)}." if names else ""


def _models_in(ann: Any) -> list[Any]:
    """Every Pydantic model class inside a (possibly Optional/Union/list/dict) annotation."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in _models_in(a)]


def format_errors(err: ValidationError, data: dict) -> list[tuple[str, str]]:
    """The (field path, message) pairs of a ValidationError of `data` (a raw spec dict)."""
    problems = []
    for e in err.errors():
        raw = tuple(e["loc"])
        loc = tuple(x for x in raw if x not in ("local", "slurm"))
        path = ".".join(str(x) for x in loc) or "<spec>"
        if e["type"] == "extra_forbidden":
            key = str(loc[-1])
            problems.append((path, f"unknown key.{_did_you_mean(raw, key)}"))
            continue
        if e["type"] == "missing":
            model = _model_at(raw)
            info = model.model_fields.get(str(raw[-1])) if model is not None else None
            why = f" {info.description}" if info is not None and info.description else ""
            problems.append((path, f"required field is missing.{why}"))
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("union_tag_not_found", "union_tag_invalid"):  # the executor's kind
            problems.append((f"{path}.kind", "set it to 'local' or 'slurm' (e.g. -o "
                             f"{path}.kind=local); the other {path} fields depend on it"))
            continue
        if e["type"] in ("string_pattern_mismatch", "string_too_long"):  # say the rule in words, not only the regex
            model = _model_at(raw)
            info = model.model_fields.get(str(raw[-1])) if model is not None else None
            if info is not None and info.description:
                msg = f"{msg}. {info.description}"
        if e["type"] == "value_error":
            for line in msg.split("\n"):
                field, _, rest = line.partition(": ")
                field = field.split(" = ")[0].strip()
                full = field if "." in field or not loc else f"{path}.{field}" if path != "<spec>" else field
                problems.append((full, line))
            continue
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {_short_repr(value)})"
        if e["type"] == "model_type":  # pydantic's "valid dictionary or instance of Stages"
            owner = _model_at(raw)
            info = owner.model_fields.get(str(raw[-1])) if owner is not None else None
            inner = _models_in(info.annotation) if info is not None else []
            keys = f": {', '.join(inner[0].model_fields)}" if len(inner) == 1 else ""
            problems.append((path, f"should be a mapping of its fields{keys}{shown}"))
            continue
        if e["type"] == "literal_error" and isinstance(value, str):  # a misspelt name
            close = difflib.get_close_matches(value, re.findall(r"'([^']*)'", msg), n=1,
                                              cutoff=0.5)
            shown += f". Did you mean '{close[0]}'?" if close else ""
        problems.append((path, f"{msg}{shown}"))
    return problems


def _short_repr(value: Any, limit: int = 120) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"
