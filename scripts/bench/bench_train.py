#!/usr/bin/env python
"""Drafter training throughput (tokens/s), peak memory and first-step loss of one optimizer step:
the reference step (baseline), the train stage's fast step, online training (the target in the
loop) and, with --specforge, SpecForge 0.2.0's own step, on the same shapes, weights and batch,
in one run.

    python scripts/bench/bench_train.py --device cpu --out runs/bench-train            # small grid
    python scripts/bench/bench_train.py --suite issue17 --out runs/bench-train          # the H200 set
    python scripts/bench/bench_train.py --suite issue37 --out runs/bench-train          # Kimi-K2.5
    python scripts/bench/bench_train.py --device cuda --geometry smollm2 --ks 7 --seqs 2048 \\
        --vocabs 32000 --batches 1,4 --specforge --online --out runs/bench-train

Steps (rows, `kind`), each jobs/train.py train_step (batch, target side, loss, backward, grad
clipping, AdamW) on a Learner:
- baseline: impl None, the reference objective (trainer/objective.py: right-padded batch, target
  distribution = norm + full-vocab lm_head + draft-vocab softmax in float32, K unrolled TTT
  steps with the T x T score matrix, log_softmax CE).
- fast-<attn>: the train stage's step (trainer/fast_step.py: packed rows, draft-vocab target logits
  in the head's dtype, TTT attention `attn` = triton | flex | torch, fused chunked soft CE; on
  CUDA the Triton CE and torch.compile'd layer pieces); the features come from host memory, as
  offline training reads them (`x offline` of the online rows divides by this row).
- online (--online): features: online, the fast step fed by trainer/sources.py Online: every
  step runs a random target of the geometry (HF LlamaForCausalLM, bf16 on CUDA; smollm2 and
  tiny only) over the batch and captures its aux and last hidden states (targets/capture.py).
  Its loss differs from the other rows' (real target features, not random ones).
- specforge: specforge.algorithms.eagle3.model.OnlineEagle3Model(LlamaForCausalLMEagle3(...,
  attention_backend="flex_attention"), length=K) loaded with the same weights, fed input_ids,
  attention_mask, loss_mask [B, N, 1] (our trained-position mask), aux hidden and the target's
  full-vocab logits [B, N, V] (computed once, OUTSIDE the timed step, which favours it); loss =
  sum_j 0.8^j ploss_j. CUDA only. SpecForge divides each step's loss by all B*N positions, we
  by the trained ones: `loss` of its row is renormalised to our definition (`loss_raw` is its
  own number).
All rows: bf16 autocast with float32 weights on CUDA, float32 on the CPU; random features of the
chosen target geometry (throughput does not depend on content), B samples of `seq` tokens.
tokens/s = B x seq / median step time (after --warmup steps; CUDA synchronised); each token runs
all K draft steps. loss = the first step's loss (identical weights and batch in every row).
Peak memory: CUDA = torch.cuda.max_memory_allocated during the measured steps (`step` = minus
what was allocated before: weights, AdamW state, target head, batch); CPU = the process's max RSS
(each row runs in its own subprocess, killed after --row-timeout seconds; rows left when
--budget seconds are spent are reported as skipped). The grid varies one factor at a time around
--base; --suite issue17 is exactly issue 17's H200 set (SUITES).
Writes bench_train.json and bench_train.md into --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from eagle3_runner.runner.apply import code_version


GEOMETRIES = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152),
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256),
    # the drafter of specs/drafter-v2.yaml (fc 21504 -> 7168)
    "kimi-k2.5": dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64,
                      head_dim=128, intermediate_size=18432, vocab_size=163840),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=512),  # the CPU test's
}
DEFAULTS = {"cpu": dict(base="3,256,8192", ks="1,3,7", seqs="128,256,512", vocabs="2048,8192,32000",
                        batches="1", warmup=1, iters=3, attn="torch"),
            "cuda": dict(base="7,2048,32000", ks="1,3,5,7,10", seqs="512,1024,2048,4096",
                         vocabs="8192,16384,32000,65536", batches="1", warmup=2, iters=5,
                         attn="triton,flex")}
DECAY, CLIP, EPS = 0.8, 0.5, 1e-5


def _setup(cfg: dict) -> SimpleNamespace:
    """Weights, target head, draft vocab and samples: the same for every kind (same seed)."""
    import torch
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    dev = torch.device(cfg["device"])
    g = GEOMETRIES[cfg["geometry"]]
    H, V, Vd, T, B = g["hidden_size"], g["vocab_size"], cfg["vocab"], cfg["seq"], cfg["batch"]
    torch.manual_seed(0)
    c = DraftConfig(**g, draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[1, 2, 3])
    hdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        head = {"norm": torch.ones(H, dtype=hdt), "lm_head": (torch.randn(V, H) * 0.02).to(hdt)}
        model = Eagle3Draft(c, torch.randn(V, H) * 0.02)
    used = torch.randperm(V)[:Vd].sort().values
    model.d2t.copy_(used - torch.arange(Vd))
    model.t2d[used.to(dev)] = True
    fdt = hdt  # features as extract writes them: float32 on the CPU, bf16 on CUDA
    samples = [{"input_ids": torch.randint(0, V, (T,)),
                "loss_mask": torch.ones(T, dtype=torch.uint8),
                "aux_hidden": torch.randn(T, 3 * H).to(fdt),
                "last_hidden": torch.randn(T, H).to(fdt)} for _ in range(B)]
    return SimpleNamespace(dev=dev, model=model.train(), head=head, used=used.to(dev),
                           samples=samples, K=cfg["K"], cfg=c)


def _autocast(dev):
    import torch
    if dev.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def _learner(s: SimpleNamespace, impl):
    """The train stage's Learner over the bench weights (impl None = the reference objective)."""
    import torch
    from eagle3_runner.trainer import fast_step as FT
    from eagle3_runner.trainer.recipe import Learner
    opt = torch.optim.AdamW(s.model.parameters(), lr=1e-4)
    p = SimpleNamespace(ttt_steps=s.K, step_decay=DECAY, grad_clip=CLIP, loss="kl", lk_eta=3.0,
                        noise_std=0.0)
    head = s.head if impl is None else FT.split_head(s.head, s.used)
    s.head = None  # the split holds the same bytes
    return Learner(s.model, opt, p, head, s.used, s.model.t2d, EPS, s.dev, impl=impl)


def _impl(s: SimpleNamespace, attn: str):
    from eagle3_runner.trainer import fast_step as FT
    cuda = s.dev.type == "cuda"
    return FT.Impl(attn, "triton" if cuda else "torch", "inductor" if cuda else None)


def _baseline(s: SimpleNamespace):
    from eagle3_runner.trainer.recipe import train_step
    learner = _learner(s, None)
    return lambda: train_step(learner, s.samples).loss


def _fast(s: SimpleNamespace, attn: str):
    from eagle3_runner.trainer.recipe import train_step
    learner = _learner(s, _impl(s, attn))
    return lambda: train_step(learner, s.samples).loss


TARGETS = {"smollm2": dict(num_hidden_layers=30, aux=[1, 14, 26]),  # SmolLM2-135M
           "tiny": dict(num_hidden_layers=4, aux=[0, 1, 2])}


def _online(s: SimpleNamespace, geometry: str):
    """The fast step fed by the online source over a random target of the geometry."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from eagle3_runner.targets.capture import TargetData
    from eagle3_runner.trainer.recipe import train_step
    from eagle3_runner.trainer.sources import Online
    if geometry not in TARGETS:
        raise RuntimeError(f"no target geometry for {geometry} (online rows: {sorted(TARGETS)})")
    g = GEOMETRIES[geometry]
    t = TARGETS[geometry]
    cfg = LlamaConfig(**{k: g[k] for k in ("hidden_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim",
                                           "intermediate_size", "vocab_size")},
                      num_hidden_layers=t["num_hidden_layers"], max_position_embeddings=8192,
                      tie_word_embeddings=True)
    with torch.device(s.dev):
        target = LlamaForCausalLM(cfg).to(torch.bfloat16 if s.dev.type == "cuda"
                                          else torch.float32).eval().requires_grad_(False)
    toks = [(x["input_ids"].tolist(), x["loss_mask"].tolist()) for x in s.samples]
    src = Online(TargetData(target, None, cfg.to_dict(), toks, {}, {}, 0), t["aux"], "bench")
    s.samples = None  # the features come from the target now
    learner = _learner(s, _impl(s, "triton" if s.dev.type == "cuda" else "torch"))
    ids = list(range(len(toks)))
    return lambda: train_step(learner, src.batch(ids)).loss


def _specforge(s: SimpleNamespace):
    if s.dev.type != "cuda":
        raise RuntimeError("the SpecForge step needs CUDA (its loss is a Triton kernel)")
    import torch
    from transformers import LlamaConfig
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from eagle3_runner.trainer import fast_step as FT
    from eagle3_runner.trainer.objective import make_batch
    with torch.device(s.dev):
        sf = LlamaForCausalLMEagle3(LlamaConfig(**s.cfg.to_sglang()),
                                    attention_backend="flex_attention")
    missing, unexpected = sf.load_state_dict(s.model.state_dict(), strict=False)
    if list(missing) != ["embed_tokens.weight"] or unexpected:
        raise RuntimeError(f"SpecForge weights: missing {missing}, unexpected {unexpected}")
    sf.embed_tokens.weight.data.copy_(s.model.embed_tokens)
    sf.embed_tokens.weight.requires_grad_(False)  # frozen, as ours
    b = {k: (v.to(s.dev) if torch.is_tensor(v) else v)
         for k, v in make_batch(s.samples, s.K).items()}
    B, N = b["aux"].shape[:2]
    with torch.no_grad():  # the target's full-vocab logits at positions 1..N (our alignment)
        h = b["tgt_hidden"][:, :N].float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * s.head["norm"].float())
        target = h.to(s.head["lm_head"].dtype) @ s.head["lm_head"].T  # [B, N, V]
    fb, ft = FT.prepare(s.samples, s.K, FT.split_head(s.head, s.used), EPS, s.dev, pack=False)
    s.counts = FT.fast_loss_counts(fb, ft, s.K).double().clamp_min(1)
    s.positions = B * N
    del fb, ft
    s.model = None
    model = OnlineEagle3Model(sf, length=s.K, attention_backend="flex_attention")
    inputs = dict(input_ids=b["ids"][:, :N], attention_mask=torch.ones(B, N, dtype=torch.long,
                                                                        device=s.dev),
                  target=target, loss_mask=b["pmask"][:, :N, None].long(),
                  hidden_states=b["aux"])
    del b
    opt = torch.optim.AdamW([p for p in sf.parameters() if p.requires_grad], lr=1e-4)
    ac = _autocast(s.dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with ac():
            plosses = model(**inputs)[0]
            loss = sum(DECAY ** j * p for j, p in enumerate(plosses))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sf.parameters(), CLIP)
        opt.step()
        s.last = torch.stack([p.detach().double() for p in plosses])
        return loss.detach()
    return step


def one(cfg: dict) -> dict:
    """Run one configuration (kind, K, seq, vocab, batch) in this process; its measurements."""
    import resource
    import torch
    if cfg["device"] == "cpu":
        torch.set_num_threads(cfg["threads"])
    s = _setup(cfg)
    kind = cfg["kind"]
    step = (_baseline(s) if kind == "baseline" else _specforge(s) if kind == "specforge"
            else _online(s, cfg["geometry"]) if kind == "online"
            else _fast(s, kind.split("-", 1)[1]))
    dev = s.dev
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out = {"loss": float(step())}  # the first step: same weights and batch in every row
    if kind == "specforge":
        w = DECAY ** torch.arange(cfg["K"], device=dev, dtype=torch.float64)
        out["loss_raw"] = out["loss"]
        out["loss"] = float((w * s.last * s.positions / s.counts).sum())
    for _ in range(cfg["warmup"] - 1):
        step()
    sync()
    base_alloc = 0
    if dev.type == "cuda":
        base_alloc = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(cfg["iters"]):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
        step_peak = peak - base_alloc / 2**20
    else:
        peak, step_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, None
    return {**cfg, **out, "step_s": med, "tokens_per_s": cfg["batch"] * cfg["seq"] / med,
            "peak_mib": peak, "step_peak_mib": step_peak}


def grid(a) -> list[dict]:
    K0, T0, V0 = (int(x) for x in a.base.split(","))
    pts = [(K0, T0, V0)]
    pts += [(int(k), T0, V0) for k in a.ks.split(",")]
    pts += [(K0, int(t), V0) for t in a.seqs.split(",")]
    pts += [(K0, T0, int(v)) for v in a.vocabs.split(",")]
    seen, out = set(), []
    for k, t, v in pts:
        if (k, t, v) not in seen:
            seen.add((k, t, v))
            out.append(dict(K=k, seq=t, vocab=v))
    return out


# issue 17's H200 set (about 4 minutes): SmolLM2 geometry at batch 1 and 4, every kind; the
# Kimi-K2.5 drafter's fast step at batch 1 (peak memory and tokens/s). Most telling rows first,
# so that a spent --budget costs the least.
_S = dict(geometry="smollm2", K=7, seq=2048, vocab=32000)
_KIMI = dict(geometry="kimi-k2.5", K=7, seq=2048, vocab=32000)
SUITES = {"issue17": dict(device="cuda", warmup=2, iters=5, budget=240.0, row_timeout=75.0, rows=[
    *(dict(_S, batch=b, kind=k) for b in (1, 4)
      for k in ("fast-triton", "online", "baseline", "specforge")),
    dict(geometry="kimi-k2.5", K=7, seq=2048, vocab=32000, batch=1, kind="fast-triton")]),
    # issue 37's Kimi-K2.5 rows (about 2 minutes): our fast step and SpecForge's own on the
    # drafter of specs/drafter-v2.yaml (hidden 7168, fc 21504 -> 7168), 2,048-token samples, at
    # batch 1 and 2 (both fit: ~40 GB and ~55 GB for ours), then ours at 4
    "issue37": dict(device="cuda", warmup=2, iters=5, budget=120.0, row_timeout=75.0, rows=[
        *(dict(_KIMI, batch=b, kind=k) for b in (1, 2) for k in ("fast-triton", "specforge")),
        dict(_KIMI, batch=4, kind="fast-triton")])}


def _ratios(rows: list[dict]) -> None:
    """x_baseline / x_specforge: tokens/s against those rows of the same shape; x_offline (online
    rows): against the first fast-* row of the same shape (in place)."""
    def key(r):
        return (r["geometry"], r["K"], r["seq"], r["vocab"], r["batch"])
    ok = [r for r in rows if "error" not in r]
    ref = {(r["kind"], key(r)): r["tokens_per_s"] for r in ok}
    for r in ok:
        if r["kind"].startswith("fast-"):
            ref.setdefault(("offline", key(r)), r["tokens_per_s"])
    for r in ok:
        for kind in ("baseline", "specforge") + (("offline",) if r["kind"] == "online" else ()):
            if (kind, key(r)) in ref:
                r[f"x_{kind}"] = r["tokens_per_s"] / ref[kind, key(r)]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"### Drafter training on {meta['device_name']}",
             "", f"median of {meta['iters']} steps after {meta['warmup']} warm-up; "
             f"{meta['precision']}; tokens/s = sequence tokens per optimizer step time (each "
             "token runs all K TTT steps); loss = the first step's, same weights and batch "
             "(online: the random target's features); "
             f"torch {meta['torch']}, commit {meta['commit']}.", "",
             "| geometry | step | K | seq | draft vocab | batch | step (s) | tokens/s | "
             "x baseline | x specforge | x offline | peak (MiB) | step peak (MiB) | loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['geometry']} | {r['kind']} | {r['K']} | {r['seq']} | {r['vocab']} | "
                f"{r['batch']} |")
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:70]} | | | | | | | |")
            continue
        sp = "" if r["step_peak_mib"] is None else f"{r['step_peak_mib']:.0f}"
        xb, xs, xo = (f"{r[k]:.2f}" if k in r else ""
                      for k in ("x_baseline", "x_specforge", "x_offline"))
        lines.append(f"{head} {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | {xb} | {xs} | {xo} | "
                     f"{r['peak_mib']:.0f} | {sp} | {r['loss']:.5f} |")
    return "\n".join(lines) + "\n"




def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n" + __doc__.split("\n\n")[1])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    for k in ("base", "ks", "seqs", "vocabs"):
        ap.add_argument(f"--{k}", default=None)
    ap.add_argument("--batches", "--batch", dest="batches", default=None,
                    help="batch sizes, comma-separated (e.g. 1,4)")
    ap.add_argument("--attn", default=None,
                    help="TTT attention of the fast step, comma-separated: triton, flex, torch")
    ap.add_argument("--no-baseline", action="store_true", help="skip today's step")
    ap.add_argument("--specforge", action="store_true", help="add SpecForge 0.2.0's step (CUDA)")
    ap.add_argument("--online", action="store_true",
                    help="add online training (the target in the loop; smollm2, tiny)")
    ap.add_argument("--suite", choices=sorted(SUITES), help="a fixed set of rows (SUITES); "
                    "replaces the grid and its options")
    ap.add_argument("--row-timeout", type=float, default=None,
                    help="seconds per row before its subprocess is killed (default: none)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all rows; rows left after it are reported as skipped")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per configuration")
    ap.add_argument("--out", default="runs/bench-train")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration as JSON
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(one(json.loads(a.one))))
        return
    suite = SUITES.get(a.suite or "", {})
    if suite:
        a.device = suite["device"]
        a.budget = a.budget or suite["budget"]
        a.row_timeout = a.row_timeout or suite["row_timeout"]
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, suite.get(k, v))
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step's loss is read from it)")
    import torch
    dev_name = (torch.cuda.get_device_name(0) if a.device == "cuda"
                else f"CPU ({platform.processor() or platform.machine()}, {a.threads} threads)")
    common = dict(device=a.device, warmup=a.warmup, iters=a.iters, threads=a.threads)
    cfgs = [dict(r, **common) for r in suite["rows"]] if suite else _grid_cfgs(a, common)
    rows, t_end = [], time.monotonic() + (a.budget or float("inf"))
    for cfg in cfgs:
        left = t_end - time.monotonic()
        if left <= 1:
            rows.append({**cfg, "error": "skipped: --budget spent"})
            continue
        rows.append(_run(cfg, min(left, a.row_timeout or float("inf"))))
    _ratios(rows)
    meta = {"suite": a.suite, "device": a.device, "device_name": dev_name,
            "warmup": a.warmup, "iters": a.iters, "commit": code_version(),
            "precision": "bf16 autocast" if a.device == "cuda" else "float32",
            "torch": torch.__version__}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "bench_train.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


def _grid_cfgs(a, common: dict) -> list[dict]:
    """The rows of the grid options: every grid point x batch x kind."""
    kinds = ([] if a.no_baseline else ["baseline"]) + [f"fast-{x}" for x in a.attn.split(",")]
    kinds += (["online"] if a.online else []) + (["specforge"] if a.specforge else [])
    V, out = GEOMETRIES[a.geometry]["vocab_size"], []
    for pt in grid(a):
        if pt["vocab"] > V:
            print(f"skip draft vocab {pt['vocab']}: larger than the {a.geometry} vocab {V}",
                  file=sys.stderr)
            continue
        out += [dict(pt, kind=kind, batch=int(b), geometry=a.geometry, **common)
                for b in a.batches.split(",") for kind in kinds]
    return out


def _run(cfg: dict, timeout: float = float("inf")) -> dict:
    """One configuration in its own subprocess (its own peak memory), killed after `timeout`
    seconds; an error or a timeout becomes a row."""
    tag = (f"{cfg['geometry']} {cfg['kind']} K={cfg['K']} seq={cfg['seq']} vocab={cfg['vocab']} "
           f"batch={cfg['batch']}")
    try:
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                           capture_output=True, text=True,
                           timeout=None if timeout == float("inf") else timeout)
    except subprocess.TimeoutExpired:
        print(f"{tag}: timed out after {timeout:.0f} s", file=sys.stderr)
        return {**cfg, "error": f"timed out after {timeout:.0f} s"}
    got = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not got:
        err = (r.stderr.strip().splitlines() or ["failed"])[-1]
        print(f"{tag}: {err}", file=sys.stderr)
        return {**cfg, "error": err}
    x = json.loads(got[-1][7:])
    print(f"{tag}: {x['tokens_per_s']:.0f} tok/s  step {x['step_s']:.4f} s  peak "
          f"{x['peak_mib']:.0f} MiB  loss {x['loss']:.5f}", file=sys.stderr)
    return x


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
