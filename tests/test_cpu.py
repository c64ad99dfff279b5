"""The CPU cores a stage gets (runner/cpu.py): torch's threads sized to the CPU affinity (SMT
siblings once, a cgroup quota, the ranks of a node), EAGLE3_THREADS, idle threads that sleep,
run_stage applying it before a stage's code; and the machine's load measured next to the bench's
timings, whose busy rows are flagged (issue 48: one other CPU job made the demo's bench 30-50x
slower and reversed its break-even taus)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from eagle3_runner.runner import cpu
from eagle3_runner.runner.bench_rows import config_fields, prompt_row, summary_row
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
    # short spins, then sleep; no thread count for the processes it starts
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    monkeypatch.delitem(sys.modules, "torch")
    for users in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}):  # the user's choice
        env = dict(users)
        assert cpu.stage_threads(env)[0] is None and env == users
    with pytest.raises(StageError, match="EAGLE3_THREADS='0'"):  # refused before torch loads
        cpu.stage_threads({"EAGLE3_THREADS": "0"})


def test_a_process_pinned_to_one_cpu_runs_torch_on_one_thread():
    """The real thing in a fresh process pinned to one CPU: before torch loads, the wait policy;
    after, 1 thread (the affinity's, not os.cpu_count's); libgomp read the short spin count."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "from eagle3_runner.runner.cpu import stage_threads\n"
            "print(stage_threads()[0], os.environ['OMP_WAIT_POLICY'])\n"
            "import torch; torch.set_num_threads(4)\n"
            "print(stage_threads()[0], torch.get_num_threads(), 'OMP_NUM_THREADS' in os.environ)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EAGLE3_THREADS")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints what it read when it loads
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "PASSIVE", "1", "1", "False"]
    if "OPENMP DISPLAY ENVIRONMENT" in out.stderr:  # GNU OpenMP (torch's Linux wheels)
        assert "GOMP_SPINCOUNT = '1000'" in out.stderr, out.stderr


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


# ----------------------------------------------------------------------------------------------
# the machine's load next to the bench's timings


def test_meter_sees_another_process_on_its_cores():
    """A busy loop in another process pinned to this process's first core shows as ~1 core of
    other load; this process's own CPU time is not counted."""
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat")
    core = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})"
                            "\nwhile True: pass"])
    try:
        time.sleep(0.5)
        m = cpu.Meter()
        a = m.snap()
        t = time.perf_counter()
        while time.perf_counter() - t < 1.0:  # this process busy too: not "other"
            pass
        w = m.window(a, m.snap())
    finally:
        hog.kill()
        hog.wait()
    cols = cpu.load_columns([w], 2, 2)
    # the hog gets its core (shared with whatever else runs here): well above BUSY_CORES
    assert 0.6 <= cols["other_load"] <= 2.2 and cpu.busy(cols)


def _cfg():
    c = types.SimpleNamespace(num_steps=3, eagle_topk=1, draft_tokens=4)
    return config_fields(c, False, 48, 0.0, "embedded", "mtbench", 54, "torch")


def _load(other, load_1m, threads=2, cores=2, wall=3.0):
    win = {"wall_s": wall, "other_cpu_s": None if other is None else other * wall,
           "load_1m": load_1m}
    return cpu.load_columns([win], threads, cores)


def test_a_summary_measured_on_a_busy_machine_is_flagged_and_an_idle_one_is_not():
    cfg = _cfg()
    idle, hot = _load(0.03, 2.1), _load(1.0, 3.2)  # one other CPU job: ~1 core of 2
    assert idle == {"cores": 2, "threads": 2, "other_load": pytest.approx(0.03), "load_1m": 2.1}
    rows = [prompt_row(cfg, f"p{i}", 1.2, 48, 40, 20.0, 25.0, True, load=ld)
            for i, ld in enumerate([idle, hot])]
    assert rows[0]["flags"] == "slower than baseline" and rows[0]["other_load"] < 0.05
    assert rows[1]["flags"] == "busy machine, slower than baseline"
    s = summary_row(cfg, rows, 1.2, 20.0, 25.0, 1.6, "chain 3/1/4: measured.", load=hot)
    assert s["flags"].split(", ")[0] == "busy machine" and s["load_1m"] == 3.2
    assert "other processes used 1.00 of this process's 2 cores" in s["explanation"]
    assert "1/2 prompt rows flagged `busy machine`" in s["explanation"]
    s = summary_row(cfg, rows[:1], 1.2, 20.0, 25.0, 1.6, "chain 3/1/4: measured.", load=idle)
    assert "busy" not in s["flags"] and s["explanation"] == "chain 3/1/4: measured."
    # no /proc/stat: the load average above this process's own threads says it
    assert cpu.busy(_load(None, 3.1)) and not cpu.busy(_load(None, 1.9))
    # unmeasured (the sglang backend): NULL columns, no flag
    r = prompt_row(cfg, "p", 1.2, 48, 40, 30.0, 25.0, True)
    assert r["flags"] == "" and "other_load" not in r


def test_the_load_columns_land_in_an_old_results_file(tmp_path):
    import duckdb
    from eagle3_runner.runner.store import Store
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE runs (run_id VARCHAR)")  # every version made it (store.py)
    con.execute("CREATE TABLE bench_summary (run_id VARCHAR, flags VARCHAR)")
    con.execute("INSERT INTO bench_summary VALUES ('old', '')")
    con.close()
    cfg = _cfg()
    hot = _load(1.0, 3.2)
    rows = [prompt_row(cfg, "p0", 1.2, 48, 40, 20.0, 25.0, True, load=hot)]
    store = Store(db)
    store.emit("bench", [{**r, "run_id": "new"} for r in rows])
    store.emit("bench_summary", {**summary_row(cfg, rows, 1.2, 20.0, 25.0, 1.6, "x.", load=hot),
                                 "run_id": "new"})
    _, got = store.query("SELECT run_id, cores, threads, round(other_load, 2), load_1m, flags "
                         "FROM bench_summary ORDER BY run_id")
    assert got == [("new", 2, 2, 1.0, 3.2, "busy machine, slower than baseline"),
                   ("old", None, None, None, None, "")]
    _, got = store.query("SELECT cores, threads, other_load > 0.9 FROM bench")
    assert got == [(2, 2, True)]
