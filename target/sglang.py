"""Bench backend `sglang`: launch real SGLang servers (speculative and baseline), send the prompt
sets through /generate, compute tau = sum(completion_tokens) / sum(spec_verify_ct) from meta_info,
and cross-check with the scheduler's `accept len` decode log lines.

Formats (recorded in tests/data/sglang/, from SGLang's scheduler metrics and tokenizer manager):
- decode log: "... Decode batch[.,] #running-req: 1, #token: 389, token usage: 0.00,
  accept len: 2.45, [accept rate: 0.61, ][cuda graph: True, ]gen throughput (token/s): 123.4, ..."
- /generate response: {"text": ..., "meta_info": {"prompt_tokens", "completion_tokens",
  "spec_verify_ct" (speculative servers only), "e2e_latency", "finish_reason", ...}}

Servers run as subprocesses in their own process group (argv is a LIST, never a shell string)
and are stopped (SIGTERM, then SIGKILL of the group) even when the bench fails. sglang is the
optional extra `pip install 'eagle3-runner[sglang]'`; nothing here imports it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from eagle3_runner.runner.bench_rows import (config_fields, config_id, prompt_row, save_results, summary_row,
                                train_samples)
from eagle3_runner.runner.drafts.layout import ALGORITHM
from eagle3_runner.runner.drafts.server import simulate_acc_len_problem
from eagle3_runner.runner.errors import StageError

ACCEPT_LEN_RE = re.compile(r"accept len:\s*([0-9]+(?:\.[0-9]+)?)")


def sglang_available(python: str = "python3") -> tuple[bool, str]:
    """Whether `python` can import sglang. Checks this interpreter in-process when `python` is it
    (or the default), else runs `python -c 'import sglang'` (10 s timeout)."""
    import importlib.util
    import shutil
    if python in ("python3", "python", sys.executable) and \
            (shutil.which(python) in (None, sys.executable) or python == sys.executable):
        return (importlib.util.find_spec("sglang") is not None), "module 'sglang' not found"
    try:
        r = subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run {python}: {e}"
    return r.returncode == 0, (r.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]


def server_argv(python: str, model_path: str, port: int, host: str = "127.0.0.1", tp: int = 1,
                draft_path: str | None = None, num_steps: int | None = None,
                eagle_topk: int | None = None, num_draft_tokens: int | None = None,
                cuda_graph: bool = True, cuda_graph_max_bs: int | None = None,
                context_length: int | None = None, extra: list[str] = ()) -> list[str]:
    """The sglang.launch_server argv as a list. With draft_path: --speculative-algorithm EAGLE3
    (exactly; SGLang is_eagle3() matches only that string) and all three of steps/topk/draft
    tokens (SGLang wants all or none). Without: the no-speculation baseline."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--tp-size", str(tp)]
    if draft_path is not None:
        if None in (num_steps, eagle_topk, num_draft_tokens):
            raise ValueError("speculative server needs num_steps, eagle_topk and num_draft_tokens")
        argv += ["--speculative-algorithm", ALGORITHM,
                 "--speculative-draft-model-path", str(draft_path),
                 "--speculative-num-steps", str(num_steps),
                 "--speculative-eagle-topk", str(eagle_topk),
                 "--speculative-num-draft-tokens", str(num_draft_tokens)]
    if not cuda_graph:
        argv.append("--disable-cuda-graph")
    elif cuda_graph_max_bs is not None:
        argv += ["--cuda-graph-max-bs", str(cuda_graph_max_bs)]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    return argv + [str(x) for x in extra]


def parse_accept_lens(log_text: str) -> list[float]:
    """Every `accept len: X` value of the decode log lines (one per logging interval)."""
    return [float(m.group(1)) for line in log_text.splitlines() if "Decode batch" in line
            for m in [ACCEPT_LEN_RE.search(line)] if m]


def tau_from_meta(metas: list[dict]) -> float:
    """tau = sum(completion_tokens) / sum(spec_verify_ct) (bonus token included).
    Raises ValueError when no response carries spec_verify_ct (not a speculative server)."""
    if not metas or any("spec_verify_ct" not in m for m in metas):
        raise ValueError("meta_info has no spec_verify_ct: the server is not speculative (check "
                         "--speculative-algorithm EAGLE3)")
    verify = sum(int(m["spec_verify_ct"]) for m in metas)
    return sum(int(m["completion_tokens"]) for m in metas) / verify if verify else float("nan")


# ----------------------------------------------------------------------------------------------
# processes and HTTP


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def post_json(url: str, payload: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, then SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def server(argv: list[str], host: str, port: int, log_path: Path, startup_timeout_s: float,
           env: dict | None = None):
    """Start a server (own process group, output to log_path, environment `env`, default this
    process's), wait until /health (or /get_model_info) answers 200, yield its base URL, always
    stop it. Raises StageError when it exits or does not become healthy in time (the log tail is
    in the message)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    url = f"http://{host}:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise StageError(f"sglang server exited with code {proc.returncode} during "
                                 f"startup; log {log_path}:\n{_tail(log_path)}")
            if _get(url + "/health") == 200 or _get(url + "/get_model_info") == 200:
                break
            if time.monotonic() - t0 > startup_timeout_s:
                raise StageError(f"sglang server not healthy after {startup_timeout_s:.0f} s "
                                 f"(stages.bench.sglang.startup_timeout_s); log {log_path}:\n"
                                 f"{_tail(log_path)}")
            time.sleep(2.0)
        yield url
    finally:
        stop_server(proc)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def generate(url: str, input_ids: list[int], max_new: int, temperature: float,
             timeout: float) -> tuple[dict, float]:
    """One /generate request -> (response JSON, wall seconds)."""
    t0 = time.perf_counter()
    out = post_json(url + "/generate", {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": temperature}}, timeout)
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# the bench


def run_bench(ctx, export_dir: Path) -> dict:
    """Bench through SGLang servers: per cuda_graph setting, one baseline server and one
    speculative server per config; same prompts, sequential requests (batch 1)."""
    import statistics
    from eagle3_runner.data.prompts import load_prompt_set, render
    from eagle3_runner.target.load import hf_folder, load_tokenizer
    p, spec, o = ctx.params, ctx.spec, ctx.params.sglang
    simulated = simulate_acc_len_problem(os.environ)  # the servers inherit this environment
    if simulated:
        raise StageError(f"bench: {simulated}")
    model = str(hf_folder(spec))
    tok = load_tokenizer(spec)
    sets = {s: [(q["id"], render(tok, q["messages"])) for q in load_prompt_set(s, spec, p.num_prompts)]
            for s in p.prompt_sets}
    logs = Path(ctx.out_dir) / "logs"
    trained_on = train_samples(export_dir)
    rows_all, summaries = [], []

    def run_all(url):
        res = {}
        for s, prompts in sets.items():
            for m in p.max_new_tokens:
                for pid, ids in prompts:
                    res[s, m, pid] = generate(url, ids, m, p.temperature, o.request_timeout_s)
        return res

    for cg in p.cuda_graph:
        argv = server_argv(o.python, model, o.port + 1, o.host, o.tp, cuda_graph=cg,
                           cuda_graph_max_bs=o.cuda_graph_max_bs, context_length=p.context_length,
                           extra=o.extra_args)
        with server(argv, o.host, o.port + 1, logs / f"baseline-cg{int(cg)}.log",
                    o.startup_timeout_s) as url:
            base = run_all(url)
        for c in p.configs:
            log = logs / f"spec-{config_id(c, cg, 0)}.log"
            argv = server_argv(o.python, model, o.port, o.host, o.tp, str(export_dir), c.num_steps,
                               c.eagle_topk, c.draft_tokens, cg, o.cuda_graph_max_bs,
                               p.context_length, o.extra_args)
            with server(argv, o.host, o.port, log, o.startup_timeout_s) as url:
                res = run_all(url)
            log_taus = parse_accept_lens(_tail(log, 100000))
            for s, prompts in sets.items():
                for m in p.max_new_tokens:
                    cfg = config_fields(c, cg, m, p.temperature, "sglang", s, trained_on)
                    rows = []
                    for pid, _ in prompts:
                        (r, dt), (b, bdt) = res[s, m, pid], base[s, m, pid]
                        mi, bi = r["meta_info"], b["meta_info"]
                        lossless = (r.get("output_ids", r.get("text")) ==
                                    b.get("output_ids", b.get("text"))) if p.temperature == 0 else None
                        rows.append(prompt_row(  # no target forward: divergence NULLs
                            cfg, pid, tau_from_meta([mi]), mi["completion_tokens"],
                            mi["spec_verify_ct"], mi["completion_tokens"] / dt,
                            bi["completion_tokens"] / bdt, lossless, None, _dt=dt, _bdt=bdt,
                            _btoks=bi["completion_tokens"]))
                    toks = sum(r["new_tokens"] for r in rows)
                    tau = toks / max(sum(r["verify_ct"] for r in rows), 1)
                    spec_tps = toks / sum(r["_dt"] for r in rows)
                    base_tps = sum(r["_btoks"] for r in rows) / sum(r["_bdt"] for r in rows)
                    sp = spec_tps / base_tps
                    text = (f"sglang: tau {tau:.2f} (meta_info); decode-log accept len median "
                            f"{statistics.median(log_taus):.2f} over {len(log_taus)} lines; "
                            if log_taus else f"sglang: tau {tau:.2f}; no decode-log accept "
                            "len lines; ")
                    text += (f"{spec_tps:.1f} tok/s vs baseline {base_tps:.1f} tok/s -> {sp:.2f}x"
                             f"; break-even tau = tau / speedup = {tau / sp:.2f}.")
                    summaries.append(summary_row(cfg, rows, tau, spec_tps, base_tps, tau / sp,
                                                 text))
                    rows_all += rows
    save_results(ctx, rows_all, summaries)
    return {"tau": statistics.mean(s["tau"] for s in summaries),
            "speedup": statistics.mean(s["speedup"] for s in summaries)}
