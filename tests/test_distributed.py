"""Data parallel on one node, on the CPU: 2 gloo ranks against 1 rank (runner/launch.py,
runner/dist.py, the data-parallel paths of jobs/train.py and jobs/extract.py, the Slurm mapping).

2-rank runs go through the real launcher (`python -m eagle3_runner.runner.launch`, as the local executor calls
it) or, where a run must be interrupted, through torch.multiprocessing with a test worker. The
Slurm tests at the end need the local cluster (scripts/slurm-up.sh) and skip without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_runner.trainer.recipe import train
from eagle3_runner.runner.job import StageJob, run_stage
from eagle3_runner.runner.local import launch_local
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.stage import StageContext
from test_slurm import _controller_answers  # the same "is a cluster up?" probe
from train_helpers import tiny_extract, train_ctx, train_spec

ROOT = Path(__file__).resolve().parent.parent
# 5 training samples, global batch 4: step 2 of each epoch has ONE sample, so rank 1 gets none
TRAIN = dict(batch_size=4, max_steps=4, eval_every=2, checkpoint_every=2, eval_samples=2,
             epochs=2.0, lr=3e-3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """1 thread in this process, as each CPU rank gets (runner/launch.py): 2 OpenMP threads on
    a shared 2-core box can run 30x slower than 1 while another process holds a core.
    EAGLE3_THREADS=1: run_stage sizes a stage's threads (runner/cpu.py stage_threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_THREADS", "1")
        yield
    torch.set_num_threads(old)


def stage_job(spec, stage: str, inputs: dict, partial: Path, artifact: Path, db: Path) -> StageJob:
    return StageJob(spec_json=spec.model_dump_json(), variant="base", stage=stage, key="k" * 64,
                    parts={}, artifact=str(artifact), partial=str(partial),
                    inputs={k: str(v) for k, v in inputs.items()}, run_id="dist", db_path=str(db),
                    reason="test")


def _worker(local_rank: int, world: int, store: str, fn, args) -> None:
    """A spawned rank: join the group (FileStore) and call fn(rank, world, *args)."""
    from eagle3_runner.runner.launch import init_rank
    import torch.distributed as dist
    init_rank(local_rank, world, local_rank, f"file://{store}")
    try:
        fn(local_rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, os.path.join(d, "store"), fn, args), nprocs=world,
                           join=True, start_method="spawn")


def _train_until(rank, world, spec_json, extract_dir, out, db, stop_at):
    from eagle3_runner.runner.spec.schema import Spec
    ctx = train_ctx(Spec.model_validate_json(spec_json), extract_dir, out, db)
    ctx.rank, ctx.world_size = rank, world
    assert train(ctx, stop_at=stop_at) is None


def weights(artifact: Path) -> dict:
    return load_file(str(Path(artifact) / "draft.safetensors"))


def assert_close(a: dict, b: dict, atol=2e-5):
    assert set(a) == set(b)
    for k in a:
        if a[k].dtype.is_floating_point:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: the train stage with 1 rank (run_stage in this process, finalized)."""
    tmp = tmp_path_factory.mktemp("dp")
    ex = tiny_extract(tmp / "extract", n_samples=7)
    spec = train_spec(**TRAIN)
    run_stage(stage_job(spec, "train", {"extract": ex}, tmp / ".p1", tmp / "a1", tmp / "r.duckdb"))
    return spec, ex, tmp / "a1"


def with_executor(spec, **executor):
    data = spec.model_dump(mode="json", exclude_none=True)
    return load_spec(data={**data, "executor": executor}, check_target=False)


def test_two_ranks_train_the_same_weights_as_one(one_rank, tmp_path):
    """DDP over 2 gloo ranks, each with half of the global batch (and rank 1 with none in the
    odd step), through the local executor and the launcher: the same drafter as 1 rank up to
    float summation order; one artifact, one `stages` row, metrics once."""
    from eagle3_runner.runner.local import LocalExecutor
    base, ex, a1 = one_rank
    spec = with_executor(base, kind="local", nproc_per_node=2)
    db = tmp_path / "r.duckdb"
    [out] = LocalExecutor(spec).run_jobs([stage_job(spec, "train", {"extract": ex},
                                                    tmp_path / ".p2", tmp_path / "a2", db)])
    assert out.status == "done", out.error
    m2, a2 = out.metrics, tmp_path / "a2"
    assert (a2 / "artifact.json").exists() and not (tmp_path / ".p2").exists()
    assert not (a2 / "ckpt.pt").exists()
    w1, w2 = weights(a1), weights(a2)
    assert_close(w1, w2)
    h1, h2 = (json.loads((a / "train_metrics.json").read_text()) for a in (a1, a2))
    assert [h["step"] for h in h2["history"]] == [2, 4]
    for x, y in zip(h1["history"], h2["history"]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
        assert x["acc_step"] == pytest.approx(y["acc_step"], abs=1e-6)
    assert m2["train_steps"] == 4
    assert m2["final_loss"] == pytest.approx(h1["summary"]["final_loss"], rel=1e-4)
    from eagle3_runner.runner.store import Store
    st = Store(db)
    assert st.query("SELECT status FROM stages")[1] == [("done",)]
    rows = st.query("SELECT step FROM metrics WHERE name = 'eval_acc_0' ORDER BY step")[1]
    assert rows == [(2,), (4,)]  # rank 0 only


def test_effective_batch_matters(one_rank, tmp_path):
    """The comparison above can fail: half the global batch on 1 rank trains other weights."""
    spec, ex, a1 = one_rank
    ctx = train_ctx(train_spec(**{**TRAIN, "batch_size": 2}), ex, tmp_path / "o", tmp_path / "r.db")
    train(ctx)
    w = load_file(str(tmp_path / "o" / "draft.safetensors"))
    assert (w["fc.weight"] - weights(a1)["fc.weight"]).abs().max() > 1e-3


def test_resume_across_rank_counts(one_rank, tmp_path):
    """Killed after step 3 (checkpoint at step 2) with 1 rank, resumed with 2 ranks; and killed
    with 2 ranks, resumed with 1: both end at the uninterrupted 1-rank weights, and both really
    resumed (a marker planted in the checkpoint's history survives)."""
    spec, ex, a1 = one_rank
    db = tmp_path / "r.duckdb"
    # 1 rank -> 2 ranks
    p = tmp_path / ".pa"
    assert train(train_ctx(spec, ex, p, db), stop_at=3) is None
    ck = torch.load(p / "ckpt.pt", weights_only=False)
    assert ck["step"] == 2
    ck["history"][0]["marker"] = "from-ckpt"
    torch.save(ck, p / "ckpt.pt")
    launch_local(stage_job(spec, "train", {"extract": ex}, p, tmp_path / "a", db), 2)
    assert_close(weights(a1), weights(tmp_path / "a"))
    hist = json.loads((tmp_path / "a" / "train_metrics.json").read_text())["history"]
    assert hist[0].get("marker") == "from-ckpt"
    # 2 ranks -> 1 rank
    q = tmp_path / "b"
    spawn(_train_until, 2, spec.model_dump_json(), ex, q, db, 3)
    ck = torch.load(q / "ckpt.pt", weights_only=False)
    assert ck["step"] == 2 and not (q / "draft.safetensors").exists()
    assert not list(q.glob(".tmp-*"))
    ck["history"][0]["marker"] = "from-2-ranks"
    torch.save(ck, q / "ckpt.pt")
    train(train_ctx(spec, ex, q, db))
    assert_close(weights(a1), weights(q))
    hist = json.loads((q / "train_metrics.json").read_text())["history"]
    assert hist[0].get("marker") == "from-2-ranks"


def test_two_ranks_checkpoint_by_time_together(one_rank, tmp_path):
    """stages.train.checkpoint_minutes with 2 ranks: the ranks agree at a host sync (here the
    evaluation at step 2) and checkpoint together, no rank left waiting in a barrier; killed
    after step 3, the checkpoint is step 2's (checkpoint_every is far away)."""
    spec, ex, _ = one_rank
    timed = train_spec(**{**TRAIN, "checkpoint_every": 1000, "checkpoint_minutes": 1e-9})
    q = tmp_path / "t"
    spawn(_train_until, 2, timed.model_dump_json(), ex, q, tmp_path / "r.duckdb", 3)
    assert torch.load(q / "ckpt.pt", weights_only=False)["step"] == 2


def test_stage_error_on_two_ranks_comes_back_once(one_rank, tmp_path):
    """A StageError raised in the ranks reaches the local executor as the stage's own message,
    with one failed `stages` row and no artifact."""
    from eagle3_runner.runner.local import LocalExecutor
    from eagle3_runner.runner.store import Store
    base, ex, _ = one_rank
    spec = with_executor(train_spec(**{**TRAIN, "eval_samples": 7}), kind="local",
                         nproc_per_node=2)
    db = tmp_path / "r.duckdb"
    [out] = LocalExecutor(spec).run_jobs([stage_job(spec, "train", {"extract": ex},
                                                    tmp_path / ".p", tmp_path / "a", db)])
    assert out.status == "failed" and "eval_samples = 7" in out.error
    assert "Traceback" not in out.error and not (tmp_path / "a").exists()
    assert Store(db).query("SELECT status FROM stages")[1] == [("failed",)]


def test_rank_without_process_group_is_refused(one_rank, tmp_path):
    from eagle3_runner.runner.errors import StageError
    spec, ex, _ = one_rank
    ctx = train_ctx(spec, ex, tmp_path / "o", tmp_path / "r.duckdb")
    ctx.rank, ctx.world_size = 1, 2
    with pytest.raises(StageError, match="eagle3_runner.runner.launch"):
        train(ctx)


# ---------------------------------------------------------------------------------------------
# extraction (the real SmolLM2 and ShareGPT)


def test_assign_shards_is_balanced_and_complete():
    from eagle3_runner.jobs.extract import assign_shards
    toks = [50, 10, 40, 30, 30, 5]
    a = assign_shards(toks, 2)
    assert sorted(a[0] + a[1]) == list(range(6)) and a == assign_shards(toks, 2)
    assert abs(sum(toks[s] for s in a[0]) - sum(toks[s] for s in a[1])) <= 10
    assert assign_shards(toks, 1) == [list(range(6))]
    assert assign_shards([7], 3) == [[0], [], []]  # more ranks than shards: idle ranks


def _extract_spec(smollm2_path, tmp):
    return load_spec(data={
        "name": "t", "work_dir": str(tmp / "work"),
        "target": {"path": str(smollm2_path), "device": "cpu", "chat_template": "auto"},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 1024},
        "data": {"source": "sharegpt", "max_samples": 5, "max_length": 64, "holdout": 0,
                 "seed": 0},
        "stages": {"extract": {"batch_tokens": 128, "shard_samples": 1}}})


def test_sharded_extraction_equals_one_rank_and_resumes(smollm2, smollm2_path, tmp_path,
                                                        monkeypatch):
    """2 ranks (each loading the real target) write the single-rank shards, one features.json
    listing all of them in order; a partial dir from a 1-rank run (2 complete shards, a
    truncated one, a stale temp file) is resumed: complete shards kept, the rest recomputed."""
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.errors import FetchError
    try:
        asset_path("sharegpt")
    except FetchError as e:
        pytest.skip(str(e))
    import eagle3_runner.jobs.extract as ex
    import eagle3_runner.targets.shards as shards
    from eagle3_runner.targets.features import open_features
    spec = _extract_spec(smollm2_path, tmp_path)
    one = tmp_path / "one"
    one.mkdir()
    monkeypatch.setattr("eagle3_runner.targets.load.load_target", lambda *a, **k: smollm2)
    ex.run(StageContext(spec=spec, stage="extract", variant="base", run_id="t", inputs={},
                        out_dir=one, db_path=tmp_path / "r.duckdb"))
    monkeypatch.undo()
    m1 = json.loads((one / "features.json").read_text())
    n = len(m1["shards"])
    assert n >= 4 and m1["num_samples"] == n  # 5 records minus any the cleaner dropped
    # a partial dir as a killed 1-rank run left it
    part = tmp_path / ".partial"
    part.mkdir()
    from eagle3_runner.jobs.extract import assign_shards
    mine = assign_shards([s["num_tokens"] for s in m1["shards"]], 2)
    keep = [mine[0][0], mine[1][0]]  # one complete shard of each rank
    assert len(mine[1]) >= 2
    for s in keep + [mine[1][-1]]:  # each written shard has its sha256 record (jobs/extract.py)
        sh = m1["shards"][s]
        shutil.copy2(one / sh["file"], part / sh["file"])
        shards.sha_record(part / sh["file"]).write_text(f"{sh['sha256']}  {sh['file']}\n")
    bad = m1["shards"][mine[1][-1]]["file"]  # truncated: must be recomputed
    (part / bad).write_bytes((one / bad).read_bytes()[:100])
    (part / f".tmp-{m1['shards'][mine[0][-1]]['file']}").write_bytes(b"junk")
    kept = {s: (part / m1["shards"][s]["file"]).stat().st_mtime_ns for s in keep}
    metrics = launch_local(stage_job(spec, "extract", {}, part, tmp_path / "two",
                                     tmp_path / "r.duckdb"), 2)
    two = tmp_path / "two"
    assert metrics["resumed_shards"] == 2 and metrics["shards"] == n and metrics["samples"] == n
    for s in keep:  # complete shards were verified, not rewritten
        assert (two / m1["shards"][s]["file"]).stat().st_mtime_ns == kept[s]
    m2 = json.loads((two / "features.json").read_text())
    assert not list(two.glob(".tmp-*")) and len(list(two.glob("features*.json"))) == 1
    assert not list(two.glob(".*.sha256"))
    strip = lambda m: {k: v for k, v in m.items() if k != "shards"}  # noqa: E731
    assert strip(m1) == strip(m2)
    assert [(s["file"], s["num_samples"], s["num_tokens"]) for s in m1["shards"]] == \
        [(s["file"], s["num_samples"], s["num_tokens"]) for s in m2["shards"]]
    files = json.loads((two / "artifact.json").read_text())["files"]
    for s in m2["shards"]:  # the manifest's hashes are those of the files on disk
        assert files[s["file"]] == s["sha256"]
    f1, f2 = open_features(one, spec.aux_ids, spec.feature_width), open_features(two)
    assert len(f1) == len(f2) == n
    for i in range(n):
        a, b = f1.sample(i), f2.sample(i)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(a.aux_hidden, b.aux_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.last_hidden, b.last_hidden, atol=1e-4, rtol=1e-4)
    for k, v in f1.head().items():
        assert torch.equal(v, f2.head()[k]), k


# ---------------------------------------------------------------------------------------------
# Slurm: one job, N tasks


def test_drafter_v2_train_is_one_job_with_8_tasks():
    from eagle3_runner.runner.job import stage_nproc
    from eagle3_runner.runner.slurm.executor import group_jobs
    from eagle3_runner.runner.slurm.sbatch import sbatch_params, sbatch_script
    spec = load_spec(ROOT / "specs" / "drafter-v2.yaml")
    s = sbatch_script(spec, "train")
    assert "#SBATCH --ntasks-per-node=8\n" in s and "#SBATCH --nodes=1\n" in s
    assert "#SBATCH --gpus-per-node=8\n" in s and "#SBATCH --cpus-per-task=8\n" in s
    assert s.count("\nsrun ") == 1 and "--kill-on-bad-exit=1" in s
    assert "NCCL_NVLS_ENABLE" in s
    # extract: one process holding one target replica split over all 8 GPUs
    s = sbatch_script(spec, "extract")
    assert "#SBATCH --ntasks-per-node=1\n" in s and "#SBATCH --gpus-per-node=8\n" in s
    assert "#SBATCH --cpus-per-task=64\n" in s
    for stage in ("export", "bench"):
        assert "#SBATCH --ntasks-per-node=1\n" in sbatch_script(spec, stage)
        assert stage_nproc(spec, stage) == 1
    assert sbatch_params(spec, "train")["ntasks_per_node"] == 8
    jobs = [stage_job(spec, st, {}, Path("/p"), Path("/a"), Path("/db")) for st in
            ("extract", "train", "export")]
    jobs[1].after, jobs[2].after = [0], [1]
    assert group_jobs(jobs, lambda j: spec) == [[0], [1], [2]]  # one job per stage, no arrays


def test_nproc_validation():
    from eagle3_runner.runner.errors import SpecError
    with pytest.raises(SpecError, match="nproc_per_node = 16.*gpus_per_node = 8"):
        load_spec(ROOT / "specs" / "drafter-v2.yaml", overrides=["executor.nproc_per_node=16"])
    with pytest.raises(SpecError, match="only extract and train"):
        load_spec(ROOT / "specs" / "drafter-v2.yaml",
                  overrides=["executor.stages.export.nproc_per_node=2"])


@pytest.fixture
def slurm_path():
    why = _controller_answers()
    if why:
        pytest.skip(why)
    old = os.environ["PATH"]
    r = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:  # no accounting: the stand-in answers from squeue
        os.environ["PATH"] = f"{ROOT / 'scripts' / 'sacct-shim'}{os.pathsep}{old}"
    yield
    os.environ["PATH"] = old


def test_train_stage_as_two_srun_tasks_of_one_slurm_job(one_rank, tmp_path, slurm_path):
    """The tiny train stage submitted with nproc_per_node 2: one Slurm job, two tasks that join
    one gloo group through the SLURM_* variables; rank 0 finalizes; same weights as 1 rank."""
    from eagle3_runner.runner.slurm.executor import SlurmExecutor
    base, ex, a1 = one_rank
    spec = with_executor(base, kind="slurm", cpus_per_task=1, mem_gb=1, timeout_min=10,
                         nproc_per_node=2, log_dir=str(tmp_path / "slurm"))
    db = tmp_path / "r.duckdb"
    job = stage_job(spec, "train", {"extract": ex}, tmp_path / ".p", tmp_path / "a", db)
    job.executor = "slurm"
    [out] = SlurmExecutor(spec).run_jobs([job])
    assert out.status == "done", out.error
    assert out.metrics["train_steps"] == 4
    assert_close(weights(a1), weights(tmp_path / "a"))
    logs = sorted(p.name for p in (tmp_path / "slurm").rglob("*_log.err"))
    assert logs == [f"{out.job_id}_0_log.err", f"{out.job_id}_1_log.err"]  # 2 tasks, 1 job
    from eagle3_runner.runner.store import Store
    assert Store(db).query("SELECT status, job_id FROM stages")[1] == [("done", out.job_id)]
