"""The CPU cores a stage gets (runner/cpu.py): torch's threads sized to the CPU affinity (SMT
siblings once, a cgroup quota, the ranks of a node), EAGLE3_THREADS, idle threads that sleep,
run_stage applying it before a stage's code (issue 48: one other CPU job made the demo's bench
30-50x slower and reversed its break-even taus)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from eagle3_runner.runner import cpu
from eagle3_runner.runner.errors import StageError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fake machine: set(affinity, cpu_count, siblings {cpu: list}, quota "q period" | None,
    local ranks)."""
    def set_(affinity, cpu_count, siblings=None, quota=None, ranks=None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
        topo = tmp_path / "sys-cpu"
        for c in affinity:
            d = topo / f"cpu{c}" / "topology"
            d.mkdir(parents=True, exist_ok=True)
            (d / "thread_siblings_list").write_text((siblings or {}).get(c, str(c)) + "\n")
        monkeypatch.setattr(cpu, "SYS_CPU", topo)
        q = tmp_path / "cpu.max"
        q.write_text(quota or "max 100000\n")
        monkeypatch.setattr(cpu, "CGROUP_CPU_MAX", q)
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    return set_


def test_threads_follow_the_affinity_not_the_machine(machine):
    machine({0, 1}, 64)  # taskset -c 0,1 on a 64-CPU machine: 2, not 64
    assert cpu.cores() == 2
    machine({0, 1, 2, 3}, 4, siblings={0: "0,2", 2: "0,2", 1: "1,3", 3: "1,3"})  # SMT pairs
    assert cpu.cores() == 2 and cpu.cores(physical=False) == 4
    machine({0, 1, 2, 3, 4, 5, 6, 7}, 8, quota="150000 100000")  # a container of 1.5 CPUs
    assert cpu.cores() == 2
    machine(set(range(8)), 8, ranks=2)  # 2 unpinned local ranks share the node
    assert cpu.cores() == 4
    machine({4, 5}, 8, ranks=2)  # Slurm pinned this rank to its share already
    assert cpu.cores() == 2


def test_eagle3_threads_picks_the_count(machine, monkeypatch):
    machine({0, 1}, 2)
    assert cpu.threads_wanted({}) == (2, "2 cores (EAGLE3_THREADS auto)")
    assert cpu.threads_wanted({"EAGLE3_THREADS": "3"})[0] == 3
    assert cpu.threads_wanted({"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS=5")  # the user's
    monkeypatch.setattr(cpu, "busy_elsewhere", lambda window_s=cpu.LOAD_WINDOW_S: 1.1)
    n, why = cpu.threads_wanted({"EAGLE3_THREADS": "load"})
    assert n == 1 and "1.1 busy elsewhere" in why  # one core left by the other job
    monkeypatch.setattr(cpu, "busy_elsewhere", lambda window_s=cpu.LOAD_WINDOW_S: 3.0)
    assert cpu.threads_wanted({"EAGLE3_THREADS": "load"})[0] == 1  # never 0
    with pytest.raises(StageError, match="EAGLE3_THREADS='many': expected auto"):
        cpu.threads_wanted({"EAGLE3_THREADS": "many"})


def test_stage_threads_sizes_a_loaded_torch_and_makes_waits_passive(machine, monkeypatch):
    machine({0}, 2)
    calls = []
    fake = types.SimpleNamespace(get_num_threads=lambda: 2, set_num_threads=calls.append)
    monkeypatch.setitem(sys.modules, "torch", fake)
    env = {}
    assert cpu.stage_threads(env)[0] == 1 and calls == [1]
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}  # nothing else for the processes it starts
    monkeypatch.delitem(sys.modules, "torch")
    env = {"OMP_WAIT_POLICY": "ACTIVE"}  # the user's choice stays
    assert cpu.stage_threads(env)[0] is None and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    with pytest.raises(StageError, match="EAGLE3_THREADS='0'"):  # refused before torch loads
        cpu.stage_threads({"EAGLE3_THREADS": "0"})


def test_a_process_pinned_to_one_cpu_runs_torch_on_one_thread():
    """The real thing in a fresh process pinned to one CPU: before torch loads, the wait policy;
    after, 1 thread (the affinity's, not os.cpu_count's); libgomp read OMP_WAIT_POLICY=PASSIVE."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from eagle3_runner.runner.cpu import stage_threads\n"
            "print(stage_threads()[0], os.environ['OMP_WAIT_POLICY'])\n"
            "import torch; torch.set_num_threads(4)\n"
            "print(stage_threads()[0], torch.get_num_threads(), 'OMP_NUM_THREADS' in os.environ)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "EAGLE3_THREADS")}
    env["OMP_DISPLAY_ENV"] = "TRUE"  # libgomp prints what it read when it loads
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "PASSIVE", "1", "1", "False"]
    if "OPENMP DISPLAY ENVIRONMENT" in out.stderr:  # GNU OpenMP (torch's Linux wheels)
        assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr, out.stderr


def test_run_stage_sizes_the_threads_before_the_stage_runs(machine, monkeypatch, tmp_path):
    import torch
    from eagle3_runner.runner.job import StageJob, run_stage
    from eagle3_runner.runner.spec.load import load_spec
    machine({0}, 2)
    seen = []
    stage = types.ModuleType("eagle3_runner.jobs.export")
    stage.run = lambda ctx: seen.append(torch.get_num_threads()) or {}
    monkeypatch.setitem(sys.modules, "eagle3_runner.jobs.export", stage)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"num_hidden_layers": 30, "hidden_size": 576, '
                                        '"vocab_size": 49152, "num_attention_heads": 9, '
                                        '"num_key_value_heads": 3, "intermediate_size": 1536}')
    spec = load_spec(data={"name": "t", "target": {"path": str(target)},
                           "drafter": {"draft_vocab_size": 2048}, "stages": {"export": {}}})

    def job(name):
        return StageJob(spec_json=spec.model_dump_json(), variant="base", stage="export",
                        key="k" * 64, parts={}, artifact=str(tmp_path / name),
                        partial=str(tmp_path / f".{name}"), inputs={}, run_id="r",
                        db_path=str(tmp_path / "r.duckdb"), reason="test")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run_stage(job("a"))
        assert seen == [1]  # the affinity's one core
        monkeypatch.setenv("EAGLE3_THREADS", "nope")
        with pytest.raises(StageError, match="EAGLE3_THREADS='nope'"):
            run_stage(job("b"))
        assert seen == [1]  # the stage never ran
    finally:
        torch.set_num_threads(old)
