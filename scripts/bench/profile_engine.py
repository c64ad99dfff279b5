#!/usr/bin/env python
"""Kernel count and time split per decode step and per round, the engine's two paths (its steps,
engine/steps.py, under torch.compile with Engine kernels "torch" and "triton": the fused
kernels/llama_decode.py and kernels/draft_decode.py), batch 1, bf16, CUDA graphs; plus the
ratios of issue 19, in ONE table (JSON + markdown):

  decode_vs_hf        HF static-cache compiled generate ms/token / our 1-row decode token (>= 2.5)
  round_in_tokens     a K-step greedy chain round / a 1-row decode token, same path (<= 1.35)
  draft_over_layer    one draft chain step / one target layer (<= 1.5); layer = (decode of the
                      full model - decode of a 2-layer one) / (L - 2), both graph replays
  tree16_over_verify5 a 16-node tree verify / a 5-row chain verify (<= 1.3)

Steps (each captured once: torch.compile(mode="reduce-overhead", fullgraph), or for the fused
path a manual torch.cuda.CUDAGraph when compile fails; the row says which): decode1, verify
(K+1 rows), tree16, draft_step (chain step), draft_round (step 0 over K+1 rows + K-1 chain
steps), decode1_L2. "token" and "round" loop like the engine's generate: a graph replay, the
clones, one device-to-host copy. Kernel splits come from torch.profiler over graph replays,
grouped by kernel name and position (classify()); a row whose profile fails says why and the
script goes on. Random weights in SmolLM2-135M geometry (speed does not depend on them), or
--target for a real HF folder / GGUF.

  python scripts/bench/profile_engine.py --out profile_engine            # ~2.5 min on an H200
  python scripts/bench/profile_engine.py --paths triton --skip hf --out p  # the fused path only
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CATS = ("norm", "qkv", "rope", "kv_write", "attention", "o_proj", "mlp", "lm_head", "copy",
        "other")
RULES = [  # (category, kernel-name regex): the first match wins
    ("qkv", r"_qkv_kernel"),  # fused: RMSNorm + q/k/v + RoPE + cache write
    ("attention", r"_attn_kernel|_combine_kernel|flash|fmha|attention|sdpa|softmax"),
    ("mlp", r"_gate_up_kernel|silu"),
    ("lm_head", r"_head_kernel|_merge_kernel|argmax|argmin|topk|logsumexp"),
    ("linear", r"_linear_kernel"),  # o_proj / down_proj / fc: by position
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|sm\d\d_|splitk"),  # cuBLAS: by position
    ("copy", r"^memcpy|^memset|Memcpy|Memset"),
    ("kv_write", r"index_put|index_copy|scatter"),
    ("norm", r"rsqrt|_mean_|_pow_"),
    ("rope", r"_cat_|_neg_|rotate|_cos_|_sin_"),
]


def classify(names: list[str]) -> list[str]:
    """Kernel names of one call, in launch order -> a category (CATS) each. Our Triton kernels
    are named by role; a split-K `_linear_kernel` is o_proj after attention and mlp after the
    gate/up kernel. cuBLAS GEMMs (the torch path) are placed by what precedes them: after the
    input norm qkv, after attention o_proj, after the post-attention norm or silu mlp; the last
    GEMM of a call that ran an argmax/top-k is the lm_head."""
    cats, phase, after_o = [], "attn", False
    for n in names:
        c = next((c for c, rx in RULES if re.search(rx, n)), "other")
        if c == "norm":
            phase = "mlp" if after_o else "attn"
            after_o = False
        elif c == "attention":
            phase = "o"
        elif c == "mlp":
            phase = "mlp"
        if c in ("linear", "gemm"):
            c = {"o": "o_proj", "mlp": "mlp"}.get(phase, "qkv" if c == "gemm" else "other")
            after_o = after_o or c == "o_proj"
        cats.append(c)
    if "lm_head" in cats:
        gi = [i for i, n in enumerate(names) if re.search(RULES[5][1], n)]
        if gi:
            cats[gi[-1]] = "lm_head"
    return cats


def kernel_profile(f, args, reps: int = 10) -> dict:
    """torch.profiler over `reps` calls: kernels per call, GPU us per call by category, top 8."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            f(*args)
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)
    if not evs:
        raise RuntimeError("the profiler saw no CUDA kernels")
    names = [e.name for e in evs]
    per = len(evs) // reps
    cats = []
    for r in range(reps):  # classify call by call: positions restart per call
        cats += classify(names[r * per:(r + 1) * per])
    cats += classify(names[reps * per:])
    split = {c: {"us": 0.0, "n": 0.0} for c in CATS}
    top = {}
    for e, c in zip(evs, cats):
        us = e.time_range.end - e.time_range.start
        split[c]["us"] += us / reps
        split[c]["n"] += 1 / reps
        top[e.name] = top.get(e.name, 0.0) + us / reps
    return {"kernels": len(evs) / reps, "gpu_us": sum(s["us"] for s in split.values()),
            "split": split, "top": sorted(top.items(), key=lambda kv: -kv[1])[:8]}


def graphed(fn, args, fused: bool):
    """(callable, how): torch.compile(mode="reduce-overhead", fullgraph) warmed up; for the
    fused path a manual CUDA graph if that raises (static inputs, copied in per call)."""
    import torch
    try:
        f = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
        for _ in range(3):
            f(*args)
        torch.cuda.synchronize()
        return f, "torch.compile(reduce-overhead)"
    except Exception as e:  # noqa: BLE001 - reported in the row
        if not fused:
            raise
        why = f"{type(e).__name__}: {str(e)[:120]}"
    static = [a.clone() for a in args]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)

    def run(*a):
        for st, x in zip(static, a):
            if st.data_ptr() != x.data_ptr():
                st.copy_(x)
        g.replay()
        return out
    return run, f"manual CUDA graph (torch.compile failed: {why})"


def ms_per_call(f, args, iters: int = 50) -> float:
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        f(*args)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / iters


def median_ms(fn, iters: int = 30) -> float:
    """fn() synchronises itself (a host copy); median of `iters` timed calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(1000 * (time.perf_counter() - t0))
    return statistics.median(ts)


def random_llama(c, layers: int, aux=()):
    """Our Llama with random weights (default init) on CUDA, bf16."""
    import torch
    from eagle3_runner.models.llama import Llama
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Llama(replace(c, num_hidden_layers=layers), aux).eval().requires_grad_(False)
    return m.to(torch.bfloat16)


def build_steps(t, t2, d, dk, dv, K: int, S: int, path: str) -> dict:
    """name -> (fn, example args): engine/steps.py's steps as the engine runs them, with
    kernels = `path` ("torch" or "triton": same inputs, same outputs)."""
    import torch
    from eagle3_runner.engine import steps as es
    from eagle3_runner.kernels.draft_decode import rope_table
    from eagle3_runner.kernels.llama_decode import target_forward
    dev, V, H, n = t.lm_head.weight.device, t.config.vocab_size, t.config.hidden_size, S // 4
    slots = torch.arange(S, device=dev)
    W16 = 16
    tm = torch.eye(W16, dtype=torch.bool, device=dev)  # a binary tree in BFS order
    depth = [0] * W16
    for i in range(1, W16):
        tm[i] |= tm[(i - 1) // 2]
        depth[i] = depth[(i - 1) // 2] + 1
    tpos = n + torch.tensor(depth, device=dev)
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    toks = torch.randint(0, V, (1, K + 1), device=dev)
    ttoks = torch.randint(0, V, (1, W16), device=dev)
    dt = t.lm_head.weight.dtype
    aux = torch.randn(1, K + 1, len(d.config.aux_layer_ids) * H, device=dev, dtype=dt)
    hid = torch.randn(1, 1, H, device=dev, dtype=dt)
    best = torch.randint(0, V, (K + 1,), device=dev)
    sel = slots[1:2]
    rope = rope_table(d, S) if path == "triton" else None
    dec = lambda m: (lambda x, p: es.decode(m, x, p, path))  # noqa: E731
    steps = {
        "verify": (lambda x, p: es.verify(t, x, p, path), (toks, slots[n:n + K + 1])),
        "tree16": (lambda x, p, pl: target_forward(t, x, p, pl, tm, kernels=path)[:3],
                   (ttoks, tpos, slots[n:n + 1])),
        "draft_step": (lambda x, h, p: es.draft_step(d, dk, dv, x, h, p, rope, path),
                       (tok, hid, slots[n:n + 1])),
        "draft_round": (lambda a, b, p, s: es.draft_round_greedy(d, dk, dv, a, b, p, s, K, rope,
                                                                 path),
                        (aux, best, slots[n:n + K + 1], sel))}
    steps["decode1"] = (dec(t), (tok, slots[n:n + 1]))
    steps["decode1_L2"] = (dec(t2), (tok, slots[n:n + 1]))
    return steps


def run_path(path, t, t2, d, dk, dv, K, S, res, deadline):
    """Graph, time and profile every step of one path into res["steps"][name][path]; then the
    engine-like token and round loops."""
    import torch
    steps = build_steps(t, t2, d, dk, dv, K, S, path)
    graphs = {}
    for name in ("decode1", "verify", "tree16", "draft_step", "draft_round", "decode1_L2"):
        row = res["steps"].setdefault(name, {})[path] = {}
        if time.time() > deadline:
            row["error"] = "skipped: --budget spent"
            continue
        fn, args = steps[name]
        t0 = time.time()
        try:
            g, how = graphed(fn, args, path == "triton")
            graphs[name] = (g, args)
            row.update(how=how, build_s=round(time.time() - t0, 1), ms=ms_per_call(g, args))
            row.update(kernel_profile(g, args))
        except Exception as e:  # noqa: BLE001 - one failed row must not end the run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        print(f"{path:6s} {name:11s} " + ("ERROR " + row["error"][:150] if "error" in row else
              f"{row['ms']:.3f} ms, {row.get('kernels', float('nan')):.0f} kernels ({row['how']}, "
              f"built in {row['build_s']} s)"), flush=True)
    loops = res["loops"][path] = {}
    try:
        D, dargs = graphs["decode1"]

        def token():
            _, _, b = D(*dargs)
            int(b.clone()[0])
        loops["token_ms"] = median_ms(token)
        Vf, (toks, vpos) = graphs["verify"]
        R, (a, b, rpos, sel) = graphs["draft_round"]

        def one_round():
            _, vaux, best = Vf(toks, vpos)
            vaux, best = vaux.clone(), best.clone()
            torch.cat([toks[0, 1:], best]).tolist()  # the round's one device-to-host copy
            R(vaux.to(a.dtype), best, rpos, sel).clone()
            torch.cuda.synchronize()
        loops["round_ms"] = median_ms(one_round)
    except Exception as e:  # noqa: BLE001
        loops["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    print(path, "loops", loops, flush=True)


def hf_row(hf, prompt_len: int, new: int) -> dict:
    """HF generate with one StaticCache, auto-compiled decode (scripts/bench/bench_engine.py's hf_static
    row) on a random prompt: ms per new token, median of 2 passes after a warm-up."""
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "scripts" / "bench" / "bench_engine.py")
    be = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(be)
    dev = next(hf.parameters()).device
    prompts = [torch.randint(0, hf.config.vocab_size, (1, prompt_len), device=dev)]
    s, _, nc = be.timed(be.hf_static_generate(hf, prompts, new), prompts, dev, 2)
    return {"ms_per_token": 1000 * s / new, "compiles_in_timed_pass": nc}


def ratios(res: dict, L: int) -> dict:
    """The issue's ratios per path (None where an input row failed)."""
    out = {}
    hf = res.get("hf", {}).get("ms_per_token")
    for p, lp in res["loops"].items():
        st = {k: v.get(p, {}).get("ms") for k, v in res["steps"].items()}
        layer = ((st["decode1"] - st["decode1_L2"]) / (L - 2)
                 if st.get("decode1") and st.get("decode1_L2") else None)
        tok, rnd = lp.get("token_ms"), lp.get("round_ms")
        out[p] = {"token_ms": tok, "round_ms": rnd, "layer_ms": layer,
                  "decode_vs_hf": hf / tok if hf and tok else None,
                  "round_in_tokens": rnd / tok if rnd and tok else None,
                  "draft_over_layer": st["draft_step"] / layer if st.get("draft_step") and layer
                  else None,
                  "tree16_over_verify5": st["tree16"] / st["verify"]
                  if st.get("tree16") and st.get("verify") else None}
    return out


def markdown(res: dict) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    paths = list(res["loops"])
    lines = [f"{res['machine']}, bf16, batch 1, {res['layers']} layers, K = {res['K']}, cache "
             f"{res['S']} slots (prefix {res['S'] // 4}), commit {res['commit']}", "",
             "| metric | " + " | ".join(paths) + " | target |", "|---|" + "---|" * (len(paths) + 1)]
    targets = {"decode_vs_hf": ">= 2.5", "round_in_tokens": "<= 1.35", "draft_over_layer": "<= 1.5",
               "tree16_over_verify5": "<= 1.3", "token_ms": "moonshot 0.5", "round_ms": "",
               "layer_ms": ""}
    for k, tgt in targets.items():
        lines.append(f"| {k} | " + " | ".join(f(res["ratios"][p].get(k)) for p in paths) +
                     f" | {tgt} |")
    lines.append(f"| HF static compiled generate ms/token | {f(res.get('hf', {}).get('ms_per_token'))} "
                 + "| " * len(paths) + "|")
    lines += ["", "| step | path | ms/call | kernels/call | GPU us | " + " | ".join(CATS) + " | graph |",
              "|---|---|---|---|---|" + "---|" * len(CATS) + "---|"]
    for name, rows in res["steps"].items():
        for p, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | {p} | error: {r['error'][:100]} |")
                continue
            sp = r.get("split", {})
            cells = [f"{sp[c]['us']:.0f} ({sp[c]['n']:.0f})" if sp.get(c, {}).get("n") else ""
                     for c in CATS]
            lines.append(f"| {name} | {p} | {f(r.get('ms'))} | {f(r.get('kernels'), 0)} | "
                         f"{f(r.get('gpu_us'), 0)} | " + " | ".join(cells) + f" | {r.get('how', '')} |")
    lines += ["", "Split cells: GPU us per call (kernels per call), from torch.profiler over graph "
              "replays; categories by kernel name and position (scripts/bench/profile_engine.py classify)."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: random SmolLM2)")
    ap.add_argument("--steps", type=int, default=4, help="K, draft steps per round")
    ap.add_argument("--seq", type=int, default=512, help="cache slots S (prefix = S / 4)")
    ap.add_argument("--paths", default="torch,triton")
    ap.add_argument("--skip", default="", help="comma list: hf")
    ap.add_argument("--new", type=int, default=64, help="HF row: new tokens")
    ap.add_argument("--budget", type=float, default=420, help="seconds; later rows are skipped")
    ap.add_argument("--out", default="profile_engine", help="output prefix (.json, .md)")
    a = ap.parse_args(argv)
    import subprocess

    import torch
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.runner.drafts.checks import default_aux_ids
    if not torch.cuda.is_available():
        ap.error("needs CUDA (the steps are timed as CUDA graph replays)")
    deadline = time.time() + a.budget
    torch.set_num_threads(min(torch.get_num_threads(), 16))
    if a.target:
        from eagle3_runner.targets.load import load_target
        hf, _, _ = load_target(a.target, device="cuda", dtype="bfloat16")
    else:
        spec = __import__("importlib.util").util.spec_from_file_location(
            "bench_engine", ROOT / "scripts" / "bench" / "bench_engine.py")
        be = __import__("importlib.util").util.module_from_spec(spec)
        spec.loader.exec_module(be)
        hf, _ = be.random_smollm2("cuda", "bfloat16")
    L = hf.config.num_hidden_layers
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    res = {"machine": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": L,
           "K": a.steps, "S": a.seq, "commit": commit, "steps": {}, "loops": {}}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    if "hf" not in a.skip.split(","):
        try:
            res["hf"] = hf_row(hf, 48, a.new)
        except Exception as e:  # noqa: BLE001
            res["hf"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print("hf", res["hf"], flush=True)
    with torch.inference_mode():
        t = from_hf_model(hf, tuple(default_aux_ids(L)))
        t.setup_cache(1, a.seq)
        t2 = random_llama(t.config, 2)
        t2.setup_cache(1, a.seq)
        c = t.config
        dc = DraftConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                         draft_vocab_size=2048, target_hidden_size=c.hidden_size,
                         aux_layer_ids=list(t.aux_ids), rms_norm_eps=c.rms_norm_eps,
                         rope_theta=c.rope_theta)
        torch.manual_seed(1)
        with torch.device("cuda"):
            d = Eagle3Draft(dc, t.embed_tokens.weight).eval().requires_grad_(False)
        d = d.to(torch.bfloat16)
        dk = torch.zeros(1, c.num_key_value_heads, a.seq, c.head_dim, device="cuda",
                         dtype=torch.bfloat16)
        dv = torch.zeros_like(dk)
        for x in t.caches() + t2.caches() + [dk, dv]:
            torch._dynamo.mark_static_address(x)
        for p in a.paths.split(","):
            run_path(p, t, t2, d, dk, dv, a.steps, a.seq, res, deadline)
    res["ratios"] = ratios(res, L)
    md = markdown(res)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1, default=str))
    Path(a.out + ".md").write_text(md + "\n")
    print(md)
    return res


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
