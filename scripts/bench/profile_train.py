#!/usr/bin/env python
"""Where the online train step's time goes, phase by phase, before and after the speed switches
(issue 37): on random weights of a target's geometry (no model files), or on a spec's own train
setup (its data, target and drafter).

    python scripts/bench/profile_train.py --random smollm2 --out runs/profile-train  # the H200 set
    python scripts/bench/profile_train.py --random tiny --device cpu --budget 60 --out runs/p
    python scripts/bench/profile_train.py specs/smollm2-scale-gpu-trained.yaml \\
        -o stages.train.kernels=triton --modes before,after --out runs/profile-train

A case = (batch, draft vocab, mode). Batches (--random): b1 = one sample of 2,048 tokens (the
step benchmark's shape); bN = N samples of 16-1,024 tokens (seeded log-normal, mean ~340: the
regenerated conversations' shape at max_length 1024), packed as the stage packs them. Each step
takes the next batch of a pool of 4, so packing and lengths change as in a real run. Weights:
a random HF LlamaForCausalLM of the geometry (bf16 on CUDA; SmolLM2-135M: 30 layers, aux 1/14/26)
and a random drafter, K = 7 (--k). Modes (the switches, all else equal):
  before    capture hf (HF forward, right-padded length groups), pageable host copies, no prefetch
  pinned    + host copies through pinned memory (targets/capture.py h2d: no host sync)
  embedded  + stages.train.online_capture: embedded (targets/capture_embedded.py)
  after     + stages.train.prefetch (the next batch's target forward on a second CUDA stream)
  resident  the step alone on features captured beforehand and kept on the device: the upper
            bound of online training (its tok/s is the "x resident" denominator)
Per case: --warm steps (compiles), then --steps steps back to back without a sync (the stage's
loop): wall ms per step and tokens/s, the host syncs per step that
torch.cuda.set_sync_debug_mode("warn") flags (item(), .cpu(), blocking copies; not the waits of
a copy from pageable memory, which the "pinned" mode removes); per phase the HOST time (what the Python thread spent
enqueueing it, waits for the GPU included) and the GPU TIMELINE time (CUDA events on the step's
stream at the phase boundaries: kernels plus the gaps while the GPU waited for the host). Then
(CUDA, --profile-cases) a torch.profiler window of --profile-steps steps: KERNEL time per phase
(kernels attributed to the phase whose host range launched them, the autograd thread's included)
and kernel launches per step. Phases (exclusive):
  target_forward  the target's decoder over the batch (capture / capture_embedded call)
  gather          the rest of source.batch: hooks' copies, per-sample views, sample dicts
  pack            trainer/fast_step.py pack_samples + the host-to-device copies
  target_head     the target's draft-vocab logits (fast_step target_logits: norm + lm_head)
  draft_forward   fc + the K TTT steps of the drafter (fast_step unroll)
  loss            step masks + the fused soft cross-entropy (its gradient GEMMs included)
  backward        autograd backward through the K steps
  optimizer       grad clipping + AdamW
  host            between steps (the loop)
With prefetch the target forward of step k+1 is enqueued during step k's batch phase on the
side stream: its host time counts as target_forward, its GPU time is off the step's stream.
Writes profile_train.json and profile_train.md into --out after every case (a killed run keeps
what it measured); cases left when --budget seconds are spent are listed as skipped.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

from eagle3_runner.runner.apply import code_version

PHASES = ("target_forward", "gather", "pack", "target_head", "draft_forward", "loss", "backward",
          "optimizer", "host")
OWN = {"batch": "gather", "prepare": "pack", "forward": "loss"}  # a range's own (exclusive) time
NEXT = {"prepare": "forward", "forward": "backward", "backward": "optimizer", "optimizer": None}
MODES = {"before": dict(capture="hf", pinned=False, prefetch=False),
         "pinned": dict(capture="hf", pinned=True, prefetch=False),
         "embedded": dict(capture="embedded", pinned=True, prefetch=False),
         "after": dict(capture="embedded", pinned=True, prefetch=True),
         "resident": dict(capture="embedded", pinned=True, prefetch=False, resident=True)}
# --random: the cases in the order they run (most telling first: a spent --budget costs least)
CASES = [("b64", 32000, m) for m in ("before", "after", "resident")] + \
        [("b1", 32000, m) for m in ("before", "after", "resident")] + \
        [("b64", 16000, m) for m in ("before", "after", "resident")] + \
        [("b1", 16000, m) for m in ("before", "after")] + \
        [("b64", 32000, m) for m in ("pinned", "embedded")] + [("b128", 32000, "after")]
PROFILED = "b64/32000/before,b64/32000/after,b1/32000/before,b1/32000/after"
POOL = 4  # distinct batches per case, taken in turn


# ---------------------------------------------------------------------------------------------
# phase boundaries


class Phases:
    """The phase boundaries of the steps: per boundary the host time, a CUDA event on the
    step's stream (recorded there even while a prefetch has the side stream current) and a
    torch.profiler range "phase:<name>" (record_function) between open and close."""

    def __init__(self, cuda: bool):
        import torch
        self.torch, self.cuda = torch, cuda
        self.stream = torch.cuda.current_stream() if cuda else None
        self.marks: list = []  # (host s, event or None, name, +1 open / -1 close)
        self.open_ranges: list = []

    def _mark(self, name: str, d: int) -> None:
        ev = None
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
        self.marks.append((time.perf_counter(), ev, name, d))

    def open(self, name: str) -> None:
        rf = self.torch.profiler.record_function(f"phase:{name}")
        rf.__enter__()
        self.open_ranges.append(rf)
        self._mark(name, +1)

    def close(self, name: str) -> None:
        self._mark(name, -1)
        self.open_ranges.pop().__exit__(None, None, None)

    def after(self, name: str) -> None:
        """recipe.train_step's mark: phase `name` is enqueued, the next one begins."""
        self.close(name)
        if NEXT[name]:
            self.open(NEXT[name])

    def exclusive(self, steps: int) -> dict:
        """{phase: {"host_ms", "gpu_ms"}} per step: each interval between two boundaries
        belongs to the innermost open range (its own name, or OWN's for batch/prepare/forward;
        "host" outside any). Call after a device sync."""
        out = {p: {"host_ms": 0.0, "gpu_ms": 0.0 if self.cuda else None} for p in PHASES}
        stack: list = []
        for (t0, e0, name, d), (t1, e1, _, _) in zip(self.marks, self.marks[1:]):
            stack.append(name) if d > 0 else stack.pop()
            owner = OWN.get(stack[-1], stack[-1]) if stack else "host"
            out[owner]["host_ms"] += (t1 - t0) * 1e3 / steps
            if self.cuda:
                out[owner]["gpu_ms"] += e0.elapsed_time(e1) / steps
        return out


_ACTIVE: list = []  # the Phases the instrumented functions report to (empty: they only run)


def _wrapped(real, name):
    def run(*a, **kw):
        if not _ACTIVE:
            return real(*a, **kw)
        _ACTIVE[-1].open(name)
        try:
            return real(*a, **kw)
        finally:
            _ACTIVE[-1].close(name)
    run.phase = name
    return run


def instrument() -> None:
    """Report the nested phases: the target forward (both captures), the target head and the
    drafter's forward are module functions the step calls by name; wrap them once (the real
    function runs; it reports to _ACTIVE[-1] when one is set)."""
    from eagle3_runner.targets.capture import TargetData
    from eagle3_runner.targets.capture_embedded import EmbeddedCapture
    from eagle3_runner.trainer import fast_step as F
    for owner, attr, name in ((TargetData, "capture_batch", "target_forward"),
                              (EmbeddedCapture, "__call__", "target_forward"),
                              (F, "target_logits", "target_head"), (F, "unroll", "draft_forward")):
        if not hasattr(getattr(owner, attr), "phase"):
            setattr(owner, attr, _wrapped(getattr(owner, attr), name))


def kernel_split(prof, steps: int) -> tuple[dict, float, float]:
    """(kernel ms per phase per step, all kernel ms per step, launches per step) of a
    torch.profiler run: each CPU op's kernels go to the innermost "phase:" range whose host time
    span holds the op's start (the autograd engine's thread included: its ops run while the
    main thread is inside `backward`)."""
    ev = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[6:]) for e in ev
                    if e.name.startswith("phase:") and e.device_type.name == "CPU")
    notes = {e.name for e in ev if e.is_user_annotation}  # their GPU spans are no kernels
    out = {p: 0.0 for p in PHASES}
    total, launches = 0.0, 0
    for e in ev:
        ks = [k for k in getattr(e, "kernels", None) or [] if k.name not in notes]
        if e.device_type.name != "CPU" or not ks:
            continue
        t = e.time_range.start
        inner = [r for r in ranges if r[0] <= t <= r[1]]
        name = max(inner)[2] if inner else None
        owner = OWN.get(name, name) if name else "host"
        us = sum(k.duration for k in ks)
        out[owner] += us / 1e3 / steps
        total += us / 1e3 / steps
        launches += len(ks)
    return out, total, launches / steps


# ---------------------------------------------------------------------------------------------
# what a case runs


def random_setup(a) -> SimpleNamespace:
    """The random target of the geometry (HF LlamaForCausalLM); token pools come from `pool`."""
    import torch
    import bench_train as bt
    from transformers import LlamaConfig, LlamaForCausalLM
    g, t = bt.GEOMETRIES[a.random], bt.TARGETS[a.random]
    cfg = LlamaConfig(**{k: g[k] for k in ("hidden_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim",
                                           "intermediate_size", "vocab_size")},
                      num_hidden_layers=t["num_hidden_layers"], max_position_embeddings=8192,
                      tie_word_embeddings=True)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    with dev:
        target = LlamaForCausalLM(cfg).to(torch.bfloat16 if dev.type == "cuda" else
                                          torch.float32).eval().requires_grad_(False)
    return SimpleNamespace(target=target, cfg=cfg, aux=t["aux"], toks={}, geometry=a.random,
                           dev=dev, seq=a.seq, cpu=dev.type == "cpu")


def pool(r: SimpleNamespace, batch: str) -> list:
    """The POOL batches of case batch "b<N>" as (token ids, loss mask) samples, N per batch:
    b1 = samples of --seq tokens; N > 1: seeded log-normal lengths in [16, seq/2] (mean ~340;
    on the CPU, the test's 4..seq-1). Made once per name."""
    import torch
    if batch not in r.toks:
        n = int(batch[1:])
        gen = torch.Generator().manual_seed(n)
        if n == 1:
            lens = [r.seq] * POOL
        elif r.cpu:
            lens = [4 + (7 * i) % (r.seq - 4) for i in range(min(n, 8) * POOL)]
        else:
            lens = [max(16, min(r.seq // 2, int(math.exp(5.5 + 0.8 * float(
                torch.randn(1, generator=gen)))))) for _ in range(n * POOL)]
        V = r.cfg.vocab_size
        r.toks[batch] = [(torch.randint(0, V, (m,), generator=gen).tolist(), [1] * m)
                         for m in lens]
    return r.toks[batch]


def random_case(r: SimpleNamespace, a, batch: str, vocab: int, mode: dict) -> SimpleNamespace:
    """A case's learner (a fresh random drafter of draft vocab `vocab`), source and step ids."""
    import bench_train as bt
    from eagle3_runner.targets.capture import TargetData
    from eagle3_runner.trainer.sources import Online
    s = bt._setup(dict(device=a.device, geometry=r.geometry, vocab=vocab, seq=2, batch=1, K=a.k))
    learner = bt._learner(s, bt._impl(s, "triton" if r.dev.type == "cuda" else "torch"))
    toks = pool(r, batch)
    td = TargetData(r.target, None, r.cfg.to_dict(), toks, {}, {}, 0)
    src = Online(td, r.aux, "profile", mode["capture"])
    per = len(toks) // POOL
    return SimpleNamespace(learner=learner, source=src,
                           ids=lambda k: list(range((k % POOL) * per, (k % POOL + 1) * per)))


def spec_setup(a):
    """The spec's own train setup (recipe.setup: data, target, drafter, kernels)."""
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.runner.stage import StageContext
    from eagle3_runner.trainer.recipe import setup
    spec = load_spec(a.spec, a.overrides)
    tmp = Path(tempfile.mkdtemp(prefix="profile-train-"))
    atexit.register(shutil.rmtree, tmp, True)  # the setup's scratch goes whatever happens
    ctx = StageContext(spec=spec, stage="train", variant="base", run_id="profile", inputs={},
                       out_dir=tmp / "train", db_path=tmp / "profile.duckdb")
    return setup(ctx)


def spec_case(run, mode: dict) -> SimpleNamespace:
    """The spec's learner and batches; online, a source with the mode's capture."""
    from eagle3_runner.trainer.recipe import step_ids
    from eagle3_runner.trainer.sources import Online
    src = run.source
    if isinstance(src, Online) and src.capture != mode["capture"]:
        src = Online(src.td, src.aux_ids, src.where, mode["capture"])
    return SimpleNamespace(learner=run.learner, source=src, ids=lambda k: step_ids(run, k)[0])


def measure(c: SimpleNamespace, mode: dict, a, profiled: bool) -> dict:
    """Warm-up, the timed steps (phases), the profiler window: the case's numbers."""
    import torch
    from eagle3_runner.targets import capture as C
    from eagle3_runner.trainer.recipe import train_step
    from eagle3_runner.trainer.sources import Prefetch
    cuda = c.learner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    C.PINNED_H2D = mode["pinned"]
    feed = Prefetch(c.source, c.learner.device) if mode["prefetch"] else None
    resident = {}
    if mode.get("resident"):  # features captured once, kept on the device
        resident = {k: c.source.batch(c.ids(k)) for k in range(POOL)}

    def step(k, ph):
        if resident:
            samples = resident[k % POOL]
        else:
            ph.open("batch")
            samples = (feed.batch(c.ids(k), c.ids(k + 1)) if feed else c.source.batch(c.ids(k)))
            ph.close("batch")
        ph.open("prepare")
        out = train_step(c.learner, samples, mark=ph.after)
        return out, sum(int(x["input_ids"].numel()) for x in samples)

    t0 = time.perf_counter()
    ph = Phases(cuda)
    _ACTIVE.append(ph)
    try:
        first = step(0, ph)[0]
        for k in range(1, a.warm):
            step(k, ph)
        sync()
        warm_s = time.perf_counter() - t0
        ph = _ACTIVE[-1] = Phases(cuda)
        toks, t0 = 0, time.perf_counter()
        with warnings.catch_warnings(record=True) as syncs:  # what set_sync_debug_mode flags
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for k in range(a.steps):
                    toks += step(a.warm + k, ph)[1]
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        sync()
        wall = (time.perf_counter() - t0) / a.steps
        flagged = [str(w.message) for w in syncs if "synchroniz" in str(w.message)]
        phases = ph.exclusive(a.steps)
        kernels = None
        if cuda and profiled and a.profile_steps:
            from torch.profiler import ProfilerActivity, profile
            ph = _ACTIVE[-1] = Phases(cuda)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for k in range(a.profile_steps):
                    step(a.warm + a.steps + k, ph)
                sync()
            kernels = kernel_split(prof, a.profile_steps)
    finally:
        _ACTIVE.clear()
        C.PINNED_H2D = True
    res = {"loss_first": float(first.loss), "warm_s": warm_s, "wall_ms": wall * 1e3,
           "tokens_per_step": toks / a.steps, "tok_s": toks / a.steps / wall,
           "host_syncs_per_step": len(flagged) / a.steps if cuda else None,
           "sync_examples": sorted(set(m[:120] for m in flagged))[:3], "phases": phases}
    if kernels:
        for p, ms in kernels[0].items():
            res["phases"][p]["kernel_ms"] = ms
        res["kernel_ms"], res["launches"] = kernels[1], kernels[2]
    if cuda:
        res["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return res


# ---------------------------------------------------------------------------------------------
# tables


def markdown(rows: list[dict], meta: dict) -> str:
    def f(x, fmt="{:.1f}"):
        return "" if x is None else fmt.format(x)
    ok = [r for r in rows if "error" not in r]
    ref = {(r["batch"], r["vocab"]): r["tok_s"] for r in ok if r["mode"] == "before"}
    res = {(r["batch"], r["vocab"]): r["tok_s"] for r in ok if r["mode"] == "resident"}
    md = [f"### profile_train on {meta['device_name']}", "",
          f"{meta['what']}; K = {meta['k']}; {meta['warm']} warm-up steps, {meta['steps']} timed "
          f"steps back to back, profiler over {meta['profile_steps']}; torch {meta['torch']}, "
          f"commit {meta['commit']}; {meta['seconds']:.0f} s.", "",
          "| batch | draft vocab | mode | tokens/step | ms/step | tok/s | x before | x resident "
          "| kernel ms/step | launches/step | syncs/step | peak MiB | first loss |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['batch']} | {r['vocab']} | {r['mode']} |"
        if "error" in r:
            md.append(f"{head} {r['error'][:90]} | | | | | | | | | |")
            continue
        k = (r["batch"], r["vocab"])
        xb = f(r["tok_s"] / ref[k], "{:.2f}") if k in ref else ""
        xr = f(r["tok_s"] / res[k], "{:.2f}") if k in res and r["mode"] != "resident" else ""
        md.append(f"{head} {r['tokens_per_step']:.0f} | {r['wall_ms']:.1f} | {r['tok_s']:,.0f} | "
                  f"{xb} | {xr} | {f(r.get('kernel_ms'))} | {f(r.get('launches'), '{:.0f}')} | "
                  f"{f(r.get('host_syncs_per_step'))} | {f(r.get('peak_mib'), '{:.0f}')} | "
                  f"{r['loss_first']:.4f} |")
    for key, what in (("host_ms", "host ms per step (the Python thread, waits for the GPU "
                                  "included)"),
                      ("gpu_ms", "GPU timeline ms per step (CUDA events on the step's stream: "
                                 "kernels + the gaps waiting for the host)"),
                      ("kernel_ms", "kernel ms per step (torch.profiler, by launching phase)")):
        have = [r for r in ok if any(v.get(key) is not None for v in r["phases"].values())]
        if not have:
            continue
        md += ["", f"{what}:", "", "| batch | vocab | mode | " + " | ".join(PHASES) + " |",
               "|---|---|---|" + "---|" * len(PHASES)]
        md += [f"| {r['batch']} | {r['vocab']} | {r['mode']} | " + " | ".join(
            f(r["phases"][p].get(key)) for p in PHASES) + " |" for r in have]
    return "\n".join(md) + "\n"




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("    python"):])
    ap.add_argument("spec", nargs="?", help="a spec: profile its own train setup")
    ap.add_argument("-o", dest="overrides", action="append", default=[],
                    help="a spec override, as runner apply's -o (repeatable)")
    ap.add_argument("--random", choices=["smollm2", "tiny"],
                    help="random weights of this target geometry instead of a spec")
    ap.add_argument("--device", default="cuda", help="--random: cuda or cpu")
    ap.add_argument("--k", type=int, default=7, help="--random: TTT steps")
    ap.add_argument("--seq", type=int, default=2048, help="--random: b1's sample length (b64's "
                    "lengths stop at half of it)")
    ap.add_argument("--cases", default=None, help="--random: batch/vocab/mode,... (default: "
                    "CASES); spec: the modes, e.g. before,after")
    ap.add_argument("--modes", default="before,after", help="spec: the modes")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case")
    ap.add_argument("--warm", type=int, default=3, help="steps before timing (compiles)")
    ap.add_argument("--profile-steps", type=int, default=2, help="torch.profiler window (CUDA)")
    ap.add_argument("--profile-cases", default=PROFILED,
                    help="cases with a profiler window (batch/vocab/mode,...; all: every case)")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds for all cases; the ones left are reported as skipped")
    ap.add_argument("--out", default="runs/profile-train")
    a = ap.parse_args(argv)
    if (a.spec is None) == (a.random is None):
        ap.error("give a spec or --random GEOMETRY (not both)")
    if a.warm < 1 or a.steps < 1:
        ap.error("--warm and --steps must be >= 1")

    import torch
    t_start, t_end = time.perf_counter(), time.perf_counter() + a.budget
    instrument()
    if a.random:
        r = random_setup(a)
        cases = ([tuple(x.split("/")) for x in a.cases.split(",")] if a.cases else CASES)
        cases = [(b, int(v), m) for b, v, m in cases]
        make = lambda b, v, m: random_case(r, a, b, v, MODES[m])  # noqa: E731
        b = pool(r, "b64")
        what = (f"random weights of {a.random}'s geometry ({r.cfg.num_hidden_layers} layers, "
                f"aux {r.aux}); b1 = 1 x {a.seq} tokens, bN = N samples of "
                f"{min(len(t) for t, _ in b)}-{max(len(t) for t, _ in b)} tokens (b64: mean "
                f"{sum(len(t) for t, _ in b) / len(b):.0f})")
        device = r.dev
    else:
        run = spec_setup(a)
        p = run.ctx.params
        cases = [(f"b{p.batch_size}", run.cfg.draft_vocab_size, m) for m in a.modes.split(",")]
        make = lambda b, v, m: spec_case(run, MODES[m])  # noqa: E731
        what = f"{a.spec} {' '.join(a.overrides)} (its data, target and drafter)"
        device = run.learner.device
    for _, _, m in cases:
        if m not in MODES:
            ap.error(f"mode {m!r}: one of {sorted(MODES)}")
    profiled = ({f"{b}/{v}/{m}" for b, v, m in cases} if a.profile_cases == "all"
                else set(a.profile_cases.split(",")))
    meta = {"what": what, "k": a.k if a.random else run.ctx.params.ttt_steps, "warm": a.warm,
            "steps": a.steps, "profile_steps": a.profile_steps, "torch": torch.__version__,
            "commit": code_version(), "device_name": (torch.cuda.get_device_name(device)
                                                if device.type == "cuda" else "CPU")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for b, v, m in cases:
        row = {"batch": b, "vocab": v, "mode": m}
        if time.perf_counter() > t_end:
            row["error"] = "skipped: --budget spent"
        else:
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                row.update(measure(make(b, v, m), MODES[m], a, f"{b}/{v}/{m}" in profiled))
            except Exception as e:  # noqa: BLE001 - a failed case is a row, the rest still run
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        rows.append(row)
        print(f"{b} {v} {m}: " + (row.get("error") or f"{row['tok_s']:,.0f} tok/s, "
              f"{row['wall_ms']:.1f} ms/step (warm-up {row['warm_s']:.1f} s)"), flush=True)
        meta["seconds"] = time.perf_counter() - t_start
        (out / "profile_train.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "profile_train.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
