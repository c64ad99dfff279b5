#!/usr/bin/env python
"""Regeneration benchmark, one run, CPU or CUDA (BENCHMARKS.md rows come from it):

  compare  the same chat prompts and the same answer lengths through
             hf      jobs.regenerate.generate_batch (HF generate, left padding) at --hf-batch,
                     the path the regenerate stage used before the embedded engine
             engine  engine.generate.Generator (continuous batching, --rows rows, CUDA graphs
                     with --cuda-graph), each answer exactly as long as HF's answer to that
                     prompt (its count to EOS; no stop ids), so both make the same tokens
           -> new tokens/s of each (useful tokens / wall seconds after a warm-up) and the ratio
  step     no tokenizer or data (--random-target): --prompts random prompts of --prompt-len
           ids, each answered with exactly --new tokens (no stop ids), through the Generator in
           each sampling mode (greedy, sample, top_p: warm-up and compile timed apart), then HF
           generate (dynamic cache, --hf-batch) on the same prompts and lengths; plus a
           torch.profiler split of a short run (top kernels, GPU vs host time) and inductor's
           counters (CUDA-graph skips, recompiles)
  e2e      jobs.regenerate.regenerate end to end: --synthetic prompts written by the target
           (Magpie) + --real ShareGPT conversations (every turn, --max-turns), answered on the
           engine, shards written -> seconds, tokens/s, conversations/s, output MB per 1k
           conversations

Prompts: the first user turns of ShareGPT conversations (the fetched asset), --prompts of them.
Target: the fetched SmolLM2 GGUF through targets.load (default), or random weights with
SmolLM2-135M's geometry (--random-target; --geometry tiny: 2 layers x 64 wide, for CPU tests);
the tokenizer is always SmolLM2's. Writes OUT.json and OUT.md.

  python scripts/bench/bench_generate.py --mode compare --prompts 512 --new 256 --rows 512 \\
      --hf-batch 512 --cuda-graph --out bench_generate            # the H200 comparison
  python scripts/bench/bench_generate.py --mode e2e --synthetic 90000 --real 10000 --rows 1024 \\
      --new 256 --cuda-graph --out bench_regen_100k                 # 100k conversations
  python scripts/bench/bench_generate.py --random-target --geometry tiny --prompts 4 --new 8 \\
      --rows 2 --hf-batch 2 --mode both --synthetic 2 --synthetic-tokens 8 --real 2 \\
      --max-length 256                                              # CPU smoke
  python scripts/bench/bench_generate.py --mode step --random-target --prompts 1024 --rows 512 \\
      --prompt-len 128 --new 256 --hf-batch 512 --cuda-graph --out bench_step  # no assets
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def load(a):
    """(HF model, tokenizer, its end-of-turn ids) per the flags; a random target's tokenizer is
    the fetched SmolLM2's (none for --mode step)."""
    from eagle3_runner.targets.load import end_of_turn_ids, load_target, load_tokenizer
    from eagle3_runner.runner.assets import asset_path
    if a.mode == "step" and not a.random_target:
        raise SystemExit("--mode step needs --random-target (random prompts, no tokenizer)")
    path = a.target or asset_path("smollm2")
    if not a.random_target:
        hf, tok, _ = load_target(path, device=a.device, dtype=a.dtype)
        return hf, tok, end_of_turn_ids(path, tok)
    from bench_engine import random_smollm2
    tok = None if a.mode == "step" else load_tokenizer(path)
    stop = () if tok is None else end_of_turn_ids(path, tok)
    if a.geometry == "smollm2":
        return random_smollm2(a.device, a.dtype)[0], tok, stop
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096)
    dev = "cuda" if a.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    return LlamaForCausalLM(c).to(dev).eval(), tok, stop


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def first_turns(n: int, max_length: int, tok) -> list[list[dict]]:
    """[system +] first user turn of the first n ShareGPT training conversations whose prompt
    is shorter than max_length tokens."""
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.runner.spec.sections import Data
    convs, _, _ = load_conversations(Data(max_samples=max(4 * n, 64), max_length=max_length))
    out = []
    for c in convs:
        msgs = [t for t in c if t["role"] == "system"][:1] + \
            [next(t for t in c if t["role"] == "user")]
        if len(tok.apply_chat_template(msgs, add_generation_prompt=True)) < max_length:
            out.append(msgs)
        if len(out) == n:
            break
    return out


def compare(a, hf, tok, target, stop: tuple) -> dict:
    """The hf and engine rows over the same prompts and per-prompt lengths (HF stops at `stop`,
    the target's end-of-turn ids)."""
    from eagle3_runner.engine.generate import Generator, Request
    from eagle3_runner.data.prompts import render
    from eagle3_runner.jobs.regenerate import generate_batch
    dev = next(hf.parameters()).device
    prompts = first_turns(a.prompts, a.max_length, tok)
    prompts.sort(key=lambda m: len(render(tok, m)))  # as the old stage batched them
    generate_batch(hf, tok, prompts[:2], 4, 0.0, 1.0, stop_ids=stop)  # warm-up
    caps: list = []  # tokens HF made per prompt (to EOS, EOS included)
    sync(dev)
    t0 = time.perf_counter()
    for b in range(0, len(prompts), a.hf_batch):
        generate_batch(hf, tok, prompts[b:b + a.hf_batch], a.new, 0.0, 1.0, counts=caps,
                       stop_ids=stop)
    sync(dev)
    hf_s = time.perf_counter() - t0
    ids = [render(tok, m) for m in prompts]
    gen = Generator(target, rows=a.rows, max_seq=max(map(len, ids)) + a.new + 1, max_new=a.new,
                    cuda_graph=a.cuda_graph, sync_every=a.sync_every, kernels=a.kernels)
    warm = [Request(("w", i), ids[i], caps[i]) for i in range(min(len(ids), a.rows))]
    gen.run(warm, lambda rs: None)  # compile + CUDA-graph capture outside the timed pass
    done = []  # no stop ids: each answer is exactly as long as HF's for that prompt
    st = gen.run([Request(i, x, c) for i, (x, c) in enumerate(zip(ids, caps))],
                 lambda rs: done.extend(len(r.tokens) for r in rs))
    n_hf, n_eng = sum(caps), sum(done)
    hf_tps, eng_tps = n_hf / hf_s, n_eng / st["seconds"]
    return {"prompts": len(prompts), "hf_batch": a.hf_batch, "rows": a.rows, "new": a.new,
            "hf": {"tokens": n_hf, "seconds": hf_s, "tok_s": hf_tps},
            "engine": {"tokens": n_eng, "seconds": st["seconds"], "tok_s": eng_tps,
                       "steps": st["steps"], "prefill_tokens": st["prefill_tokens"]},
            "ratio": eng_tps / hf_tps}


def step(a, hf, target) -> dict:
    """--mode step: the Generator's throughput per sampling mode and HF generate's, on the same
    random prompts and lengths (every answer exactly --new tokens), a profiler split, counters."""
    from torch._dynamo.utils import counters
    from eagle3_runner.engine.generate import Generator, Request
    dev = target.lm_head.weight.device
    g = torch.Generator().manual_seed(0)
    V = target.config.vocab_size
    ids = [torch.randint(0, V, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    gen = Generator(target, rows=a.rows, max_seq=a.prompt_len + a.new + 1, max_new=a.new,
                    cuda_graph=a.cuda_graph, sync_every=a.sync_every, kernels=a.kernels)
    res = {"prompts": a.prompts, "prompt_len": a.prompt_len, "new": a.new, "rows": a.rows}
    modes = {"greedy": (0.0, 1.0), "sample": (1.0, 1.0), "top_p": (1.0, 0.95)}
    for mode, (temp, top_p) in {m: modes[m] for m in a.modes.split(",")}.items():
        t0 = time.perf_counter()  # warm-up: compile + one CUDA graph per kv_len bucket
        gen.run([Request(("w", i), ids[i], a.new, i) for i in range(min(64, len(ids)))],
                lambda rs: None, temp, top_p)
        sync(dev)
        warm = time.perf_counter() - t0
        st = gen.run([Request(i, x, a.new, i) for i, x in enumerate(ids)], lambda rs: None,
                     temp, top_p)
        res[mode] = {"warm_s": warm, "seconds": st["seconds"], "tokens": st["new_tokens"],
                     "tok_s": st["new_tokens"] / st["seconds"], "steps": st["steps"],
                     "ms_per_step": 1e3 * st["seconds"] / max(st["steps"], 1),
                     "prefills": st["prefills"], "kv_lens": st["kv_lens"]}
        print(mode, {k: v for k, v in res[mode].items() if k != "kv_lens"}, flush=True)
    res["graphs"] = gen.graph_counts()
    if dev.type == "cuda":  # where a greedy run's time goes
        from torch.profiler import ProfilerActivity, profile
        reqs = [Request(("p", i), ids[i], min(32, a.new), i) for i in range(min(a.rows, a.prompts))]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            st = gen.run(reqs, lambda rs: None)
            wall = time.perf_counter() - t0
        ev = prof.key_averages()
        cuda = lambda e: getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)  # noqa: E731
        kern = sorted((e for e in ev if cuda(e) > 0 and e.device_type.name == "CUDA"),
                      key=cuda, reverse=True)
        res["profile"] = {"wall_s": wall, "steps": st["steps"],
                          "gpu_s": sum(cuda(e) for e in kern) / 1e6,
                          "top": [(e.key[:90], e.count, round(cuda(e) / 1e3, 2)) for e in kern[:15]]}
        print("profile", json.dumps(res["profile"], indent=0), flush=True)
    res["counters"] = {k: dict(v) for k, v in counters.items() if k in ("inductor", "stats")}
    if hf is not None and a.hf_batch > 0:
        x = torch.tensor(ids, device=dev)
        hf.generate(input_ids=x[:2, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        sync(dev)
        t0, n = time.perf_counter(), 0
        for b in range(0, len(ids), a.hf_batch):
            xb = x[b:b + a.hf_batch]
            o = hf.generate(input_ids=xb, attention_mask=torch.ones_like(xb), do_sample=False,
                            max_new_tokens=a.new, min_new_tokens=a.new, pad_token_id=0)
            n += (o.shape[1] - xb.shape[1]) * xb.shape[0]
        sync(dev)
        s = time.perf_counter() - t0
        res["hf"] = {"tokens": n, "seconds": s, "tok_s": n / s}
        if "greedy" in res:
            res["ratio_greedy"] = res["greedy"]["tok_s"] / res["hf"]["tok_s"]
        print("hf", res["hf"], "ratio", res.get("ratio_greedy"), flush=True)
    return res


def e2e(a, tok, target, stop: tuple) -> dict:
    """regenerate() over --real ShareGPT + --synthetic conversations into a temp dir, every turn
    ending at `stop` (the target's end-of-turn ids)."""
    from types import SimpleNamespace
    from eagle3_runner.data.contamination import bench_guard
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.spec.sections import Data
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    real = load_conversations(Data(max_samples=a.real, max_length=a.max_length))[0] \
        if a.real else []
    p = RegenerateStage(max_new_tokens=a.new, batch_size=a.rows, max_turns=a.max_turns,
                        synthetic_prompts=a.synthetic, synthetic_max_tokens=a.synthetic_tokens,
                        cuda_graph=a.cuda_graph, shard_conversations=4096, kernels=a.kernels)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        guard = bench_guard(SimpleNamespace(data=Data(holdout=0)))  # MT-bench + HumanEval
        m = regenerate(target, tok, real, p, a.max_length, Path(d), guard, progress=not a.quiet,
                       stop_ids=stop)
        secs = time.perf_counter() - t0
    v = {k: (x[0] if isinstance(x, tuple) else x) for k, x in m.items()}
    n = max(v["conversations"], 1)
    return {"seconds": secs, "conversations": v["conversations"],
            "conversations_per_s": v["conversations"] / secs,
            "generation_tok_s": v["tokens_per_s"], "tokens_generated": v["tokens_generated"],
            "mb_per_1k_conversations": v["output_bytes"] / n * 1000 / 2**20, "metrics": v}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["compare", "e2e", "both", "step"], default="compare")
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: fetched SmolLM2)")
    ap.add_argument("--random-target", action="store_true", help="random weights, SmolLM2 geometry")
    ap.add_argument("--geometry", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=64, help="compare: ShareGPT first turns")
    ap.add_argument("--modes", default="greedy,sample,top_p", help="step: sampling modes")
    ap.add_argument("--prompt-len", type=int, default=128, help="step: prompt ids per prompt")
    ap.add_argument("--new", type=int, default=256, help="max new tokens per answer")
    ap.add_argument("--rows", type=int, default=256, help="engine rows in flight")
    ap.add_argument("--hf-batch", type=int, default=512, help="HF generate batch size")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=2048, help="prompt tokens at most")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--kernels", choices=["torch", "triton", "auto"], default="torch",
                    help="decode attention: SDPA (torch) or kernels.attention (triton)")
    ap.add_argument("--real", type=int, default=0, help="e2e: ShareGPT conversations")
    ap.add_argument("--synthetic", type=int, default=0, help="e2e: synthetic conversations")
    ap.add_argument("--synthetic-tokens", type=int, default=128)
    ap.add_argument("--max-turns", type=int, default=None, help="e2e: turns per real conversation")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--out", default="bench_generate")
    a = ap.parse_args(argv)
    bad = set(a.modes.split(",")) - {"greedy", "sample", "top_p"}
    if bad:
        ap.error(f"--modes: unknown {sorted(bad)}; use a comma list of greedy, sample, top_p")
    torch.set_num_threads(min(torch.get_num_threads(), 16))
    from eagle3_runner.models.llama import from_hf_model
    hf, tok, stop = load(a)
    target = from_hf_model(hf)
    dev = next(hf.parameters()).device
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": str(next(hf.parameters()).dtype), "cuda_graph": a.cuda_graph,
           "kernels": a.kernels,
           "random_target": a.random_target, "geometry": a.geometry, "args": vars(a)}
    if a.mode == "step":
        res["step"] = step(a, hf, target)
    if a.mode in ("compare", "both"):
        res["compare"] = compare(a, hf, tok, target, stop)
    if a.mode in ("e2e", "both"):
        del hf
        res["e2e"] = e2e(a, tok, target, stop)
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    md = [f"# bench_generate ({res['device']}, {res['dtype']}, cuda_graph {a.cuda_graph}, "
          f"kernels {a.kernels})", ""]
    if "step" in res:
        c = res["step"]
        md += [f"step: {c['prompts']} random prompts of {c['prompt_len']} ids, {c['new']} new "
               f"tokens each, {c['rows']} rows", "",
               "| path | warm-up s | seconds | new tok/s | ms/step |", "|---|---|---|---|---|"]
        md += [f"| Generator {m} | {c[m]['warm_s']:.1f} | {c[m]['seconds']:.2f} | "
               f"{c[m]['tok_s']:.0f} | {c[m]['ms_per_step']:.2f} |"
               for m in ("greedy", "sample", "top_p") if m in c]
        if "ratio_greedy" in c:
            md += [f"| HF generate (batch {a.hf_batch}) | | {c['hf']['seconds']:.2f} | "
                   f"{c['hf']['tok_s']:.0f} | |", "",
                   f"ratio Generator greedy / HF: **{c['ratio_greedy']:.2f}x**"]
        md.append("")
    if "compare" in res:
        c = res["compare"]
        md += ["| path | batch | new tokens | seconds | new tok/s |", "|---|---|---|---|---|",
               f"| HF generate_batch | {c['hf_batch']} | {c['hf']['tokens']} | "
               f"{c['hf']['seconds']:.2f} | {c['hf']['tok_s']:.1f} |",
               f"| embedded Generator | {c['rows']} rows | {c['engine']['tokens']} | "
               f"{c['engine']['seconds']:.2f} | {c['engine']['tok_s']:.1f} |", "",
               f"ratio engine / HF: **{c['ratio']:.2f}x** ({c['prompts']} prompts, up to "
               f"{c['new']} new tokens)", ""]
    if "e2e" in res:
        e = res["e2e"]
        md += [f"e2e: {e['conversations']} conversations in {e['seconds']:.1f} s "
               f"({e['conversations_per_s']:.1f}/s), generation {e['generation_tok_s']:.0f} tok/s,"
               f" output {e['mb_per_1k_conversations']:.2f} MB per 1k conversations"]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return res


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
