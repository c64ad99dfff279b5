"""Issue 21's generator of bad inputs, run in CI: every generated spec gets a clear error (one
line per problem, naming its field or file) or a correct result, never a traceback or a silent
accept; every generated data file gets a clear error or every unusable record counted.
The cases themselves: tests/bad_inputs.py."""

import subprocess
import sys
from pathlib import Path

import pytest
from bad_inputs import check_spec_case, data_cases, spec_cases

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(their folder, the generated spec cases), made once for the module under pytest's tmp
    (never a folder of their own in /tmp, which nothing removed)."""
    d = tmp_path_factory.mktemp("bad")
    return d, spec_cases(d)


def test_the_generator_covers_the_classes(cases):
    specs = cases[1]
    classes = {c.cls.split(":")[0] for c in specs}
    assert {"schema", "schema-slurm", "names", "paths", "yaml", "overrides", "stages"} <= classes
    assert len(specs) > 500
    kinds = {c.cls for c in specs}
    for k in ("unknown_key", "null", "nan", "bool", "huge", "bogus_choice", "ge_violated"):
        assert f"schema:{k}" in kinds


def test_every_bad_spec_gets_a_clear_error_or_a_correct_result(cases):
    folder, specs = cases
    failures = []
    for case in specs:
        why = check_spec_case(case, folder)
        if why:
            failures.append(f"{case.cls} {case.id}: {why}")
    assert not failures, f"{len(failures)} of {len(specs)} cases:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("tag", ["python_tag", "alias_bomb", "binary", "deep_nesting"])
def test_bad_spec_files_through_the_cli_exit_1_without_a_traceback(tag, tmp_path, cases):
    case = next(c for c in cases[1] if c.cls == "yaml" and c.id == tag)
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(case.payload if isinstance(case.payload, bytes) else case.payload.encode())
    for cmd in ("validate", "plan"):
        r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", cmd, str(spec)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert all(line.startswith("error: ") for line in r.stderr.splitlines()), r.stderr


# The data part calls the data reader's public function (data/conversations.py load_conversations): a bad
# file is refused with one clear line (too many unusable records: data.max_bad_fraction), or every
# record is used or counted as dropped by reason; undecodable bytes are never replaced.
def test_every_bad_data_file_gets_a_clear_error_or_every_drop_counted(tmp_path):
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.runner.errors import RunnerError
    from eagle3_runner.runner.spec.sections import Data
    failures = []
    for case in data_cases():
        f = tmp_path / f"{case.id}.jsonl"
        f.write_bytes(case.raw)
        data = Data(source="jsonl", path=str(f))
        try:
            train, hold, rep = load_conversations(data)
        except RunnerError as e:
            if "\n" in str(e) or f.name not in str(e) and "data" not in str(e):
                failures.append(f"{case.id}: unclear error {e}")
            continue
        except Exception as e:  # noqa: BLE001
            failures.append(f"{case.id}: {type(e).__name__} (a traceback): {e}")
            continue
        used = len(train) + len(hold)
        dropped = sum((rep.get("dropped") or {}).values())
        texts = [t["content"] for c in train + hold for t in c]
        if used != case.good or used + dropped < case.total:
            failures.append(f"{case.id}: {case.total} records, {case.good} usable; got {used} "
                            f"used and {dropped} counted as dropped ({rep.get('dropped')})")
        if any("\ufffd" in t for t in texts):
            failures.append(f"{case.id}: undecodable bytes replaced by U+FFFD silently")
    assert not failures, "\n".join(failures)
