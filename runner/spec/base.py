"""The base of every spec model: unknown keys are errors, values are frozen and defaults are
validated too (runner/spec/schema.py, runner/stages.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# names become path parts (work_dir, logs, state files): no '/', no '.' or '..'
NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
