"""The CPU cores a stage process gets: how many threads torch uses and how they wait
(`stage_threads`, called for every stage before its code runs), and how busy the machine was while
the bench measured (`Meter`, `load_columns`; the `busy machine` flag, runner/bench_rows.py); a
set-up block without the cyclic garbage collector (`gc_paused`). No torch: a torch already
imported is reached through sys.modules.

Why (issue 48, "The first hour, round three"): a newcomer ran the demo on 2 CPU cores while ONE
other CPU job shared them. Its bench went from ~3.5 s to 117-170 s per prompt (30-50x), the demo
from 5:22 to 34:50, and the break-even taus it printed (7.89 / 4.09 / 3.88 against 1.61 / 1.62 /
1.67 idle) came out in the opposite order. Torch's intra-op pool (GNU OpenMP, which MKL's
threading layer shares) had one thread per core, and its threads spin-wait at the end of every
parallel region for the thread the other job keeps off its core; a decode step is hundreds of
small parallel regions, and each then waits for a scheduler time slice. So:
- threads = the cores this process gets: its CPU affinity (os.sched_getaffinity: taskset, Slurm
  and container cpusets; os.cpu_count counts the whole machine), SMT siblings counted once (as
  torch's own default, MKL's physical cores, does), at most a cgroup CPU quota (cpu.max), shared
  by the ranks of this node when they are not pinned (LOCAL_WORLD_SIZE);
- waiting threads sleep instead of spinning: OMP_WAIT_POLICY=PASSIVE, and for GNU OpenMP
  GOMP_SPINCOUNT=1000 (a short spin before the sleep instead of 300,000; PASSIVE alone, spin
  count 0, made the idle speculative decode ~20% slower). The demo's bench alone on 2 cores, s
  per prompt of the 3-step chain, before -> after (BENCHMARKS.md, issue 48): idle 2.8 -> 2.8-3.0;
  next to one `while 1: pass` 8.8-9.7 -> 4.0-4.1; next to a 2-thread torch job 14-15 -> 4.9-5.2.
  libgomp reads these once, when it loads: so `stage_threads` runs before a stage process first
  imports torch (runner/job.py run_stage, runner/launch.py), and again once torch is in, to size
  it; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept;
- EAGLE3_THREADS picks the count: `auto` (the default, the rule above), `load` (auto minus the
  cores other processes keep busy right now, measured over 0.3 s), or a number. An OMP_NUM_THREADS
  set by the user (Slurm jobs: cpus_per_task) is taken as that number when EAGLE3_THREADS is unset.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eagle3_runner.runner.errors import StageError

ENV = "EAGLE3_THREADS"
WAITS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}  # module docstring: measured
SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
PROC_STAT = Path("/proc/stat")
LOAD_WINDOW_S = 0.3

BUSY_CORES = 0.5
"""Cores' worth of CPU time other processes used, on average, on this process's cores while a
bench row was measured, at or above which the row is flagged `busy machine`: one other CPU job
uses ~1.0; an idle machine's daemons a few hundredths."""


def _affinity() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _physical(cpus: list[int]) -> int:
    """Cores among logical CPUs `cpus`, SMT siblings counted once (each CPU its own core when
    the topology is unreadable)."""
    seen = set()
    for c in cpus:
        try:
            seen.add((SYS_CPU / f"cpu{c}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            seen.add(f"cpu{c}")
    return max(1, len(seen))


def _quota() -> float | None:
    """The cgroup v2 CPU quota in cores ("200000 100000" = 2.0), None when unlimited or
    unreadable."""
    try:
        q, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if q == "max" else int(q) / int(period)
    except (OSError, ValueError):
        return None


def local_ranks() -> int:
    """The ranks of a data-parallel stage on this node (LOCAL_WORLD_SIZE, set by torchrun and by
    runner/launch.py), 1 outside one."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def cores(ranks: int | None = None, physical: bool = True) -> int:
    """The cores this process gets: its CPU affinity (physical cores, SMT siblings counted once;
    physical=False: logical CPUs), at most the cgroup CPU quota (rounded up), divided among
    `ranks` (default local_ranks()) when the process is not pinned to its own share (the local
    launcher and torchrun do not pin; Slurm may)."""
    ranks = local_ranks() if ranks is None else max(1, ranks)
    cpus = _affinity()
    n = _physical(cpus) if physical else len(cpus)
    quota = _quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    pinned = len(cpus) < (os.cpu_count() or len(cpus))
    return max(1, n if pinned else n // ranks)


def stage_threads(environ=None) -> tuple[int | None, str]:
    """Make idle threads sleep and size torch's threads to the cores this process gets (module
    docstring: why). Sets WAITS (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000) unless the user set
    either (libgomp reads them once, when torch loads it), then, once torch is loaded,
    torch.set_num_threads(threads_wanted()). No thread count goes into the environment, so
    processes this one starts (SGLang servers) size their own.
    Called by runner/job.py run_stage for every stage and rank before the stage's module is
    loaded (which imports torch) and again after; runner/launch.py before and after a rank
    imports torch; jobs/bench.py after its own (lazy) import of torch. Returns (threads, why),
    e.g. (2, "2 cores (EAGLE3_THREADS auto)"); (None, ...) while torch is not loaded. Raises
    StageError for a bad EAGLE3_THREADS."""
    env = os.environ if environ is None else environ
    if not any(k in env for k in WAITS):
        env.update(WAITS)
    mode = _mode(env)
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "set_num_threads"):
        return None, f"torch not loaded yet ({ENV} {mode})"
    n, why = threads_wanted(env)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n, why


def _mode(env) -> str:
    mode = (env.get(ENV) or "auto").strip().lower()
    if mode in ("auto", "load") or (mode.isdigit() and int(mode) > 0):
        return mode
    raise StageError(f"{ENV}={env.get(ENV)!r}: expected auto (the cores this process gets), "
                     "load (those minus the ones other processes keep busy), or a number of "
                     "threads")


def threads_wanted(environ=None) -> tuple[int, str]:
    """(threads, why) by EAGLE3_THREADS: a number; `load`: cores() minus the cores other
    processes keep busy now (busy_elsewhere), at least 1; `auto` or unset: OMP_NUM_THREADS when
    the user set it, else cores()."""
    env = os.environ if environ is None else environ
    mode = _mode(env)
    if mode.isdigit():
        return int(mode), f"{ENV}={mode}"
    n = cores()
    if mode == "load":
        other = busy_elsewhere()
        if other is None:
            return n, f"{n} cores ({ENV} load: the load is unreadable here)"
        return max(1, n - round(other)), f"{n} cores, {other:.1f} busy elsewhere ({ENV} load)"
    user = (env.get("OMP_NUM_THREADS") or "").strip()
    if user.isdigit() and int(user) > 0:
        return int(user), f"OMP_NUM_THREADS={user}"
    return n, f"{n} cores ({ENV} auto)"


# ----------------------------------------------------------------------------------------------
# how busy the machine is


def _busy_s(cpus: list[int]) -> float | None:
    """CPU seconds spent busy (user, nice, system, irq, softirq, steal: everything but idle and
    iowait) on the logical CPUs `cpus` since boot, from /proc/stat; None when unreadable."""
    try:
        lines = PROC_STAT.read_text().splitlines()
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    want, ticks = {f"cpu{c}" for c in cpus}, 0
    for line in lines:
        f = line.split()
        if f and f[0] in want:
            v = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
            ticks += sum(v) - v[3] - v[4]
    return ticks / hz if ticks else None


@dataclass(frozen=True)
class Snapshot:
    wall: float  # time.perf_counter()
    own_cpu: float  # time.process_time(): this process, all its threads
    busy: float | None  # _busy_s on its CPUs
    load: float | None  # os.getloadavg()[0]


class Meter:
    """Snapshots of this process's CPU time and its cores' busy time; `window(a, b)` = what
    other processes used in between."""

    def __init__(self):
        self.cpus = _affinity()

    def snap(self) -> Snapshot:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            load = None
        return Snapshot(time.perf_counter(), time.process_time(), _busy_s(self.cpus), load)

    @staticmethod
    def window(a: Snapshot, b: Snapshot) -> dict:
        """{"wall_s", "other_cpu_s": CPU seconds other processes used on these cores between a
        and b (None when /proc/stat is unreadable), "load_1m": the larger 1-min load average}."""
        other = None
        if a.busy is not None and b.busy is not None:
            other = max(0.0, (b.busy - a.busy) - (b.own_cpu - a.own_cpu))
        loads = [x for x in (a.load, b.load) if x is not None]
        return {"wall_s": b.wall - a.wall, "other_cpu_s": other,
                "load_1m": max(loads) if loads else None}


def busy_elsewhere(window_s: float = LOAD_WINDOW_S) -> float | None:
    """Cores' worth of CPU other processes use on this process's cores, over window_s seconds
    now; None when /proc/stat is unreadable."""
    m = Meter()
    a = m.snap()
    time.sleep(window_s)
    w = m.window(a, m.snap())
    return None if w["other_cpu_s"] is None else w["other_cpu_s"] / max(w["wall_s"], 1e-9)


def load_columns(windows: list[dict], threads: int, n_cores: int) -> dict:
    """The bench columns of a measurement made of Meter windows: cores (this process's),
    threads (torch's), other_load (cores' worth of CPU other processes used on those cores,
    averaged over the windows' wall time; NULL when /proc/stat is unreadable), load_1m (the
    largest 1-min load average seen)."""
    wall = sum(w["wall_s"] for w in windows)
    others = [w["other_cpu_s"] for w in windows]
    loads = [w["load_1m"] for w in windows if w["load_1m"] is not None]
    return {"cores": n_cores, "threads": threads,
            "other_load": (sum(others) / wall if windows and None not in others and wall > 0
                           else None),
            "load_1m": max(loads) if loads else None}


def busy(cols: dict | None) -> bool:
    """Whether a measurement (load_columns) was made on a busy machine: other processes used
    BUSY_CORES or more of its cores; where that is unknown (no /proc/stat), its 1-min load
    average exceeds its own threads by BUSY_CORES (the load average counts this process's
    running threads too, and lags by about a minute)."""
    if not cols:
        return False
    if cols.get("other_load") is not None:
        return cols["other_load"] >= BUSY_CORES
    load, threads = cols.get("load_1m"), cols.get("threads") or 0
    return load is not None and load - threads >= BUSY_CORES


def busy_text(cols: dict) -> str:
    """The explanation's sentence for a busy-machine measurement."""
    what = (f"other processes used {cols['other_load']:.2f} of this process's {cols['cores']} "
            f"cores on average" if cols.get("other_load") is not None else
            f"the 1-min load average reached {cols['load_1m']:.2f} with {cols['threads']} "
            "threads of this process")
    load = "" if cols.get("load_1m") is None else f", 1-min load {cols['load_1m']:.2f}"
    return (f" Busy machine: {what} while this was measured ({cols['threads']} torch threads"
            f"{load}): these times measure the machine, not the drafter; bench again on an idle "
            "machine (runner apply SPEC --force bench --only bench).")


@contextmanager
def gc_paused() -> Iterator[None]:
    """The block without Python's cyclic garbage collector (its state restored after; nested
    blocks keep it off). For set-up code that builds millions of lists, dicts and tuples that
    live on (a stage's conversations, token ids, offsets and loss masks): a collection walks
    every tracked object still alive, the live set grows as they are built, and the collector
    took a sixth of the train stage's set-up on 109k regenerated conversations (BENCHMARKS.md).
    Reference counting frees everything acyclic as before; reference cycles left in the block
    wait for the collector's next run after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
