"""Bench stage: tau and tok/s of the exported drafter against a no-speculation baseline measured in
the same run, over the sweep declared in stages.bench (configs x cuda_graph x max_new_tokens x
prompt_sets). Rows: table `bench` per (config, prompt), `bench_summary` per configuration.

Rows, summaries, metric definitions, the speed model and train_samples are the same for every
backend: runner/bench_rows.py.

Two roles of the baseline: its speed is the plain 1-row greedy decode (what a user gets without
speculation), and "lossless" compares the speculative tokens with the baseline decoded through the
same W-row forward as the verify (engine.speculative.default_width: on the torch path bf16 rounds a
1-row and a W-row forward differently). For a float32 target, and on the fused path (kernels
triton: a row's bits do not depend on the row count), W is None and one pass serves both; for bf16
on the torch path the bench runs both passes (on the H200 an 8-row decode step cost 2.53 ms against
2.05 ms for 1 row, so timing the W-row pass would inflate every speedup by ~24%).

A temperature-0 prompt that is not lossless gets one more plain target forward (divergence): where
its tokens first leave the baseline's and the target's own top1 - top2 logit gap there, so the
summary tells bf16 near-ties from bugs (runner.bench_rows.lossless_verdict, NEAR_TIE).

The drafter: the export stage's artifact, or stages.bench.drafter (`drafter_dir`).

A bench cut short (Ctrl-C, a Slurm or device time limit) resumes: each SGLang server's recording
is marked complete once it answered every request (targets/sglang_bench.py keep_measured), each
embedded baseline and configuration is kept as it completes (runner/bench_rows.py save_part, in
out_dir/parts/), and a rerun the plan calls `incomplete: resuming partial output` measures only
the rest. Only parts measured on this machine as booted now are kept (runner/bench_rows.py
machine), so no speed ratio mixes two machines; a fresh run (--force, another drafter or spec)
drops them. Every decode,
on either backend, stops at the target's end-of-turn ids (targets/load.py end_of_turn_ids: the
generation config's, not the tokenizer's eos), sent to SGLang as stop_token_ids.

backend: embedded = engine/speculative.py (chains and trees: every configuration of
stages.bench.configs, each engine verifying its num_draft_tokens; stages.bench.kernels, resolved
once for all engines by engine_kernels, recorded in every row); sglang = real SGLang servers
(targets/sglang_bench.py; this process imports no torch); both = the two on the same prompts in
one stage: the servers start while the engines compile, decode while this process idles, and are
stopped before the engines decode; then SGLang's outputs are compared with the embedded engine's
greedy baseline, with margins from the target's own forward (divergence), and the embedded
summaries get the speed SGLang would give (predicted_*) from the SGLang round-cost profile just
measured (or stages.bench.speed_profile), next to what SGLang measured (view bench_parity).

The embedded rows record the machine's load next to their timings (runner/cpu.py Meter: the CPU
time other processes used on this process's cores while each prompt's baseline and speculative
decodes ran; cores, torch threads, the 1-min load average); rows and summaries measured on a busy
machine are flagged `busy machine`, and the stage prints a warning. Torch's threads are sized to
the cores this process gets, idle ones sleeping (runner/cpu.py stage_threads).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from eagle3_runner.runner.bench_curve import curve_snapshots, predicted
from eagle3_runner.runner.bench_rows import (PARTS, config_fields, config_id, explain,
                                             first_divergence, load_part, prompt_row, save_part,
                                             save_results, summary_row, train_samples)
from eagle3_runner.runner.cpu import BUSY_CORES, Meter, busy, cores, load_columns, stage_threads
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write, expand_path
from eagle3_runner.runner.stage import StageContext

SGLANG_EXTRA = "pip install 'eagle3-runner[sglang]'"


def check_backend(spec) -> None:
    """Plan/validation-time check (no torch): backend sglang needs sglang importable by
    stages.bench.sglang.python (the embedded engine runs every configuration, chains and trees).
    Raises StageError naming the fix."""
    b = spec.stages.bench
    if b is None or b.backend == "embedded":
        return
    from eagle3_runner.targets.sglang import sglang_available
    ok, why = sglang_available(b.sglang.python)
    if not ok:
        raise StageError(f"stages.bench.backend = {b.backend}: sglang is not importable by "
                         f"{b.sglang.python!r} ({why}). Install the optional extra: "
                         f"`{SGLANG_EXTRA}`, or set stages.bench.sglang.python to an "
                         "interpreter that has it, or bench on the embedded engine "
                         "(stages.bench.backend: embedded; Llama-family targets).")


def summarize(cfg: dict, rows: list[dict], base: list[dict], threads: int | None = None,
              n_cores: int | None = None) -> dict:
    """The bench_summary row of one configuration (cfg: bench_results.config_fields) from its
    per-prompt rows and their baseline decodes (sums, not means of ratios). The machine's load
    over all of them: the rows' and baselines' `_window`/`window` (runner/cpu.py Meter), when
    measured."""
    rounds = sum(r["verify_ct"] for r in rows)
    toks = sum(r["_tokens_in_rounds"] for r in rows)
    tau = toks / rounds if rounds else float("nan")
    K, k, N, kn = (rows[0][f] for f in ("num_steps", "eagle_topk", "num_draft_tokens", "kernels"))
    per_pos = [sum(json.loads(r["accept_per_pos"])[j] * r["verify_ct"] for r in rows) /
               max(rounds, 1) for j in range(K)]
    spec_s = sum(r["_total_s"] for r in rows)
    base_s = sum(b["total_s"] for b in base)
    spec_tok_s = sum(r["new_tokens"] for r in rows) / spec_s
    base_tok_s = sum(b["new_tokens"] for b in base) / base_s
    base_ms = 1000 * base_s / sum(b["new_tokens"] for b in base)
    dms, vms = (1000 * sum(r[k] for r in rows) / max(rounds, 1) for k in ("draft_s", "verify_s"))
    oms = 1000 * sum(r["other_s"] for r in rows) / max(rounds, 1)
    _, be, text = explain(tau, K, dms, vms, oms, base_ms)
    text = (f"{'tree' if k > 1 else 'chain'} {K}/{k}/{N} (num_steps/eagle_topk/num_draft_tokens)"
            f", kernels {kn}: " + text)
    text += (f" Measured end to end (prefill and first token included): {spec_tok_s:.1f} vs "
             f"{base_tok_s:.1f} tok/s = {spec_tok_s / base_tok_s:.2f}x.")
    windows = [x for x in [*(r.get("_window") for r in rows), *(b.get("window") for b in base)]
               if x is not None]
    load = load_columns(windows, threads, n_cores) if windows else None
    return summary_row(cfg, rows, tau, spec_tok_s, base_tok_s, be, text, load=load,
                       accept_per_pos=json.dumps(per_pos), draft_ms_per_round=dms,
                       verify_ms_per_round=vms, other_ms_per_round=oms)


def divergence(target, ids, spec: list[int], base: list[int]) -> dict | None:
    """Where greedy speculative tokens `spec` first differ from the baseline's `base` (new token
    ids, after prompt ids [1, T]) and how close the target's own choice was there: ONE plain
    forward of the target (engine.steps.prefill: eager Llama.forward, float32 logits) over
    prompt + the common prefix base[:k], logits [V] at its last position. It writes cache slots
    0..T+k-1, which the next generate's prefill overwrites; the target's cache must hold T+k
    (Llama.setup_cache; the bench's engines size it for T + max_new).
    Returns None when spec == base, else the bench_results.NO_DIVERGENCE keys: diverge_at = k,
    diverge_margin = top1 - top2 logit (float32, >= 0), diverge_runner_up = spec[k] is the
    target's 2nd-ranked token (None when spec ends at k)."""
    import torch
    from eagle3_runner.engine.steps import prefill
    k = first_divergence(spec, base)
    if k is None:
        return None
    x = torch.cat([ids, ids.new_tensor([base[:k]])], dim=1)  # [1, T + k]
    with torch.inference_mode():
        logits, _ = prefill(target, x)  # [1, 1, V]
    top = logits[0, -1].topk(2)
    return dict(diverge_at=k, diverge_margin=float(top.values[0] - top.values[1]),
                diverge_runner_up=int(top.indices[1]) == spec[k] if k < len(spec) else None)


def baseline_pass(engine, prompts: list, max_new: int, p, stop: tuple, desc: str,
                  meter: Meter | None = None) -> dict:
    """The engine's no-speculation decode of every prompt, each with a fresh generator seeded
    p.seed. prompts: [(prompt_id, ids [1, T])]. Returns {prompt_id: {"tokens": list[int],
    "total_s": seconds, "new_tokens": int, "window": the machine's load during the decode
    (meter.window; None without a meter)}}."""
    import torch
    from tqdm import tqdm
    out = {}
    for pid, ids in tqdm(prompts, desc=desc, unit="prompt", leave=False):
        g = torch.Generator(device=ids.device).manual_seed(p.seed)
        a = meter.snap() if meter else None
        toks, st = engine.generate_baseline(ids, max_new, p.temperature, g, stop)
        out[pid] = {"tokens": toks, "total_s": st.total_s, "new_tokens": st.new_tokens,
                    "window": meter.window(a, meter.snap()) if meter else None}
    return out


def load_engine_parts(spec, export_dir: Path):
    """(our Llama target, drafter loaded FROM the exported dir, tokenizer, device, the
    transformers model our Llama shares its weights with)."""
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.targets.load import load_target
    hf, tok, _ = load_target(spec)
    p = next(hf.parameters())
    target = from_hf_model(hf, spec.aux_ids)
    try:
        drafter = load_exported(export_dir, target.embed_tokens.weight, device=p.device,
                                dtype=p.dtype)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"export artifact {export_dir}: cannot load the drafter: {e}")
    if tuple(sorted(drafter.config.aux_layer_ids)) != tuple(sorted(spec.aux_ids)):
        raise StageError(f"{export_dir}/config.json: eagle_aux_hidden_state_layer_ids "
                         f"{drafter.config.aux_layer_ids} != spec aux ids {spec.aux_ids}")
    return target, drafter, tok, p.device, hf


def drafter_dir(ctx: StageContext) -> Path:
    """The draft directory to bench: the export artifact, or stages.bench.drafter (an external
    draft, e.g. scripts/bench/specforge_peer.py's), which `runner inspect` must pass first (for
    drafter.sglang_version; export does this for its own). Raises StageError naming the errors."""
    if ctx.params.drafter is None:
        return Path(ctx.inputs["export"])
    from eagle3_runner.runner.inspect import inspect_draft
    d = expand_path(ctx.params.drafter)
    findings = inspect_draft(d, target=expand_path(ctx.spec.target.path),
                             sglang_version=ctx.spec.drafter.sglang_version)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise StageError(f"stages.bench.drafter = {ctx.params.drafter!r} fails `runner inspect`:\n"
                         + "\n".join(f"  {f.code}: {f.message}" for f in errors))
    for f in findings:
        print(f"bench: inspect {f.severity} {f.code}: {f.message}")
    return d


def sglang_part(ctx, export_dir: Path, sets: dict, stop_ids, dtype: str | None,
                snapshots: list[dict] = ()):
    """The sglang backend's SglangBench for this stage (targets/sglang_bench.py). sets:
    {prompt_set: [(prompt_id, input ids list)]}; snapshots: the curve's drafters
    (runner/bench_curve.py curve_snapshots). Raises StageError when the environment fakes
    SGLang's acceptance (SGLANG_SIMULATE_ACC_LEN: the servers inherit it)."""
    import os
    from eagle3_runner.runner.drafts.server import simulate_acc_len_problem
    from eagle3_runner.targets.load import hf_folder
    from eagle3_runner.targets.sglang_bench import SglangBench
    simulated = simulate_acc_len_problem(os.environ)
    if simulated:
        raise StageError(f"bench: {simulated}")
    return SglangBench(ctx.spec, ctx.params, Path(ctx.out_dir), str(hf_folder(ctx.spec)),
                       export_dir, sets, stop_ids, dtype, snapshots, resume=ctx.resuming)


def finish(ctx, export_dir: Path, rows: list[dict], summaries: list[dict], measured,
           sets: dict, compare=None, sims: dict | None = None, curve: list | None = None) -> dict:
    """The stage's end for every backend: the sglang rows (when SGLang ran) and its speed
    profile (sglang_profile.json), the predicted SGLang speed on the embedded summaries
    (stages.bench.speed_profile, else the profile just measured), what the drafter's training
    predicts next to what was measured (`predicted`; sims: `simulated`'s), the learning curve
    (curve: the embedded side's rows; the sglang side's come from `measured`), the results
    saved; returns the stage's metrics."""
    from eagle3_runner.runner.bench_rows import predict, read_profile, speed_profile
    p = ctx.params
    profile, source = None, None
    curve = list(curve or [])
    if measured is not None:
        from eagle3_runner.targets.load import hf_folder
        from eagle3_runner.targets.sglang_bench import curve_rows, rows_and_summaries
        curve += curve_rows(measured, p, sets)
        srows, ssums = rows_and_summaries(measured, p, sets, train_samples(export_dir), compare)
        version = next((s.get("server_version") for s in ssums if s.get("server_version")), None)
        profile = speed_profile(ssums, version, str(hf_folder(ctx.spec)))
        atomic_write(Path(ctx.out_dir) / "sglang_profile.json", json.dumps(profile, indent=1))
        source = "measured by this bench stage"
        rows, summaries = rows + srows, summaries + ssums
    if p.speed_profile:
        try:
            profile, source = read_profile(expand_path(p.speed_profile)), p.speed_profile
        except ValueError as e:
            raise StageError(f"stages.bench.speed_profile: {e}")
    if profile is not None:
        for s in summaries:
            if s["backend"] == "embedded":
                predict(s, profile, source)
    predicted(summaries, export_dir, sims or {})
    save_results(ctx, rows, summaries, curve)
    done = [s for s in summaries if s.get("n_prompts")]
    for s in done:
        name = (("" if s["backend"] == "embedded" else "sglang/")
                + f"{s['prompt_set']}/{s['config_id']}")
        ctx.metric(f"tau/{name}", s["tau"])
        ctx.metric(f"speedup/{name}", s["speedup"], "x")
    if not done:
        raise StageError("bench: no configuration was measured:\n" + "\n".join(
            s["explanation"] for s in summaries))
    taus = [s["tau"] for s in done]
    return {"tau": statistics.mean(taus), "speedup": statistics.mean(s["speedup"] for s in done),
            "min_tau": min(taus), "summaries": len(summaries),
            "failed": len(summaries) - len(done),
            "lossless": all(s["lossless"] is not False for s in done)}


def run_sglang_only(ctx: StageContext, export_dir: Path) -> dict:
    """backend sglang: no torch in this process, only the servers (no divergence margins)."""
    from eagle3_runner.data.prompts import load_prompt_set, render
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer
    p, spec = ctx.params, ctx.spec
    tok = load_tokenizer(spec)
    sets = {s: [(q["id"], render(tok, q["messages"]))
                for q in load_prompt_set(s, spec, p.num_prompts)] for s in p.prompt_sets}
    sgl = sglang_part(ctx, export_dir, sets, end_of_turn_ids(spec, tok),
                      _server_dtype(spec.target.dtype), curve_snapshots(export_dir, p.curve))
    sgl.start()
    return finish(ctx, export_dir, [], [], sgl.measure(), sets)


def _server_dtype(dtype: str) -> str:
    """--dtype for the servers from target.dtype (auto: bfloat16, the GPU default of
    targets.load)."""
    return "bfloat16" if dtype == "auto" else dtype


def run(ctx: StageContext) -> dict:
    p, spec = ctx.params, ctx.spec
    export_dir = drafter_dir(ctx)
    check_backend(spec)
    if not ctx.resuming:  # a fresh bench (--force, a new drafter): nothing an earlier run kept
        import shutil
        shutil.rmtree(Path(ctx.out_dir) / PARTS, ignore_errors=True)
    if p.backend == "sglang":
        return run_sglang_only(ctx, export_dir)
    import torch
    stage_threads()  # torch is in now: its threads sized to this process's cores

    from eagle3_runner.data.prompts import load_prompt_set, render
    from eagle3_runner.targets.load import end_of_turn_ids

    target, drafter, tok, device, hf = load_engine_parts(spec, export_dir)
    stop = end_of_turn_ids(spec, tok)
    snaps = curve_snapshots(export_dir, p.curve)
    sets = {s: [(q["id"], torch.tensor([render(tok, q["messages"])], device=device))
                for q in load_prompt_set(s, spec, p.num_prompts)] for s in p.prompt_sets}
    sgl_sets = {s: [(pid, ids[0].tolist()) for pid, ids in v] for s, v in sets.items()}
    sgl = None
    if p.backend == "both":  # its servers start while the engines below compile
        dtype = str(target.lm_head.weight.dtype).removeprefix("torch.")
        sgl = sglang_part(ctx, export_dir, sgl_sets, stop, dtype, snaps)
        sgl.start()
    try:
        rows, summaries, ours, measured = _embedded(ctx, export_dir, target, drafter, device,
                                                    sets, stop, sgl)
    finally:
        if sgl is not None:
            sgl.close()
    from eagle3_runner.trainer.acceptance import bench_simulations
    sims, curve = bench_simulations(p, hf, target, drafter, device, sets, ours, snaps)
    compare = None
    if measured is not None:
        from eagle3_runner.targets.sglang_bench import Compare
        by_id = {s: dict(v) for s, v in sets.items()}
        compare = Compare(ours, lambda s, pid, a, b: divergence(target, by_id[s][pid], a, b))
    return finish(ctx, export_dir, rows, summaries, measured, sgl_sets, compare, sims, curve)


def build_engines(p, target, drafter, sets: dict, stop: tuple, cg: bool, configs=None,
                  baseline: bool = True) -> tuple:
    """The bench's engines for one cuda_graph setting, built and warmed up (compiled when cg):
    the plain decode for speed and the W-row reference for tokens (the same engine when width
    is None; both None without `baseline`), and one speculative engine per configuration of
    `configs` (default p.configs; a resumed bench builds only what it has left). p: stages.bench;
    sets: {prompt_set: [(prompt_id, ids [1, T])]}. Shapes (width, max_seq) always follow all of
    p.configs, so every engine is the one a whole bench builds. Returns (plain, ref, {SpecParams:
    Engine}, kernels, width). scripts/bench/warm_bench.py calls it with a random drafter of the
    same geometry, so a later bench finds inductor's compiled graphs in its on-disk cache.
    Raises StageError for kernels the target or drafter cannot run."""
    from eagle3_runner.engine.speculative import Engine, default_width, engine_kernels, slots_needed
    Kmax = max(c.num_steps for c in p.configs)
    Nmax = max(c.draft_tokens for c in p.configs)
    try:
        kn = engine_kernels(p.kernels, target, drafter)  # one resolved value for every engine
    except ValueError as e:
        raise StageError(f"stages.bench.kernels = {p.kernels!r}: {e}")
    # bf16 on the torch path: one row count for all, so outputs match exactly (None when fused)
    width = default_width(target, Kmax, Nmax, kn)
    longest = max(ids.shape[1] for v in sets.values() for _, ids in v)
    new = max(max(p.max_new_tokens), 2 * Kmax + 4)  # the warm-ups make 2K+4 tokens
    max_seq = max(slots_needed(longest, new, c.num_steps, max(width or 0, c.draft_tokens),
                               c.eagle_topk) for c in p.configs)
    # rounded up to a multiple of 256: the KV-cache shape is part of every compiled graph, so
    # benches of other prompt sets (variants) reuse inductor's on-disk graph cache
    max_seq = -(-max_seq // 256) * 256
    warm = next(iter(sets.values()))[0][1]
    t0 = time.perf_counter()
    kw = dict(max_seq=max_seq, cuda_graph=cg, kernels=kn)
    plain = ref = None
    if baseline:
        plain = Engine(target, None, num_steps=Kmax, **kw)  # speed
        ref = plain if width is None else Engine(target, None, num_steps=Kmax, width=width,
                                                 **kw)  # tokens
        for b in [plain] if ref is plain else [plain, ref]:
            b.generate_baseline(warm, 4, stop_ids=stop)  # warm-up (compiles when cg)
        print(f"bench: baseline engine(s) built and warmed in {time.perf_counter() - t0:.1f} s "
              f"(max_seq {max_seq}, width {width}, kernels {kn}, cuda_graph {cg})", flush=True)
    engines = {}
    for c in (p.configs if configs is None else configs):
        t0 = time.perf_counter()
        e = Engine(target, drafter, num_steps=c.num_steps, eagle_topk=c.eagle_topk,
                   num_draft_tokens=c.draft_tokens, sampling=p.temperature > 0,
                   width=width, **kw)
        e.generate(warm, 2 * c.num_steps + 4, stop_ids=stop)  # warm-up
        engines[c] = e
        print(f"bench: engine {c.num_steps}/{c.eagle_topk}/{c.draft_tokens} built and warmed "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return plain, ref, engines, kn, width


def _measure_config(cfg: dict, c, e, target, prompts: list, base: dict, max_new: int, p,
                    stop: tuple, device, meter, threads: int, n_cores: int) -> list[dict]:
    """The `bench` rows of configuration c (engine e) over `prompts`, against their baseline
    decodes `base` (baseline_pass): tau, speed, losslessness (with the divergence margins) and
    the machine's load per prompt."""
    import torch
    from tqdm import tqdm
    rows = []
    for pid, ids in tqdm(prompts, desc=f"bench {cfg['prompt_set']} {cfg['config_id']}",
                         unit="prompt", leave=False):
        g = torch.Generator(device=device).manual_seed(p.seed)
        a = meter.snap()
        toks, st = e.generate(ids, max_new, p.temperature, g, stop)
        w = meter.window(a, meter.snap())
        b = base[pid]
        same = (toks == b["tokens"]) if p.temperature == 0 else None
        rows.append(prompt_row(
            cfg, pid, st.tau, st.new_tokens, st.rounds, st.new_tokens / st.total_s,
            b["new_tokens"] / b["total_s"], same,
            divergence(target, ids, toks, b["tokens"]) if same is False else None,
            accept_per_pos=json.dumps(st.accept_per_pos(c.num_steps)),
            draft_s=st.draft_s, verify_s=st.verify_s,
            other_s=st.total_s - st.draft_s - st.verify_s,
            load=load_columns([b["window"], w], threads, n_cores), _window=w,
            _tokens_in_rounds=sum(st.accepted) + st.rounds, _total_s=st.total_s))
    return rows


def _embedded(ctx, export_dir: Path, target, drafter, device, sets: dict, stop: tuple, sgl):
    """The embedded engine over every cuda_graph setting, configuration, prompt set and
    max_new_tokens; measures the SGLang servers of `sgl` (started by the caller) once the first
    engines are built, before any embedded decode. Returns (bench rows, summaries, the greedy
    baseline tokens per (cuda_graph, prompt_set, max_new_tokens, prompt_id), SGLang's
    measurements or None)."""
    import torch
    from tqdm import tqdm
    p = ctx.params
    measured = None
    trained_on = train_samples(export_dir)
    meter, threads, n_cores = Meter(), torch.get_num_threads(), cores()
    print(f"bench: {threads} torch thread(s) on {n_cores} core(s)", flush=True)
    out = Path(ctx.out_dir)
    all_rows, summaries, ours = [], [], {}
    for cg in p.cuda_graph:
        # parts an earlier run of this stage measured on this machine (runner/bench_rows.py
        # save_part): a bench cut short goes on where it stopped
        base_part = {(s, mx): load_part(out, f"embedded-cg{int(cg)}-{s}-m{mx}-baseline")
                     for s in sets for mx in p.max_new_tokens}
        cfg_part = {(c, s, mx): load_part(out, f"embedded-{config_id(c, cg, mx)}-{s}")
                    for c in p.configs for s in sets for mx in p.max_new_tokens}
        todo = [c for c in p.configs if any(cfg_part[c, s, mx] is None for s in sets
                                            for mx in p.max_new_tokens)]
        plain, ref, engines, kn, width = build_engines(
            p, target, drafter, sets, stop, cg, todo, any(v is None for v in base_part.values()))
        if sgl is not None and measured is None:  # this process idles while SGLang decodes
            t0 = time.perf_counter()
            measured = sgl.measure()
            print(f"bench: sglang servers measured in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        for set_name, prompts in sets.items():
            for max_new in p.max_new_tokens:
                kept = base_part[set_name, max_new]
                if kept is not None:
                    base = kept["base"]
                else:
                    base = baseline_pass(plain, prompts, max_new, p, stop,
                                         f"bench {set_name} baseline", meter)
                    if ref is not plain:  # the bit-exact reference keeps its own tokens only
                        ref_toks = baseline_pass(ref, prompts, max_new, p, stop,
                                                 f"bench {set_name} baseline, {width} rows")
                        for pid in base:
                            base[pid]["tokens"] = ref_toks[pid]["tokens"]
                    save_part(out, f"embedded-cg{int(cg)}-{set_name}-m{max_new}-baseline",
                              {"base": base})
                for pid in base:
                    ours[cg, set_name, max_new, pid] = base[pid]["tokens"]
                for c in p.configs:
                    cfg = config_fields(c, cg, max_new, p.temperature, "embedded", set_name,
                                        trained_on, kn)
                    part = cfg_part[c, set_name, max_new]
                    rows = part["rows"] if part is not None else _measure_config(
                        cfg, c, engines[c], target, prompts, base, max_new, p, stop, device,
                        meter, threads, n_cores)
                    if part is None:
                        save_part(out, f"embedded-{cfg['config_id']}-{set_name}", {"rows": rows})
                    summ = summarize(cfg, rows, [base[pid] for pid, _ in prompts], threads,
                                     n_cores)
                    if width is not None:
                        summ["explanation"] += (f" Baseline speed: the plain 1-row decode; lossless:"
                                                f" tokens equal to the {width}-row decode's.")
                    if kept is not None or part is not None:
                        summ["explanation"] += (" Resumed: parts measured by an earlier run of "
                                                "this stage on this machine (same boot).")
                    if cg and device.type != "cuda":
                        summ["flags"] = ", ".join(x for x in [summ["flags"],
                                                              "cuda_graph ignored on cpu"] if x)
                    summaries.append(summ)
                    all_rows += rows
    hot = [s for s in summaries if busy(s)]
    if hot:
        print(f"bench: WARNING: {len(hot)}/{len(summaries)} configuration(s) measured on a busy "
              f"machine (other processes used >= {BUSY_CORES} of {n_cores} core(s)): flagged "
              "`busy machine`; their times measure the machine, not the drafter. Bench again on "
              "an idle machine: runner apply SPEC --force bench --only bench", flush=True)
    return all_rows, summaries, ours, measured
