#!/usr/bin/env python
"""SGLang as the target against our own paths, on the same inputs in one run (issue 35;
BENCHMARKS.md rows come from it). Target: the fetched SmolLM2-135M (its GGUF converted once by
targets/load.py; the server loads that folder at --dtype bfloat16). The SGLang server is launched
by the runner's own code (targets/sglang_target.py) with the interpreter --sglang-python.

  regen    the same ShareGPT first turns (rendered by our chat template) answered
             sglang    engine/sglang_generate.py SglangGenerator: --in-flight requests over
                       batched streamed /generate calls of --per-call prompts (server: CUDA
                       graphs up to --graph-bs rows)
             embedded  engine/generate.py Generator: --rows rows, CUDA graphs; each answer as
                       long as SGLang's answer to that prompt (no stop ids), so both make the
                       same tokens
           -> new tok/s of each and the ratio; then jobs/regenerate.py regenerate() through
           the same server on the same prompts (`stage_same`: one turn each, no synthetic
           prompts, no budget; the radix cache flushed before each pass): its tok/s over the
           raw rate (issue 45's target: >= 0.9), the answers of equal length, and both passes'
           request windows (engine/sglang_generate.py window_metrics: in-flight mean, host
           share, short share, tail); then regenerate() end to end (--e2e-real ShareGPT
           conversations, every turn, + --e2e-synthetic Magpie prompts) within --e2e-minutes:
           the stage's tok/s and conversations/s, with its window; then a small regenerate()
           through a recording proxy (scripts/bench/sglang_record.py) for the CPU tests'
           fixtures (--record DIR).
  capture  the same tokenised ShareGPT samples (--samples, data.max_length --max-length)
             hf        targets/capture.py capture() (transformers, bf16, forward hooks) in
                       --batch-tokens batches, features copied to the CPU (extract's path)
             embedded  targets/capture_embedded.py (online training's packed capture on our
                       Llama, compiled), the same batches, copied to the CPU
             sglang    targets/capture.py capture_sglang through one capture server, json
                       transport (meta_info.hidden_states) and file transport (raw bf16 rows)
           -> captured tok/s of each, JSON bytes per token, and the largest difference of the
           SGLang rows from HF's on the first batch; then a few short prompts through the
           recording proxy (--record DIR).
Each phase stops at its time box (--box seconds, checked between batches); results so far are
written to OUT.json / OUT.md after every phase.

  python scripts/bench/bench_sglang_target.py regen --sglang-python ~/sglang-python --out R/regen
  python scripts/bench/bench_sglang_target.py capture --sglang-python ~/sglang-python --out R/cap
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
DEVICE_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
                "--grammar-backend", "none"]  # what the carried SGLang 0.5.14 runs with


def spec_for(a, work: Path, transport: str = "file"):
    """A spec of the fetched SmolLM2 with target.sglang from the flags (the runner's launcher
    reads it)."""
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.spec.load import load_spec
    return load_spec(data={
        "name": "bench-sglang", "work_dir": str(work),
        "target": {"path": str(asset_path("smollm2")), "dtype": "bfloat16", "engine": "sglang",
                   "sglang": {"python": a.sglang_python, "port": a.port,
                              "mem_fraction_static": a.mem_fraction,
                              "cuda_graph_max_bs": a.graph_bs, "transport": transport,
                              "requests_per_call": a.per_call,
                              # running requests beyond the decode CUDA graphs run without
                              # them: 25.6k against 54.0k new tok/s on the H200 (0.5.14)
                              "max_running_requests": a.graph_bs,
                              "startup_timeout_s": 600, "extra_args": DEVICE_FLAGS}},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
        "data": {**SOURCE, "max_length": a.max_length, "max_samples": a.samples},
        "stages": {"regenerate": {"max_new_tokens": a.new, "batch_size": a.in_flight}},
        "results": {"path": str(work / "r.duckdb")}})


SOURCE = {"source": "sharegpt"}  # the conversations every mode reads (--data: a JSONL file instead)


def first_turns(tok, n: int, max_length: int) -> list[tuple[list[dict], list[int]]]:
    """First user turns of ShareGPT conversations (the system turn before it, if any) with their
    rendered ids (the regenerate stage's prompts), those shorter than max_length."""
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.data.prompts import render
    from eagle3_runner.runner.spec.sections import Data
    convs, _, _ = load_conversations(Data(**SOURCE, max_samples=max(2 * n, 64),
                                          max_length=max_length))
    out = []
    for c in convs:
        msgs = [t for t in c if t["role"] == "system"][:1] + \
            [next(t for t in c if t["role"] == "user")]
        ids = render(tok, msgs)
        if len(ids) < max_length:
            out.append((msgs, ids))
        if len(out) == n:
            break
    return out


def save(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(res))


def markdown(res: dict) -> str:
    md = [f"# bench_sglang_target {res.get('mode')} ({res.get('device')}, SGLang "
          f"{res.get('sglang_version')})", ""]
    rows = [(k, v) for k, v in res.items() if isinstance(v, dict) and "tok_s" in v]
    if rows:
        md += ["| path | tokens | seconds | tok/s | notes |", "|---|---|---|---|---|"]
        md += [f"| {k} | {v.get('tokens')} | {v.get('seconds', 0):.2f} | {v['tok_s']:,.0f} | "
               f"{v.get('notes', '')} |" for k, v in rows]
    for k in ("ratio", "stage_same", "stage", "diff", "errors"):
        if k in res:
            md += ["", f"{k}: `{json.dumps(res[k], default=str)}`"]
    return "\n".join(md) + "\n"


class Box:
    """A phase's time box: over() after `seconds`."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def over(self) -> bool:
        return time.monotonic() > self.end


# ----------------------------------------------------------------------------------------------
# regen


def regen(a, res: dict, out: Path) -> None:
    import torch
    from eagle3_runner.engine.generate import Generator, Request
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.runner.engines import GENERATE
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer, target_config
    from eagle3_runner.targets.sglang_target import stage_server
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    spec = spec_for(a, work)
    tok = load_tokenizer(spec)
    turns = first_turns(tok, a.prompts, a.max_length)
    prompts = [ids for _, ids in turns]
    res["prompts"] = len(prompts)
    eos = end_of_turn_ids(spec, tok)
    lengths: dict = {}
    with stage_server(spec, GENERATE, target_config(spec), Path(a.out).parent / "logs") as srv:
        res["sglang_version"] = srv.info.get("version")
        gen = SglangGenerator(srv, a.in_flight, a.new, a.per_call)
        gen.run([Request(("w", i), p, a.new) for i, p in enumerate(prompts[:64])],
                lambda rs: None, 0.0, 1.0, eos)  # warm: the first graphs, the HTTP path
        res["flushed"] = [flush_cache(srv.url)]  # no pass starts with the other's prompts cached
        box = Box(a.box)
        reqs = (Request(i, p, a.new) for i, p in enumerate(prompts) if not box.over())
        st = gen.run(reqs, lambda rs: lengths.update({r.key: len(r.tokens) for r in rs}),
                     0.0, 1.0, eos)
        res["sglang"] = {"tokens": st["new_tokens"], "seconds": st["seconds"],
                         "tok_s": st["new_tokens"] / st["seconds"], "calls": st["prefills"],
                         "wait_share": st["wait_s"] / st["seconds"],
                         **window_of([st], st["seconds"]),
                         "notes": f"{a.in_flight} in flight, {a.per_call} per call"}
        print("sglang", res["sglang"], flush=True)
        save(res, out)
        if a.same:
            res["flushed"].append(flush_cache(srv.url))
            res["stage_same"] = stage_same(a, spec, tok, srv, turns, lengths)
            res["ratio"] = {"stage_same_over_sglang": res["stage_same"]["tok_s"] /
                            res["sglang"]["tok_s"]}
            print("stage_same", res["stage_same"], res["ratio"], flush=True)
            save(res, out)
        if a.e2e_minutes > 0:
            res["stage"] = stage_e2e(a, spec, tok, srv)
            print("stage", res["stage"], flush=True)
            save(res, out)
        if a.record:
            record_regen(a, spec, tok, srv)
    if a.skip_embedded:
        return
    # the embedded Generator on the same prompts, each answer as long as SGLang's
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.targets.load import load_target
    hf, _, _ = load_target(spec)
    target = from_hf_model(hf)
    del hf
    done = sorted(lengths)
    ids = [prompts[i] for i in done]
    gen = Generator(target, rows=a.rows, max_seq=max(map(len, ids)) + a.new + 1, max_new=a.new,
                    cuda_graph=True)
    t0 = time.perf_counter()
    gen.run([Request(("w", i), ids[i], lengths[done[i]]) for i in range(min(a.rows, len(ids)))],
            lambda rs: None)
    res["embedded_warm_s"] = time.perf_counter() - t0
    n = [0]
    st = gen.run([Request(i, x, lengths[k]) for i, (k, x) in enumerate(zip(done, ids))],
                 lambda rs: n.__setitem__(0, n[0] + sum(len(r.tokens) for r in rs)))
    res["embedded"] = {"tokens": n[0], "seconds": st["seconds"], "tok_s": n[0] / st["seconds"],
                       "notes": f"{a.rows} rows, CUDA graphs"}
    res["ratio"] = {**res.get("ratio", {}),
                    "sglang_over_embedded": res["sglang"]["tok_s"] / res["embedded"]["tok_s"]}
    print("embedded", res["embedded"], res["ratio"], flush=True)
    del gen, target
    torch.cuda.empty_cache()


def flush_cache(url: str, seconds: float = 30.0) -> bool:
    """Empty the server's radix cache (SGLang 0.5.14 http_server.py /flush_cache: refused with
    HTTP 400 while requests run or wait, so retried). True when it was flushed."""
    import urllib.error
    import urllib.request
    end = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/flush_cache",
                                                               method="POST"), timeout=30):
                return True
        except (urllib.error.URLError, OSError):
            if time.monotonic() > end:
                return False
            time.sleep(0.5)


def window_of(phases: list, seconds: float) -> dict:
    """engine/sglang_generate.py window_metrics as plain numbers."""
    from eagle3_runner.engine.sglang_generate import window_metrics
    return {k: v[0] for k, v in window_metrics(phases, seconds).items()}


def stage_same(a, spec, tok, srv, turns: list, lengths: dict) -> dict:
    """regenerate() through the running server on the raw pass's prompts (`lengths`: prompt
    index -> answer tokens there): each first turn as a one-turn conversation (its answer is the
    one rewritten), no synthetic prompts, no budget, the raw pass's in-flight and call sizes.
    Its tok/s, the answers as long as the raw pass's (greedy on both: equal, up to SGLang's
    batch-dependent rounding), and its request window."""
    from eagle3_runner.data.regen_store import read_records
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    from eagle3_runner.targets.load import end_of_turn_ids
    done = sorted(lengths)
    convs = [turns[i][0] + [{"role": "assistant", "content": "-"}] for i in done]
    p = RegenerateStage(max_new_tokens=a.new, batch_size=a.in_flight, shard_conversations=8192)
    with tempfile.TemporaryDirectory() as d:
        m = regenerate(None, tok, convs, p, a.max_length, Path(d), None, progress=False,
                       gen=SglangGenerator(srv, a.in_flight, a.new, a.per_call),
                       stop_ids=end_of_turn_ids(spec, tok))
        recs = read_records(Path(d))
    v = {k: (x[0] if isinstance(x, tuple) else x) for k, x in m.items()}
    same = sum(r["answer_tokens"][:1] == [lengths[done[r["index"]]]] for r in recs)
    return {"tokens": v["tokens_generated"], "seconds": v["generation_seconds"],
            "tok_s": v["tokens_per_s"], "conversations": v["conversations"],
            "answers_of_equal_length": same / max(len(done), 1),
            **{k: v[k] for k in v if k.startswith(("sglang_", "host_wait"))},
            "notes": "regenerate() through SGLang, the raw pass's prompts"}


def stage_e2e(a, spec, tok, srv) -> dict:
    """regenerate() through the running server: --e2e-real conversations + --e2e-synthetic."""
    from eagle3_runner.data.contamination import bench_guard
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.spec.sections import Data
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    from eagle3_runner.targets.load import end_of_turn_ids
    real = load_conversations(Data(**SOURCE, max_samples=a.e2e_real, max_length=a.max_length))[0] \
        if a.e2e_real else []
    p = RegenerateStage(max_new_tokens=a.new, batch_size=a.in_flight,
                        synthetic_prompts=a.e2e_synthetic, synthetic_max_tokens=128,
                        shard_conversations=8192, max_minutes=a.e2e_minutes)
    from types import SimpleNamespace
    guard = bench_guard(SimpleNamespace(data=Data(holdout=0)))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        m = regenerate(None, tok, real, p, a.max_length, Path(d), guard, progress=False,
                       gen=SglangGenerator(srv, a.in_flight, a.new, a.per_call),
                       stop_ids=end_of_turn_ids(spec, tok))
        secs = time.perf_counter() - t0
    v = {k: (x[0] if isinstance(x, tuple) else x) for k, x in m.items()}
    return {"seconds": secs, "conversations": v["conversations"],
            "conversations_per_s": v["conversations"] / secs, "tok_s": v["tokens_per_s"],
            "tokens": v["tokens_generated"], "notes": "regenerate() through SGLang", **{
                k: v[k] for k in v if k.startswith(("tokens_per_s", "dropped", "cut", "turns",
                                                    "sglang_", "host_wait", "synthetic"))}}


def record_regen(a, spec, tok, srv) -> None:
    """A small regenerate() through the recording proxy: the CPU tests' generation fixture."""
    from dataclasses import replace
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.spec.sections import Data
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    from eagle3_runner.targets.load import end_of_turn_ids
    from sglang_record import Recorder
    raw = Path(a.record)
    convs = load_conversations(Data(**SOURCE, max_samples=8, max_length=512))[0]
    convs = sorted(convs, key=lambda c: -len(c))[:6]  # multi-turn ones first
    p = RegenerateStage(max_new_tokens=24, batch_size=4, max_turns=2, shard_conversations=64)
    rec = Recorder(srv.url, raw / "generate.jsonl")
    try:
        with tempfile.TemporaryDirectory() as d:
            regenerate(None, tok, convs, p, 512, Path(d), progress=False,
                       gen=SglangGenerator(replace(srv, url=rec.url), 4, 24, 2),
                       stop_ids=end_of_turn_ids(spec, tok))
        from eagle3_runner.runner.engines import get_json
        get_json(rec.url + "/model_info"), get_json(rec.url + "/server_info")
    finally:
        rec.close()
    (raw / "generate.meta.json").write_text(json.dumps(
        {"conversations": convs, "params": p.model_dump(), "max_length": 512}))


# ----------------------------------------------------------------------------------------------
# capture


def capture_bench(a, res: dict, out: Path) -> None:
    import torch
    from eagle3_runner.data.conversations import load_conversations, tokenize_dataset
    from eagle3_runner.jobs.extract import plan_batches
    from eagle3_runner.runner.engines import CAPTURE
    from eagle3_runner.targets.capture import capture, capture_sglang
    from eagle3_runner.targets.load import hf_folder, load_target, load_tokenizer, target_config
    from eagle3_runner.targets.sglang import server, server_argv
    from eagle3_runner.targets.sglang_target import (TargetServer, capture_env, capture_width,
                                                    check_server, package_root, sink_dir,
                                                    target_flags)
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    spec = spec_for(a, work, "json")
    aux = list(spec.aux_ids)
    tok = load_tokenizer(spec)
    convs = load_conversations(spec.data)[0]
    samples = [s[0] for s in tokenize_dataset(tok, convs, "auto", a.max_length)[0]]
    batches = [[samples[i] for i in b] for b in plan_batches(list(map(len, samples)),
                                                             a.batch_tokens)]
    res["samples"], res["tokens"] = len(samples), sum(map(len, samples))
    # hf: extract's capture, copied to the CPU
    model, _, cfg = load_target(spec)
    capture(model, batches[-1], aux)  # warm
    torch.cuda.synchronize()
    box, n, t0 = Box(a.box), 0, time.perf_counter()
    ref = None
    for b in batches:
        x, y = capture(model, b, aux)
        x, y = x.cpu(), y.cpu()
        ref = ref or (b, x, y)
        n += sum(map(len, b))
        if box.over():
            break
    secs = time.perf_counter() - t0
    res["hf"] = {"tokens": n, "seconds": secs, "tok_s": n / secs, "notes": "transformers, bf16"}
    print("hf", res["hf"], flush=True)
    # embedded: online training's packed capture on our Llama (targets/capture_embedded.py)
    from eagle3_runner.targets.capture_embedded import EmbeddedCapture
    emb = EmbeddedCapture(model, aux)
    t0 = time.perf_counter()
    emb(batches[-1]), emb(batches[0])  # warm: compile (dynamic shapes)
    torch.cuda.synchronize()
    res["embedded_warm_s"] = time.perf_counter() - t0
    box, n, t0 = Box(a.box), 0, time.perf_counter()
    for b in batches:
        x, y, _ = emb(b)
        x, y = x.cpu(), y.cpu()
        n += sum(map(len, b))
        if box.over():
            break
    secs = time.perf_counter() - t0
    res["embedded"] = {"tokens": n, "seconds": secs, "tok_s": n / secs,
                       "notes": "our Llama, the batch packed into one row, compiled"}
    print("embedded", res["embedded"], flush=True)
    del model, emb
    torch.cuda.empty_cache()
    save(res, out)
    # one capture server with both transports (the stages start one per transport)
    cfg = target_config(spec)
    width = capture_width(spec, cfg)
    with package_root() as pkg, sink_dir() as sink:
        argv = server_argv(a.sglang_python, str(hf_folder(spec)), a.port, "127.0.0.1", 1,
                           cuda_graph_max_bs=a.graph_bs,
                           extra=target_flags(spec, CAPTURE, a.batch_tokens) + DEVICE_FLAGS)
        env = {**os.environ, **capture_env(spec, cfg, sink, pkg)}
        with server(argv, "127.0.0.1", a.port, Path(a.out).parent / "logs" / "sglang-capture.log",
                    600, env=env) as url:
            srvs = {t: TargetServer(url, CAPTURE, t, sink if t == "file" else None, width,
                                    timeout=600, per_call=a.per_call, launched=True)
                    for t in ("json", "file")}
            for t, srv in srvs.items():
                srv.info = check_server(srv, spec)
                res["sglang_version"] = srv.info.get("version")
                capture_sglang(srv, batches[-1], len(aux), int(cfg["hidden_size"]))  # warm
                box, n, t0 = Box(a.box), 0, time.perf_counter()
                for b in batches:
                    capture_sglang(srv, b, len(aux), int(cfg["hidden_size"]), calls=a.calls)
                    n += sum(map(len, b))
                    if box.over():
                        break
                secs = time.perf_counter() - t0
                res[f"sglang_{t}"] = {"tokens": n, "seconds": secs, "tok_s": n / secs,
                                      "notes": f"{t} transport, {a.calls} calls in flight"}
                print(t, res[f"sglang_{t}"], flush=True)
                save(res, out)
            b, x, y = ref
            sx, sy = capture_sglang(srvs["file"], b, len(aux), int(cfg["hidden_size"]))
            res["diff"] = {"aux_rel": rel(sx, x, b), "last_rel": rel(sy, y, b),
                           "note": "max over samples of ||sglang - hf|| / ||hf||, first batch"}
            res["ratio"] = {f"sglang_{t}_over_{ref}": res[f"sglang_{t}"]["tok_s"] /
                            res[ref]["tok_s"] for t in srvs if f"sglang_{t}" in res
                            for ref in ("hf", "embedded") if ref in res}
            if a.record:
                record_capture(a, srvs, tok)
            res["json_bytes_per_token"] = json_bytes(srvs["json"], b[:2])


def rel(a, b, batch) -> float:
    return max(float((a[i, :len(x)].float() - b[i, :len(x)].float()).norm() /
                     b[i, :len(x)].float().norm()) for i, x in enumerate(batch))


def json_bytes(srv, prompts) -> float:
    """Bytes of /generate JSON per captured token (the json transport's cost)."""
    from eagle3_runner.targets.sglang_target import _post
    with _post(srv.url + "/generate", {"input_ids": prompts, "return_hidden_states": True,
                                       "sampling_params": {"max_new_tokens": 1}},
               srv.timeout) as r:
        return len(r.read()) / sum(map(len, prompts))


def record_capture(a, srvs, tok) -> None:
    """Short prompts (and the 2-id probe) through the recording proxy, a json request and a file
    request (raw rows copied from the sink before anything reads them): the capture fixture."""
    import shutil
    from eagle3_runner.runner.engines import get_json
    from eagle3_runner.targets.sglang_target import _post, sampling
    from sglang_record import Recorder
    raw = Path(a.record)
    (raw / "files").mkdir(parents=True, exist_ok=True)
    prompts = [[0, 0], tok.encode("Hi there", add_special_tokens=False)[:3] or [1, 2],
               tok.encode("The sky is blue", add_special_tokens=False)[:4]]
    sink = srvs["file"].sink
    rec = Recorder(srvs["json"].url, raw / "capture.jsonl")
    try:
        get_json(rec.url + "/model_info"), get_json(rec.url + "/server_info")
        for t in ("json", "file"):
            rids = [f"e3cap-rec-{t}-{i}" for i in range(len(prompts))]
            body = {"input_ids": prompts, "rid": rids,
                    "sampling_params": sampling(1, 0.0, 1.0, (), None)}
            if t == "json":
                body["return_hidden_states"] = True
            with _post(rec.url + "/generate", body, 600) as r:
                r.read()
            if t == "file":
                for rid in rids:
                    f, t0 = sink / f"{rid}.bin", time.monotonic()
                    while not f.exists() and time.monotonic() - t0 < 60:
                        time.sleep(0.01)
                    shutil.copy(f, raw / "files" / f.name)
    finally:
        rec.close()
    (raw / "capture.meta.json").write_text(json.dumps(
        {"geometry": {"hidden_size": 576, "num_hidden_layers": 30, "aux_ids": [1, 14, 26]}}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=["regen", "capture"])
    ap.add_argument("--sglang-python", default=os.path.expanduser("~/sglang-python"))
    ap.add_argument("--port", type=int, default=30110)
    ap.add_argument("--prompts", type=int, default=4096, help="regen: first turns")
    ap.add_argument("--new", type=int, default=256, help="regen: max new tokens per answer")
    ap.add_argument("--in-flight", type=int, default=1024, help="sglang: requests in flight")
    ap.add_argument("--per-call", type=int, default=64, help="sglang: prompts per call")
    ap.add_argument("--graph-bs", type=int, default=512, help="sglang: CUDA graphs up to")
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--rows", type=int, default=1024, help="embedded: Generator rows")
    ap.add_argument("--skip-embedded", action="store_true", help="regen: SGLang only")
    ap.add_argument("--e2e-real", type=int, default=10000)
    ap.add_argument("--e2e-synthetic", type=int, default=90000)
    ap.add_argument("--e2e-minutes", type=float, default=1.0, help="0 = no stage run")
    ap.add_argument("--no-same", dest="same", action="store_false",
                    help="regen: no regenerate() pass on the raw pass's prompts")
    ap.add_argument("--samples", type=int, default=512, help="capture: ShareGPT samples")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=4, help="capture: calls in flight")
    ap.add_argument("--box", type=float, default=30.0, help="seconds per timed phase")
    ap.add_argument("--record", default=None, help="raw recordings for the CPU tests go here")
    ap.add_argument("--out", default="bench_sglang_target")
    ap.add_argument("--data", default=None, help="a JSONL/gzip file of conversations instead of "
                    "the fetched ShareGPT (the device carries a 4,000-conversation subset)")
    a = ap.parse_args(argv)
    if a.data:
        SOURCE.clear()
        SOURCE.update(source="jsonl", path=a.data)
    import torch
    out = Path(a.out)
    res = {"mode": a.mode, "args": vars(a),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        (regen if a.mode == "regen" else capture_bench)(a, res, out)
    except BaseException as e:  # the numbers so far are kept
        res["errors"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        save(res, out)
        print(markdown(res))


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
