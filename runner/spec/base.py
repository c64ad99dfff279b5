"""The base of every spec model: unknown keys are errors, values are frozen and defaults are
validated too, and no value is coerced silently into a wrong one (runner/spec/sections.py,
runner/spec/stage_blocks.py, runner/spec/schema.py, runner/stages.py)."""

from __future__ import annotations

import math
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# names become path parts (work_dir, logs, state files): no '/', no '.' or '..'
NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
# a run's log file is <name>-<date>-<hex>.<stage>@<variant>.log: 100 + 21 + 1 + 10 + 1 + 64 + 4
# characters stay under the 255 bytes a file name may have
MAX_NAME = 100
MAX_VARIANT_NAME = 64
MAX_INT = 2 ** 63 - 1  # what DuckDB, torch and JSON readers hold


def _scalars(ann: Any) -> tuple[set, set]:
    """(scalar types a field takes, scalar types its list items take) of an annotation."""
    own, items = set(), set()
    for a in (typing.get_args(ann) if typing.get_origin(ann) is typing.Union else (ann,)):
        if typing.get_origin(a) is list:
            items |= _scalars(typing.get_args(a)[0])[0] if typing.get_args(a) else set()
        elif a in (int, float, bool, str):
            own.add(a)
        elif getattr(a, "__origin__", None) is None and getattr(a, "__supertype__", None) is None:
            own |= {t for t in (int, float, bool) if isinstance(a, type) and issubclass(a, t)}
    return own, items


def _coercion_problem(v: Any, kinds: set) -> str | None:
    """Why value `v` would be read wrong by a field of these scalar types, or None: an empty
    string or one holding a NUL character, a boolean where a number is wanted (YAML 1.1 reads
    yes/no/on/off as booleans), NaN or infinity, an integer too large for the stores that keep
    it."""
    numeric = kinds & {int, float}
    if str in kinds and isinstance(v, str) and not v.strip():
        return "empty; give a value, or leave the field out for its default"
    if str in kinds and isinstance(v, str) and "\0" in v:  # the OS refuses it in every path
        return "holds a NUL character (\\0), which no path, name or argument can hold; remove it"
    if not numeric:
        return None
    if isinstance(v, bool):
        return None if bool in kinds else (f"expected a number, got {v} (YAML reads "
                                           "true/false/yes/no/on/off as booleans)")
    if isinstance(v, (int, float, str)) and float in kinds:
        try:
            if not math.isfinite(float(v)):
                return f"expected a finite number, got {v!r}"
        except (ValueError, OverflowError):
            return None  # not a number at all: Pydantic says so
    if isinstance(v, int) and abs(v) > MAX_INT:
        return f"{v} is too large (at most {MAX_INT})"
    return None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _no_silent_coercion(cls, data: Any) -> Any:
        """Refuse empty strings, booleans for numbers, NaN/infinity and over-large integers,
        which Pydantic's lax mode would accept (`epochs: yes` would train 1 epoch)."""
        if not isinstance(data, dict):
            return data
        problems = []
        for name, value in data.items():
            info = cls.model_fields.get(name) if isinstance(name, str) else None
            if info is None:
                continue
            own, items = _scalars(info.annotation)
            values = [(value, own)] if not isinstance(value, list) else \
                [(x, items) for x in value]
            for x, kinds in values:
                why = _coercion_problem(x, kinds)
                if why:
                    problems.append(f"{name} = {value!r}: {why}")
                    break
        if problems:
            raise ValueError("\n".join(problems))
        return data
