"""A drafter carried from one GPU window into the next (scripts/gpu/pays.sh's train phase brings
the export back as drafter-<spec>.tgz.NN parts; scripts/gpu/stage.sh joins, tests and unpacks
them into ~/stage/drafter-<spec>/, where pays.sh's bench phase benches it). The scripts' own
code runs here: pays.sh's carry_drafter function as the script defines it, stage.sh whole."""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAME = "smollm2-pays-gpu"
KEY = "c59d98e98fddd6a75562f91b23dc3f0134eb3e5d3b292dd9e805cbf4dc54bb6d"


def carry_drafter(work: Path, out: Path) -> str:
    """Run pays.sh's carry_drafter (its text, cut from the script) on a run folder `work`."""
    script = (REPO / "scripts/gpu/pays.sh").read_text()
    fn = script[script.index("carry_drafter() {"):]
    fn = fn[:fn.index("\n}\n") + 3]
    env = dict(os.environ, W=str(work), NAME=NAME, OUT=str(out), TXT=str(out / "r/train.log"))
    subprocess.run(["bash", "-c", fn + "carry_drafter"], env=env, check=True, cwd=work.parent)
    return (out / "r/train.log").read_text() if (out / "r/train.log").exists() else ""


def stage(repo: Path, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts/gpu/stage.sh"), "drafter"], cwd=repo,
                          env=dict(os.environ, HOME=str(home)), capture_output=True, text=True)


@pytest.fixture
def run_folder(tmp_path):
    work = tmp_path / "runs" / NAME
    export = work / "export" / KEY[:16]
    (export / "snapshots" / "step-000200").mkdir(parents=True)
    (work / "state").mkdir(parents=True)
    (work / "state/base.export.json").write_text(json.dumps({"key": KEY}))
    (export / "model.safetensors").write_bytes(os.urandom(40_000_000))  # 3 parts of 15 MB
    (export / "provenance.json").write_text('{"train_metrics": {}}')
    (export / "snapshots/step-000200/model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "out/r").mkdir(parents=True)
    return work, export


def test_the_export_goes_and_comes_back_whole(tmp_path, run_folder):
    work, export = run_folder
    said = carry_drafter(work, tmp_path / "out")
    parts = sorted((tmp_path / "out/r").glob(f"drafter-{NAME}.tgz.*"))
    assert [p.name[-2:] for p in parts] == ["00", "01", "02"], said
    assert f"export {KEY[:16]} back as 3 part(s)" in said
    repo = tmp_path / "repo"
    (repo / ".stage/drafter").mkdir(parents=True)
    for p in parts:
        (repo / ".stage/drafter" / p.name).write_bytes(p.read_bytes())
    r = stage(repo, tmp_path / "home")
    assert r.returncode == 0, r.stderr
    got = tmp_path / "home/stage" / f"drafter-{NAME}"
    assert "drafter unpacked into" in r.stdout
    assert (got / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    assert (got / "provenance.json").exists() and not (got / "snapshots").exists()
    assert not list((tmp_path / "home/stage").glob("*.tgz*"))  # the parts are gone once unpacked


def test_a_part_cut_short_is_refused(tmp_path, run_folder):
    work, _ = run_folder
    carry_drafter(work, tmp_path / "out")
    repo = tmp_path / "repo"
    (repo / ".stage/drafter").mkdir(parents=True)
    for p in sorted((tmp_path / "out/r").glob(f"drafter-{NAME}.tgz.*")):
        data = p.read_bytes()
        (repo / ".stage/drafter" / p.name).write_bytes(data[:-1000] if p.name.endswith("01")
                                                        else data)
    r = stage(repo, tmp_path / "home")
    assert r.returncode == 1
    assert "does not test whole: bring its parts back again" in r.stdout
    assert not (tmp_path / "home/stage" / f"drafter-{NAME}" / "model.safetensors").exists()


def test_no_export_brings_nothing_back(tmp_path, run_folder):
    """A train phase cut before its export (no state file, or a state naming an export that is
    not there) brings back no drafter and does not fail the phase."""
    work, export = run_folder
    (work / "state/base.export.json").write_text(json.dumps({"key": "0" * 64}))
    carry_drafter(work, tmp_path / "out")
    (work / "state/base.export.json").unlink()
    carry_drafter(work, tmp_path / "out")
    assert not list((tmp_path / "out/r").glob("drafter-*"))
