#!/usr/bin/env python
"""One-run decode benchmark, batch 1, greedy, N new tokens, on CPU or CUDA:

  hf            HF generate (dynamic cache)
  hf_static     HF generate with ONE transformers.StaticCache for all prompts (sized longest prompt
                + N, reset between calls): on CUDA, generate auto-compiles the model's 1-token decode
                forward (torch.compile(model.__call__), HF CompileConfig defaults: inductor,
                mode="reduce-overhead" = CUDA graphs); the prefill runs eagerly. One cache size =
                one compiled graph, built in the warm-up (per-prompt cache_implementation="static"
                sizes the cache per prompt and recompiles inside the timed pass)
  hf_lookup     HF generate(prompt_lookup_num_tokens=10)
  base          the embedded engine without a drafter (one decode step per token; W rows with --width)
  base_1row     with --width: the plain 1-row decode, the speed reference ("vs plain engine baseline")
  spec K/k/N    the embedded engine with an EAGLE-3 drafter dir, one row per --configs entry
                (num_steps/eagle_topk/num_draft_tokens: chains K/1/K+1, trees k > 1; tau, tok/s,
                speedup vs base_1row when present, else base; "same tokens" always vs base)

--verify-cost CHAIN,TREE (default 4/1/5,3/4/16) also times one compiled target verify of each
(engines of their own width: K+1 rows for the chain, N for the tree; the tree's includes its
acceptance and KV commit), median of 50 at the longest prompt's length, and prints the ratio
(issue 18: a verify of 16 tree tokens should cost <= 1.3x a verify of 5 chain tokens).

Each path: one warm-up generation, then --repeats timed passes over the prompts (the built-in
prompt, or the first --mtbench N MT-bench questions); tok/s = tokens / seconds of the median
pass. Every path makes exactly --new tokens per prompt (EOS ignored), so the rows compare equal
work. Each row records compiles_in_timed_pass (torch.compile graphs built during the timed
passes; should be 0, a note is printed otherwise). Writes JSON + a markdown table.

  python scripts/bench/bench_engine.py --draft runs/demo/export --new 64 --out bench_engine
  python scripts/bench/bench_engine.py --draft DIR --mtbench 8 --new 256 --steps 4 --cuda-graph --repeats 1
  python scripts/bench/bench_engine.py --random-draft --new 32 --repeats 2 --cuda-graph   # no drafter dir
  python scripts/bench/bench_engine.py --draft DIR --mtbench 8 --new 256 --cuda-graph --repeats 1 \
      --configs 4/1/5,5/4/8,3/4/16 --verify-cost 4/1/5,3/4/16
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


import torch  # noqa: E402

from eagle3_runner.runner.drafts.checks import default_aux_ids  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint. Describe its first painting."


def dynamo_graphs() -> int:
    """Graphs torch.compile (dynamo) has built in this process so far
    (torch._dynamo.utils.counters["stats"]["unique_graphs"]; 0 if unavailable)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a counter for a report, never fatal
        return 0


def timed(fn, prompts, device, repeats):
    """fn(ids) -> result. Warm-up on the first prompt, then `repeats` passes over all prompts;
    returns (seconds of the median pass, the results of the last pass, one per prompt,
    torch.compile graphs built during the timed passes: 0 when the warm-up covered compilation)."""
    fn(prompts[0])
    g0 = dynamo_graphs()
    ts, res = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = [fn(ids) for ids in prompts]
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), res, dynamo_graphs() - g0


def hf_generate(hf, ids, n, **kw) -> list[int]:
    """HF generate, greedy, batch 1, exactly n new tokens (min_new_tokens=n: EOS ignored).
    ids: [1, T] long on the model's device; kw goes to generate. Returns the n new token ids."""
    with torch.inference_mode():
        return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1]:].tolist()


def hf_static_generate(hf, prompts, n, compile_config=None):
    """The hf_static row: fn(ids [1, T]) -> n new token ids, HF generate with ONE
    transformers.StaticCache(config, max_cache_len = longest prompt + n) shared by all prompts
    and reset before each call, so every decode step of every prompt has the same shapes.

    What is compiled: generate's auto-compile (GenerationMixin._valid_auto_compile_criteria:
    a compileable, non-Dynamic cache on cuda/xpu, or any device when compile_config sets
    _compile_all_devices) wraps the model's __call__ in torch.compile (get_compiled_call, HF
    CompileConfig defaults: inductor, mode="reduce-overhead") for the 1-token decode steps; the
    prefill runs eagerly. That is exactly what cache_implementation="static" gets, except that
    HF sizes that cache per call (prompt + max_new_tokens), so prompts of different lengths
    recompile (on the H200: 11.4 tok/s over 4 MT-bench prompts, compilation in the timed pass).
    The cache goes in as `cache=` (transformers >= the rename) or `past_key_values=` (before),
    whichever the model's forward names. compile_config: passed to generate (tests force a
    compile on CPU with it). If this transformers has no StaticCache(config=, max_cache_len=),
    falls back to per-prompt cache_implementation="static" with a printed warning."""
    kw = {} if compile_config is None else {"compile_config": compile_config}
    max_len = max(ids.shape[1] for ids in prompts) + n  # positions written: 0 .. T + n - 2
    try:
        from transformers import StaticCache
        cache = StaticCache(config=hf.config, max_cache_len=max_len)
    except (ImportError, TypeError) as e:
        print(f"warning: hf_static: transformers.StaticCache(config=, max_cache_len=) unavailable "
              f"({type(e).__name__}: {e}); falling back to per-prompt "
              f'cache_implementation="static" (recompiles for each new prompt length)', flush=True)
        return lambda ids: hf_generate(hf, ids, n, cache_implementation="static", **kw)
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def fn(ids):
        with torch.inference_mode():  # the cache tensors are inference tensors after 1st use
            cache.reset()
        return hf_generate(hf, ids, n, **{name: cache}, **kw)
    return fn


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    """'4/1/5,3/4/16' -> [(num_steps, eagle_topk, num_draft_tokens), ...]; ValueError naming
    the bad entry (the Engine checks SGLang's rules on each)."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split("/")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"{item!r}: a config is num_steps/eagle_topk/num_draft_tokens, "
                             "positive integers, e.g. 4/1/5 or 3/4/16")
        out.append(tuple(int(x) for x in parts))
    return out


def config_name(c) -> str:
    return "spec " + "/".join(map(str, c))


def verify_ms(e, n: int, iters: int = 50) -> float:
    """Median ms of one compiled verify step of Engine e at cache length n: the chain's verify
    [1, K+1] over e.W rows, or the tree's verify_tree over e.W rows (forward, acceptance, KV
    commit) with a chain-shaped tree (the cost does not depend on the tree's shape). Tokens 0;
    it writes cache rows n.. that the next prefill rewrites."""
    dev, N, sl = e.device, e.N, e.slots
    toks = torch.zeros(1, N, dtype=torch.long, device=dev)
    if e.topk == 1:
        def fn():
            return e.steps["verify"](e.target, toks, sl[n:n + e.W], e.kernels)
    else:
        ar = torch.arange(N, device=dev)
        tree = (toks, ar - 1, ar[:, None] >= ar[None, :], ar)

        def fn():
            return e.steps["tree_verify"](e.target, *tree, sl[n:n + 1], sl[:e.W], e.D, e.kernels)
    ts = []
    with torch.inference_mode():
        for i in range(iters + 3):  # 3 warm-up calls
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def spec_stats(sts: list, c) -> dict:
    """A spec row's columns from the Stats of one pass (c = num_steps/eagle_topk/draft tokens)."""
    K, k, n = c
    rounds = sum(st.rounds for st in sts)
    return dict(num_steps=K, eagle_topk=k, num_draft_tokens=n,
                tau=sum(sum(st.accepted) + st.rounds for st in sts) / rounds,
                accept_per_pos=[sum(st.accept_per_pos(K)[j] * st.rounds for st in sts) / rounds
                                for j in range(K)],
                draft_ms_per_round=1000 * sum(st.draft_s for st in sts) / rounds,
                verify_ms_per_round=1000 * sum(st.verify_s for st in sts) / rounds)


def random_smollm2(device: str, dtype: str):
    """An HF LlamaForCausalLM with SmolLM2-135M's geometry and random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    dev = "cuda" if device == "auto" and torch.cuda.is_available() else \
        ("cpu" if device == "auto" else device)
    dt = {"auto": torch.bfloat16 if dev == "cuda" else torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16}[dtype]
    c = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, rope_theta=1e5,
                    max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    m = LlamaForCausalLM(c).to(device=dev, dtype=dt).eval()
    return m, c.to_dict()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: fetched SmolLM2)")
    ap.add_argument("--random-target", action="store_true", help="random weights with SmolLM2-135M "
                    "geometry (no GGUF/tokenizer needed; speed only, e.g. on a bare GPU box)")
    ap.add_argument("--draft", default=None, help="exported EAGLE-3 drafter dir (SGLang format)")
    ap.add_argument("--random-draft", action="store_true", help="export a random drafter (tau~1)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--mtbench", type=int, default=0, help="use the first N MT-bench questions "
                    "(first turns, chat template) instead of the built-in prompt")
    ap.add_argument("--steps", type=int, default=3, help="num_steps of the one chain config "
                    "when --configs is not given")
    ap.add_argument("--configs", default=None, help="comma list of num_steps/eagle_topk/"
                    "num_draft_tokens, e.g. 4/1/5,5/4/8,3/4/16 (default: STEPS/1/STEPS+1)")
    ap.add_argument("--verify-cost", default="4/1/5,3/4/16", help="CHAIN,TREE configs whose "
                    "verify steps are timed against each other (needs a drafter); none: skip")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cuda-graph", action="store_true", help="compile the engine's steps")
    ap.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"),
                    help="the engine's target forwards and chain draft steps: triton = the fused "
                    "kernels (kernels/), torch = the models' forward, auto = torch")
    ap.add_argument("--width", default="auto", help="rows of every engine target forward "
                    "(engine/speculative.py Engine width): auto = engine.speculative.default_width (the largest "
                    "num_draft_tokens in bf16/fp16 on the torch path, then a 1-row decode baseline "
                    "is timed too, as base_1row; none on the fused path), none = plain 1-row "
                    "decode, or N")
    ap.add_argument("--skip", default="", help="comma list of rows to skip (hf,hf_static,hf_lookup)")
    ap.add_argument("--out", default="bench_engine", help="output prefix (.json, .md)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.new < 2 or a.repeats < 1:
        ap.error("--steps >= 1, --new >= 2 (one verify round at least) and --repeats >= 1")
    try:
        configs = parse_configs(a.configs or f"{a.steps}/1/{a.steps + 1}")
        vcost = [] if a.verify_cost == "none" else parse_configs(a.verify_cost)
    except ValueError as e:
        ap.error(f"--configs / --verify-cost: {e}")
    if len(vcost) not in (0, 2):
        ap.error("--verify-cost takes two configs, CHAIN,TREE (e.g. 4/1/5,3/4/16), or none")
    Kmax = max(c[0] for c in configs + vcost)
    Nmax = max(c[2] for c in configs + vcost)
    if not 0 <= a.mtbench <= 80 or (a.mtbench and a.random_target):
        ap.error("--mtbench takes 0..80 (MT-bench has 80 questions) and needs the real target "
                 "(not --random-target: random weights have no tokenizer)")
    if a.width not in ("auto", "none") and not (a.width.isdigit() and int(a.width) >= Nmax):
        ap.error(f"--width: auto, none, or an integer >= the largest num_draft_tokens = {Nmax} "
                 f"(got {a.width!r})")
    torch.set_num_threads(min(torch.get_num_threads(), 16))

    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.engine.speculative import Engine, default_width, engine_kernels, slots_needed
    from eagle3_runner.models.llama import from_hf_model
    if a.random_target:
        hf, cfg = random_smollm2(a.device, a.dtype)
        dev = next(hf.parameters()).device
        prompts = [torch.randint(0, cfg["vocab_size"], (1, 48),
                                 generator=torch.Generator().manual_seed(0)).to(dev)]
    else:
        from eagle3_runner.targets.load import load_target
        from eagle3_runner.runner.assets import asset_path
        hf, tok, cfg = load_target(a.target or asset_path("smollm2"), device=a.device, dtype=a.dtype)
        dev = next(hf.parameters()).device
        if a.mtbench:
            from eagle3_runner.data.prompts import mtbench
            msgs = [q["messages"] for q in mtbench(a.mtbench)]
        else:
            msgs = [[{"role": "user", "content": PROMPT}]]
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"].to(dev) for m in msgs]
    N = a.new
    T = max(ids.shape[1] for ids in prompts)
    skip = set(filter(None, a.skip.split(",")))
    res = {"device": str(dev), "dtype": str(next(hf.parameters()).dtype), "prompts": len(prompts),
           "max_prompt_tokens": T, "new_tokens": N, "configs": configs, "cuda_graph": a.cuda_graph,
           "repeats": a.repeats, "rows": {}}
    total = N * len(prompts)

    def row(s, outs, **extra):
        return {"tok_s": total / s, "ms_per_token": 1000 * s / total, "tokens": outs, **extra}

    for name in ("hf", "hf_static", "hf_lookup"):
        if name in skip:
            continue
        try:
            kw = {"prompt_lookup_num_tokens": 10} if name == "hf_lookup" else {}
            fn = (hf_static_generate(hf, prompts, N) if name == "hf_static" else
                  (lambda ids, kw=kw: hf_generate(hf, ids, N, **kw)))
            s, outs, nc = timed(fn, prompts, dev, a.repeats)
            res["rows"][name] = row(s, outs, compiles_in_timed_pass=nc)
        except Exception as e:  # an HF path unsupported here: record why, keep going
            res["rows"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(name, {k: v for k, v in res["rows"][name].items() if k != "tokens"}, flush=True)

    L = cfg["num_hidden_layers"]
    aux = tuple(default_aux_ids(L))  # SGLang's default aux layers
    target = from_hf_model(hf, aux)
    draft_dir = a.draft
    if draft_dir is None and a.random_draft:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from engine_helpers import export_drafter
        draft_dir = export_drafter(Path(tempfile.mkdtemp()) / "d", hf.config, aux, draft_vocab=2048)
    d = None if draft_dir is None else load_exported(draft_dir, target.embed_tokens.weight,
                                                     device=dev, dtype=target.lm_head.weight.dtype)
    kn = engine_kernels(a.kernels, target, d)  # one resolved value for every engine
    width = (default_width(target, Kmax, Nmax, kn) if a.width == "auto" else
             None if a.width == "none" else int(a.width))
    res.update(width=width, kernels=kn)
    max_seq = max(slots_needed(T, N, K, max(width or 0, n), k) for K, k, n in configs + vcost)
    eng_kw = dict(max_seq=max_seq, cuda_graph=a.cuda_graph, kernels=kn)

    def save():  # after every row: a run cut short by a time limit keeps what it measured
        Path(a.out + ".json").write_text(json.dumps(res, indent=1))
        Path(a.out + ".md").write_text(markdown(res, a.repeats) + "\n")

    def measure(name, fn, stats=None):  # one timed row; an error is recorded, the run goes on
        try:  # stats(results of the last pass) -> (tokens per prompt, extra columns)
            s, outs, nc = timed(fn, prompts, dev, a.repeats)
            outs, extra = stats(outs) if stats else (outs, {})
            res["rows"][name] = row(s, outs, compiles_in_timed_pass=nc, **extra)
        except Exception as e:  # noqa: BLE001 - a failed row must not lose the others
            res["rows"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            print(name, {k: v for k, v in res["rows"][name].items() if k != "tokens"}, flush=True)
            save()

    if width is not None:  # the plain 1-row decode, for reference
        b1 = Engine(target, None, num_steps=Kmax, **eng_kw)
        measure("base_1row", lambda ids: b1.generate_baseline(ids, N)[0])
    base = Engine(target, None, num_steps=Kmax, width=width, **eng_kw)
    measure("base", lambda ids: base.generate_baseline(ids, N)[0])
    engines = {}
    for c in configs if d is not None else []:
        K, k, n = c
        try:
            engines[c] = eng = Engine(target, d, num_steps=K, eagle_topk=k, num_draft_tokens=n,
                                      width=width, **eng_kw)
        except Exception as e:  # noqa: BLE001
            res["rows"][config_name(c)] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        measure(config_name(c), lambda ids: eng.generate(ids, N), lambda runs, c=c: (
            [o for o, _ in runs], spec_stats([st for _, st in runs], c)))
    if d is not None and vcost:  # each verify at its own width (K+1 or N rows)
        try:
            ms = []
            for K, k, n in vcost:  # a config's engine when it has that width already
                e = engines.get((K, k, n))
                if e is None or e.W != n:
                    e = Engine(target, d, num_steps=K, eagle_topk=k, num_draft_tokens=n,
                               **eng_kw)
                ms.append(verify_ms(e, T))
            res["verify_cost"] = {"configs": vcost, "prefix_tokens": T, "ms": ms,
                                  "ratio": ms[1] / ms[0]}
        except Exception as e:  # noqa: BLE001
            res["verify_cost"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    save()
    md = markdown(res, a.repeats)
    print(md)
    return res


def markdown(res: dict, repeats: int) -> str:
    """The table of a (possibly partial) result. Speed is compared with the plain 1-row decode
    (what runs without speculation); tokens with the W-row decode (bit-exact reference), as in
    the bench stage (jobs/bench.py)."""
    rows = res["rows"]
    ok = {k: r for k, r in rows.items() if "tok_s" in r}
    out = ok.get("base", {}).get("tokens")
    b = ok.get("base_1row", ok.get("base", {})).get("tok_s")
    for name, r in ok.items():
        r["vs_base"] = r["tok_s"] / b if b else float("nan")
        if name.startswith("spec "):
            r["speedup_vs_base"] = r["vs_base"]
    lines = [f"device {res['device']} {res['dtype']}, {res['prompts']} prompt(s) of <= "
             f"{res['max_prompt_tokens']} tokens, {res['new_tokens']} new tokens each, greedy, "
             f"batch 1, median of {repeats} pass(es), cuda_graph={res['cuda_graph']}, engine "
             f"kernels={res.get('kernels')}, width={res.get('width')}", "",
             "| path | tok/s | ms/token | vs plain engine baseline | tau | draft ms/round | "
             "verify ms/round | same tokens as base |", "|---|---|---|---|---|---|---|---|"]
    f = lambda r, k: f"{r[k]:.2f}" if k in r else ""  # noqa: E731
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]} | | | | | | |")
            continue
        same = r.get("tokens") == out if out is not None else ""
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r['ms_per_token']:.2f} | {r['vs_base']:.2f}x "
                     f"| {f(r, 'tau')} | {f(r, 'draft_ms_per_round')} | "
                     f"{f(r, 'verify_ms_per_round')} | {same} |")
    v = res.get("verify_cost")
    if v and "error" in v:
        lines += ["", f"verify cost: error: {v['error']}"]
    elif v:
        lines += ["", f"verify cost at {v['prefix_tokens']} prefix tokens (own width, median of "
                  f"50): {config_name(v['configs'][0])} {v['ms'][0]:.3f} ms, "
                  f"{config_name(v['configs'][1])} {v['ms'][1]:.3f} ms, ratio {v['ratio']:.2f}x"]
    late = [f"{k} ({r['compiles_in_timed_pass']})" for k, r in rows.items()
            if r.get("compiles_in_timed_pass")]
    if late:
        lines += ["", "note: torch.compile built graphs inside the timed pass of: " + ", ".join(late)
                  + " (their tok/s include compilation)"]
    return "\n".join(lines)


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
