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


def stage(repo: Path, home: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts/gpu/stage.sh"), *(args or ("drafter",))],
                          cwd=repo, env=dict(os.environ, HOME=str(home)), capture_output=True,
                          text=True)


@pytest.fixture
def run_folder(tmp_path):
    work = tmp_path / "runs" / NAME
    export = work / "export" / KEY[:16]
    (export / "snapshots" / "step-000200").mkdir(parents=True)
    (work / "state").mkdir(parents=True)
    (work / "state/base.export.json").write_text(json.dumps({"key": KEY}))
    (export / "model.safetensors").write_bytes(os.urandom(40_000_000))  # 3 parts of 15 MB
    (export / "provenance.json").write_text('{"train_metrics": {}}')
    (export / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
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
    assert "do not join into a whole gzip: one is missing, cut, extra or from another set" \
        in r.stderr
    assert not (tmp_path / "home/stage" / f"drafter-{NAME}" / "model.safetensors").exists()
    assert not list((tmp_path / "home/stage").glob("drafter-*"))  # nothing left to mix later


@pytest.mark.parametrize("case,why", [
    ("no_first", "has no drafter-demo.tgz.00 beside it: bring every part back"),
    ("not_tar", "is gzip but not a tar archive"),
    ("no_config", "holds no config.json: not an exported drafter"),
    ("first_is_folder", "is not a file"),
])
def test_parts_that_are_not_a_drafter_are_refused(tmp_path, case, why):
    """Parts that join into something other than a drafter are refused with the reason, exit 1,
    and leave nothing in ~/stage (never 'unpacked' over an empty folder)."""
    import gzip
    import io
    import tarfile
    d = tmp_path / "repo/.stage/drafter"
    d.mkdir(parents=True)
    if case == "no_first":
        (d / "drafter-demo.tgz.01").write_bytes(b"x")
    elif case == "not_tar":
        (d / "drafter-demo.tgz.00").write_bytes(gzip.compress(os.urandom(3000)))
    elif case == "no_config":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as t:
            info = tarfile.TarInfo("./model.safetensors")
            info.size = 5
            t.addfile(info, io.BytesIO(b"abcde"))
        (d / "drafter-demo.tgz.00").write_bytes(buf.getvalue())
    else:
        (d / "drafter-demo.tgz.00").mkdir()
    r = stage(tmp_path / "repo", tmp_path / "home")
    assert r.returncode == 1 and why in r.stderr, r.stderr
    assert "unpacked" not in r.stdout
    assert not list((tmp_path / "home/stage").glob("drafter-demo*"))


def test_usage_and_a_missing_or_empty_batch_are_said(tmp_path):
    (tmp_path / "repo/.stage/empty").mkdir(parents=True)
    r = stage(tmp_path / "repo", tmp_path / "home", "a", "b")
    assert r.returncode == 2 and "usage: stage.sh NAME" in r.stderr
    r = stage(tmp_path / "repo", tmp_path / "home", "drafter")
    assert r.returncode == 1 and ".stage/drafter is not a folder here: carry it" in r.stderr
    r = stage(tmp_path / "repo", tmp_path / "home", "empty")
    assert r.returncode == 1 and ".stage/empty is empty" in r.stderr


def test_no_export_brings_nothing_back(tmp_path, run_folder):
    """A train phase cut before its export (no state file, or a state naming an export that is
    not there) brings back no drafter and does not fail the phase."""
    work, export = run_folder
    (work / "state/base.export.json").write_text(json.dumps({"key": "0" * 64}))
    carry_drafter(work, tmp_path / "out")
    (work / "state/base.export.json").unlink()
    carry_drafter(work, tmp_path / "out")
    assert not list((tmp_path / "out/r").glob("drafter-*"))


def test_a_staged_data_file_is_checked_against_its_sidecar(tmp_path):
    """`stage.sh turns` (scripts/gpu/sglang_wheels.sh TURNS_ONLY=1: sharegpt-turns4.jsonl.gz and
    its sha256sum sidecar): staged when its sha256 holds; removed from ~/stage, naming it, when
    the carried copy differs."""
    import gzip
    import hashlib
    repo, name = tmp_path / "repo", "sharegpt-turns4.jsonl.gz"
    (repo / ".stage/turns").mkdir(parents=True)
    data = gzip.compress(b'{"messages": []}\n' * 100)
    (repo / ".stage/turns" / name).write_bytes(data)
    (repo / ".stage/turns" / (name + ".sha256")).write_text(
        f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    r = stage(repo, tmp_path / "home", "turns")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "home/stage" / name).read_bytes() == data
    (repo / ".stage/turns" / name).write_bytes(data[:-10])  # cut in the carry
    r = stage(repo, tmp_path / "home2", "turns")
    assert r.returncode == 1 and f"{name} differs from its {name}.sha256" in r.stderr
    assert not (tmp_path / "home2/stage" / name).exists()
