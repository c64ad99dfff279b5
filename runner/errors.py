"""Every error the runner reports to a user: one hierarchy, caught by type in runner/cli.py.

A `RunnerError` carries a message that names the field or file and the fix; the CLI prints it as
`error: <message>` (a SpecError as one `error: <field>: <message>` line per problem) and exits 1,
without a traceback. Anything else is a bug and keeps its traceback. This module imports only
the standard library, so any module may raise these; `exit_code` is how every command of ours
(the CLI, the scripts under scripts/) ends.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class RunnerError(Exception):
    """A failure the user can fix; the message says how."""


def problem_line(path: str, msg: str) -> str:
    """One spec problem as a line: `<field>: <message>`, or the message alone when it already
    starts with its field (a validator's own 'stages.train.select: ...')."""
    return msg if msg.startswith(path) else f"{path}: {msg}"


class SpecError(RunnerError):
    """A spec that cannot run. `problems` is a list of (field_path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(problem_line(p, m) for p, m in problems))


class PlanError(RunnerError):
    """The plan cannot be built (unknown stage or variant, an output path in the way)."""


class StageError(RunnerError):
    """A user-facing failure of a stage: the message names the field or file and the fix.
    The runner prints it without a traceback."""


class ServerError(StageError):
    """An SGLang server did not become ready, or died or failed a request (targets/sglang.py);
    the message names the server and ends with its log tail, `log_tail` holds the tail alone."""

    def __init__(self, message: str, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(message)


class StoreError(RunnerError):
    """The DuckDB results store cannot be written or queried as asked."""


class FetchError(RunnerError):
    """An asset (`runner fetch`) is missing, cannot be downloaded or fails its sha256."""


class InspectError(RunnerError):
    """The inspector itself cannot run (e.g. a safetensors header is corrupt)."""


class ConvertError(RunnerError):
    """A draft cannot be converted safely (`runner convert`); the message says why."""


class UnsupportedDraftError(RunnerError):
    """A drafter whose config selects a forward the embedded engine does not implement (it would
    not compute what SGLang computes, so its tau would not be SGLang's)."""


class SlurmError(RunnerError):
    """A Slurm problem the user can fix (no sbatch, unknown partition, a rejected job)."""


class TargetConfigError(RunnerError):
    """The target path exists but its config cannot be read."""


class ReportError(RunnerError):
    """No report can be drawn (no results file, no bench rows); the message says what to run."""


class EnvVarError(RunnerError):
    """A spec path names an environment variable that is not set (or a malformed `${...}`);
    `name` is the variable."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


class InitError(RunnerError):
    """`runner init` cannot write a spec (unreadable target or data, an existing output)."""


def exit_code(fn: Callable[..., object], *args) -> int:
    """Run fn(*args) as a command's body and return the process exit status: fn's own when it
    returns an int, else 0; 1 after a RunnerError, printed as `error: <message>` on stderr (a
    SpecError as one `error: <field>: <message>` line per problem), no traceback; 130 on Ctrl-C
    ("interrupted"); 141 when the reader of stdout went away (`runner plan --json | head -1`).
    Any other exception is a bug and propagates with its traceback."""
    try:
        rc = fn(*args)
        return rc if isinstance(rc, int) else 0
    except SpecError as e:
        for path, msg in e.problems:
            print(f"error: {problem_line(path, msg)}", file=sys.stderr)
        return 1
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left; nothing to say
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141
