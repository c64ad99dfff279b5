"""Issue 21 items 2 and 7: a stage checks its input artifacts against their artifact.json before
reading them, and `--force STAGE` reruns everything downstream of STAGE.

Stages are the tiny stand-ins of tests/test_plan.py (milliseconds each)."""

import json
import sys
from pathlib import Path

import pytest
from test_plan import fake_stages, make_spec, reasons  # noqa: F401 - fixture

from eagle3_runner.runner.apply import apply
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.plan import build_plan
from eagle3_runner.runner.stage import read_manifest


def _applied(tmp_path, **kw):
    spec = make_spec(tmp_path)
    plan = build_plan(spec, **kw)
    _, outcomes = apply(spec, plan, quiet=True)
    assert all(o.status == "done" for o in outcomes), outcomes
    return spec, {p.stage: p for p in plan.stages}


def _overwrite(path: Path, offset: int = 3, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = b"\xff" * min(n, len(data) - offset)
    path.write_bytes(bytes(data))


def test_an_overwritten_input_fails_before_the_stage_reads_it(tmp_path, fake_stages):
    spec, stages = _applied(tmp_path)
    shard = Path(stages["extract"].artifact) / "out.txt"
    _overwrite(shard)  # 64 bytes of a finished extract, as in issue 21
    assert reasons(build_plan(spec))["extract"] == ("skip", "up to date")
    _, outcomes = apply(spec, build_plan(spec, force=("train",)), quiet=True)
    train = next(o for o in outcomes if o.job.stage == "train")
    assert train.status == "failed"
    assert "out.txt" in train.error and "does not match its sha256" in train.error
    assert "runner apply SPEC --force extract" in train.error
    assert all(o.status == "skipped" for o in outcomes if o.job.stage != "train")
    # the fix the message names works
    _, outcomes = apply(spec, build_plan(spec, force=("extract",)), quiet=True)
    assert [o.status for o in outcomes] == ["done"] * 4


def test_a_truncated_or_missing_input_is_named(tmp_path, fake_stages):
    import eagle3_runner.runner.verify as verify
    spec, stages = _applied(tmp_path)
    art = Path(stages["train"].artifact)
    (art / "out.txt").write_text("x")
    with pytest.raises(StageError, match=r"out.txt has 1 bytes, artifact.json says \d+"):
        verify.verify_artifact(art, read_manifest(art), "train")
    (art / "out.txt").unlink()
    with pytest.raises(StageError, match="out.txt is missing"):
        verify.verify_artifact(art, read_manifest(art), "train")


def test_unchanged_inputs_cost_a_stat_changed_stat_a_hash_and_big_ones_a_sample(
        tmp_path, fake_stages, monkeypatch):
    import eagle3_runner.runner.verify as verify
    spec, stages = _applied(tmp_path)
    art = Path(stages["extract"].artifact)
    m = read_manifest(art)
    assert m["sizes"]["out.txt"] == (art / "out.txt").stat().st_size
    assert verify.verify_artifact(art, m, "extract")["trusted"] == len(m["files"])
    (art / "out.txt").touch()  # a new stat: hashed again (and found right)
    got = verify.verify_artifact(art, m, "extract")
    assert got["hashed_bytes"] > 0 and got["trusted"] == len(m["files"]) - 1
    assert verify.verify_artifact(art, m, "extract")["trusted"] == len(m["files"])
    monkeypatch.setenv("EAGLE3_VERIFY", "full")
    assert verify.verify_artifact(art, m, "extract")["trusted"] == 0
    # above the full-hash budget, files with a sampled digest get the sampled check
    monkeypatch.setenv("EAGLE3_VERIFY", "auto")
    monkeypatch.setenv("EAGLE3_VERIFY_FULL_GB", "0")
    big = art / "big.bin"
    big.write_bytes(bytes(range(256)) * 40000)
    m = {"files": {"big.bin": verify.sha256_file(big)}, "sizes": {"big.bin": big.stat().st_size},
         "sampled_sha256": {"big.bin": verify.sampled_sha256(big)}}
    assert verify.verify_artifact(art, m, "extract")["sampled"] == 1
    _overwrite(big, offset=0)  # the first block is always sampled
    with pytest.raises(StageError, match="sampled sha256"):
        verify.verify_artifact(art, m, "extract")


def test_force_reruns_everything_downstream(tmp_path, fake_stages):
    spec, _ = _applied(tmp_path)
    r = reasons(build_plan(spec, force=("train",)))
    assert r["extract"] == ("skip", "up to date") and r["train"] == ("run", "forced")
    assert r["export"] == r["bench"] == ("run", "upstream train reruns (forced)")
    _, outcomes = apply(spec, build_plan(spec, force=("train",)), quiet=True)
    assert [o.job.stage for o in outcomes] == ["train", "export", "bench"]
    assert all(r == ("skip", "up to date") for r in reasons(build_plan(spec)).values())


def test_an_upstream_rebuilt_alone_makes_its_dependents_rerun(tmp_path, fake_stages):
    """`--force train --only train` (or an apply killed after train) leaves export built from the
    old drafter: the next plan sees it, from the identity export recorded of its input."""
    spec, stages = _applied(tmp_path)
    exp = read_manifest(Path(stages["export"].artifact))
    assert set(exp["inputs"]) == {"train", "extract"}
    def salted(ctx):  # the rerun makes different bytes
        (ctx.out_dir / "out.txt").write_text("another drafter")
        return {}

    fake_stages.setattr(sys.modules["eagle3_runner.jobs.train"], "run", salted)
    _, outcomes = apply(spec, build_plan(spec, force=("train",), only=("train",)), quiet=True)
    assert [o.job.stage for o in outcomes] == ["train"]
    r = reasons(build_plan(spec))
    assert r["train"] == ("skip", "up to date")
    assert r["export"] == ("run", "input changed: train was rebuilt since")
    assert r["bench"] == ("run", "upstream export reruns (input changed: train was rebuilt since)")


def test_old_manifests_without_inputs_stay_up_to_date(tmp_path, fake_stages):
    spec, stages = _applied(tmp_path)
    art = Path(stages["export"].artifact) / "artifact.json"
    m = json.loads(art.read_text())
    del m["inputs"]
    art.write_text(json.dumps(m))
    assert reasons(build_plan(spec))["export"] == ("skip", "up to date")


def test_atomic_writes_get_the_umask_modes(tmp_path):
    """Writers that go through mkstemp (safetensors, torch, save_pretrained) leave 0600: what
    atomic_path renames into place is readable like any other file (0644 under umask 022)."""
    import os
    import stat
    import tempfile

    from eagle3_runner.runner.files import atomic_path

    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            fd, name = tempfile.mkstemp(dir=tmp_path)  # mode 0600, as those writers make it
            os.write(fd, b"x")
            os.close(fd)
            os.replace(name, tmp)
        with atomic_path(tmp_path / "folder", tempfile.mkdtemp(dir=tmp_path)) as tmp:  # 0700
            (tmp / "a.bin").write_bytes(b"y")
            os.chmod(tmp / "a.bin", 0o600)
        os.umask(0o027)
        with atomic_path(tmp_path / "group.txt") as tmp:
            tmp.write_text("z")
            os.chmod(tmp, 0o600)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "model.safetensors") == 0o644
    assert mode(tmp_path / "folder") == 0o755
    assert mode(tmp_path / "folder" / "a.bin") == 0o644
    assert mode(tmp_path / "group.txt") == 0o640


def test_a_stage_artifact_gets_the_umask_modes(tmp_path, fake_stages):
    """finalize renames the stage's partial folder: a file its writer left 0600 comes out 0644."""
    import os
    import stat
    import tempfile

    def private_writer(ctx):
        fd, name = tempfile.mkstemp(dir=ctx.out_dir)
        os.write(fd, b"weights")
        os.close(fd)
        os.replace(name, ctx.out_dir / "model.safetensors")
        return {}

    fake_stages.setattr(sys.modules["eagle3_runner.jobs.export"], "run", private_writer)
    old = os.umask(0o022)
    try:
        _, stages = _applied(tmp_path)
    finally:
        os.umask(old)
    f = Path(stages["export"].artifact) / "model.safetensors"
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert stat.S_IMODE(f.parent.stat().st_mode) == 0o755
