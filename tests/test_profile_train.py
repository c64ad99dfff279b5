"""scripts/bench/profile_train.py on the CPU at tiny sizes: every phase of the online step is
timed for each mode, the modes train the same first step (same weights and batch: the switches
change speed, not the loss), the tables are written, and a spent budget skips cases."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import profile_train as pt  # noqa: E402


def test_phases_of_each_mode_and_the_same_first_step(tmp_path):
    pt.main(["--random", "tiny", "--device", "cpu", "--seq", "40", "--k", "2", "--steps", "1",
             "--warm", "1", "--cases", "b64/64/before,b64/64/after,b64/64/resident,b1/64/pinned",
             "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "profile_train.json").read_text())["rows"]
    by = {r["mode"]: r for r in rows}
    assert set(by) == {"before", "after", "resident", "pinned"} and not any(
        "error" in r for r in rows)
    before, after, resident = by["before"], by["after"], by["resident"]
    assert after["loss_first"] == pytest.approx(before["loss_first"], rel=1e-5)
    assert resident["loss_first"] == pytest.approx(before["loss_first"], rel=1e-5)
    assert set(before["phases"]) == set(pt.PHASES)
    for r in (before, after):  # the instrumented calls were seen
        assert all(r["phases"][p]["host_ms"] > 0 for p in
                   ("target_forward", "pack", "target_head", "draft_forward", "loss", "backward",
                    "optimizer"))
    assert resident["phases"]["target_forward"]["host_ms"] == 0  # features kept, not captured
    assert before["tokens_per_step"] == after["tokens_per_step"] > 40
    md = (tmp_path / "profile_train.md").read_text()
    assert "| b64 | 64 | after |" in md and "host ms per step" in md
    pt.main(["--random", "tiny", "--device", "cpu", "--seq", "40", "--k", "2", "--steps", "1",
             "--cases", "b1/64/before", "--budget", "0", "--out", str(tmp_path)])
    [row] = json.loads((tmp_path / "profile_train.json").read_text())["rows"]
    assert row["error"] == "skipped: --budget spent"


def test_a_spec_without_features_is_one_error_line(tmp_path, smollm2_path):
    """A spec whose train stage has no features to read (no extract artifact here) ends in one
    `error:` line and exit 1, not a traceback (runner/errors.py exit_code, as the CLI)."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "scripts/bench/profile_train.py"),
                        str(root / "specs/smollm2-sharegpt.yaml"), "-o", f"work_dir={tmp_path}",
                        "--steps", "1", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: stage train needs the extract stage's artifact"), r.stderr
    assert "Traceback" not in r.stderr
