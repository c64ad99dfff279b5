#!/usr/bin/env python
"""The train stage's set-up before its time box (trainer/recipe.py `setup`, online features: the
samples read, tokenised and hashed, then the draft vocab counted), this tree against a baseline
tree (a checkout of the code before, e.g. `git worktree add /tmp/e3-base main`), on the same N
conversations of a spec's carried regenerated set, in the same run; the draft-vocab key (the
identity of every sample's ids and loss mask, and which samples) and mapping must be equal.

    python scripts/bench/bench_setup.py specs/smollm2-pays-gpu.yaml --baseline /tmp/e3-base \\
        --conversations 20000
    python scripts/bench/bench_setup.py specs/smollm2-pays-gpu.yaml --conversations 2000 --json

Each run is its own process (`--child`): the tree's package imported from a folder whose
`eagle3_runner` links to it, the spec with target.device=cpu, stages.train.online_capture=hf,
kernels=torch and prefetch=false (the CPU stand-ins of the GPU spec's), its regenerate input a
shards folder holding N records of stages.regenerate.reuse taken evenly over the whole set (so the
multi-turn conversations at its end are in), a fresh out_dir (no cached vocab). Phases, seconds
(wall): samples = trainer/sources.py open_source (read = targets/capture.py conversations:
shards read and cleaned; target = targets/load.py load_target; tokenise = tokenize_dataset; the
rest: the online source's sample hash and reports), vocab = trainer/vocab.py build_or_load, setup
= the whole `setup`; cpu_self / cpu_children = CPU seconds of the process and of its worker
processes (what a machine with more cores spreads), rss_mb the process's peak resident MB (not
the workers': a spawned child's peak starts at its parent's, which Linux keeps across exec; one
worker peaked at ~0.4 GB on the full pays set). Trees run alternately, --repeats times each;
medians and ratios (baseline / this tree) are printed, and written to --out/bench_setup.json.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]  # this tree (the repository root = the package)
OVERRIDES = ["target.device=cpu", "stages.train.online_capture=hf", "stages.train.kernels=torch",
             "stages.train.prefetch=false"]
PHASES = ("samples", "read", "target", "tokenise", "vocab", "setup")


def write_shards(spec_path: str, n: int, out: Path) -> dict:
    """N records of the spec's carried set, evenly spaced over it in its order, as a regenerate
    artifact's shards under `out` (data/regen_store.py ShardWriter). Returns what was taken."""
    from eagle3_runner.data.regen_store import ShardWriter, read_gz_jsonl
    from eagle3_runner.runner.files import expand_path
    from eagle3_runner.runner.spec.load import load_spec
    spec = load_spec(spec_path, OVERRIDES)
    src = spec.stages.regenerate.reuse
    if not src:
        raise SystemExit(f"{spec_path}: no stages.regenerate.reuse (the carried set to read)")
    src = expand_path(src)
    records = read_gz_jsonl(src)
    step = max(1.0, len(records) / n)
    picked = [records[int(i * step)] for i in range(min(n, len(records)))]
    w = ShardWriter(out, 1024)
    for r in picked:
        w.add(r)
    w.flush()
    turns = sum(sum(m.get("role", m.get("from")) in ("assistant", "gpt") for m in r["messages"])
                for r in picked)
    return {"set": str(src), "set_records": len(records), "records": len(picked),
            "answers": turns}


def child(a) -> int:
    """One timed `setup` of the tree this process imports (module docstring); prints JSON."""
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.runner.stage import StageContext
    from eagle3_runner.trainer import recipe
    import eagle3_runner.data.conversations as DC
    import eagle3_runner.targets.capture as cap
    import eagle3_runner.targets.load as TL
    import eagle3_runner.trainer.vocab as V
    times: dict[str, float] = {}

    def timed(mod, name: str, phase: str) -> None:
        f = getattr(mod, name)

        @functools.wraps(f)
        def g(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                times[phase] = times.get(phase, 0.0) + time.perf_counter() - t
        setattr(mod, name, g)
    timed(recipe, "open_source", "samples")
    timed(cap, "conversations", "read")
    timed(TL, "load_target", "target")
    timed(DC, "tokenize_dataset", "tokenise")
    timed(V, "build_or_load", "vocab")
    spec = load_spec(a.spec, OVERRIDES)
    out = Path(a.child)
    ctx = StageContext(spec=spec, stage="train", variant="base", run_id="bench-setup",
                       inputs={"regenerate": Path(a.shards)}, out_dir=out / "train",
                       db_path=out / "bench.duckdb")
    t = time.perf_counter()
    run = recipe.setup(ctx)
    times["setup"] = time.perf_counter() - t
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the tokenising workers, if any
    d2t = run.learner.model.d2t.detach().cpu().numpy().tobytes()
    print(json.dumps({"times": times, "cpu_self": me.ru_utime + me.ru_stime,
                      "cpu_children": kids.ru_utime + kids.ru_stime,
                      "rss_mb": me.ru_maxrss / 1024,
                      "vocab_key": run.vstats["key"], "d2t_sha256": hashlib.sha256(d2t).hexdigest(),
                      "samples": len(run.source), "supervised": run.vstats["supervised_tokens"],
                      "package": str(Path(recipe.__file__).resolve().parents[1])}))
    return 0


def run_tree(tree: Path, a, shards: Path, tmp: Path) -> dict:
    """`setup` of `tree` in a child process (its package linked as tmp/<n>/eagle3_runner)."""
    link = Path(tempfile.mkdtemp(dir=tmp))
    (link / "eagle3_runner").symlink_to(tree.resolve())
    env = {**os.environ, "PYTHONPATH": str(link)}
    out = Path(tempfile.mkdtemp(dir=tmp))
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), a.spec, "--child", str(out),
                        "--shards", str(shards)], env=env, capture_output=True, text=True,
                       cwd=tree)
    if p.returncode:
        raise SystemExit(f"{tree}: setup failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def commit(tree: Path) -> str | None:
    """The tree's git commit (+ "-dirty" with uncommitted changes), None outside git."""
    git = ["git", "-C", str(tree)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def show(res: dict) -> None:
    """The human form of main's result: the data, then the seconds per phase per tree."""
    data, med, same = res["data"], res["seconds"], res["same_vocab"]
    load0, load1 = res["load_1m"]
    print(f"{data['records']:,} records ({data['answers']:,} answers) of {data['set']} -> "
          f"{res['samples']:,} samples; {res['cpus']} CPUs, 1-min load {load0:.2f} -> "
          f"{load1:.2f}; draft-vocab key {res['vocab_key']} "
          f"{'equal in every run' if same else 'DIFFERS'}")
    print(f"{'seconds':10s}" + "".join(f"{p:>10s}" for p in PHASES + ("cpu_self", "cpu_kids")))
    for k, m in med.items():
        print(f"{k:10s}" + "".join(f"{m[p]:10.2f}" for p in PHASES + ("cpu_self",
                                                                      "cpu_children")))
    if res["ratio"]:
        print(f"{'ratio':10s}" + "".join(f"{res['ratio'].get(p, 0):9.2f}x" for p in PHASES))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n" + __doc__[__doc__.index("    python"):])
    ap.add_argument("spec", help="a spec with stages.regenerate.reuse and an online train stage")
    ap.add_argument("--baseline", type=Path, help="a checkout of the code to compare against")
    ap.add_argument("--conversations", type=int, default=20_000,
                    help="records of the carried set (default 20000), spread over it")
    ap.add_argument("--repeats", type=int, default=1, help="runs per tree (default 1), median")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", type=Path, help="folder for bench_setup.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--shards", help=argparse.SUPPRESS)
    ap.add_argument("--make-shards", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    if a.make_shards:
        print(json.dumps(write_shards(a.spec, a.conversations, Path(a.make_shards))))
        return 0
    if a.conversations < 1 or a.repeats < 1:
        ap.error("--conversations and --repeats must be >= 1")
    trees = {"this": HERE} | ({"baseline": a.baseline} if a.baseline else {})
    a.spec = str(Path(a.spec).resolve())  # the children run in their trees' folders
    with tempfile.TemporaryDirectory(prefix="bench-setup-") as d:
        tmp = Path(d)
        # in a process of its own: a child's peak RSS starts at its parent's (exec keeps it)
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), a.spec, "--make-shards",
                            str(tmp / "regen"), "--conversations", str(a.conversations)],
                           capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"reading {a.spec}'s carried set failed:\n{p.stderr[-3000:]}")
        data = json.loads(p.stdout.strip().splitlines()[-1])
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        load0 = os.getloadavg()[0]
        for _ in range(a.repeats):
            for name in ("baseline", "this"):
                if name in trees:
                    runs[name].append(run_tree(trees[name], a, tmp / "regen", tmp))
        load1 = os.getloadavg()[0]
    med = {k: {p: statistics.median(r["times"].get(p, 0.0) for r in rs) for p in PHASES}
           | {c: statistics.median(r[c] for r in rs)
              for c in ("cpu_self", "cpu_children", "rss_mb")}
           for k, rs in runs.items()}
    same = len({(r["vocab_key"], r["d2t_sha256"], r["samples"]) for rs in runs.values()
                for r in rs}) == 1
    res = {"data": data, "samples": runs["this"][0]["samples"], "cpus": os.cpu_count(),
           "load_1m": [load0, load1], "repeats": a.repeats, "seconds": med, "same_vocab": same,
           "vocab_key": runs["this"][0]["vocab_key"],
           "trees": {k: {"path": str(v), "commit": commit(v)} for k, v in trees.items()},
           "ratio": ({p: med["baseline"][p] / med["this"][p] for p in PHASES if med["this"][p]}
                     if "baseline" in med else None)}
    from eagle3_runner.runner.files import emit_result
    emit_result(res, a.out, "bench_setup.json", a.json, show)
    return 0 if same else 1


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
