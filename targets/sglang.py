"""The SGLang serving engine from the outside: the `sglang.launch_server` argv, servers started as
subprocesses (each in its own process group, its output in a log file), readiness, stopping, and
the HTTP calls (/generate, /server_info); the parsers of what a server says (decode-log accept
lengths, meta_info, the error line of a log). Small functions meant to be reused by every caller
that runs SGLang (the bench backend: targets/sglang_bench.py; scripts/gpu/sglang_lab.py).

SGLang 0.5.14 facts used here (read from its source, then recorded on the H200 in
tests/data/sglang/; docs/eagle3-format.md):
- ready: the log line READY_LINE (entrypoints/http_server.py `_wait_and_warmup`, printed after
  the warmup request), or GET /health answering 200 (it generates one token once the server is
  up; 503 while starting);
- POST /generate {"input_ids": [...], "sampling_params": {...}} -> {"text", "output_ids" (the
  completion through the stop token), "meta_info": {"prompt_tokens", "completion_tokens",
  "e2e_latency" (s), "finish_reason", ...}}; a speculative server adds, per finished request
  that verified at least once, "spec_verify_ct" (verify passes), "spec_num_correct_drafts"
  (accepted drafts, bonus excluded) and "spec_accept_length" = completion_tokens /
  spec_verify_ct (tokenizer_manager.py `_calculate_spec_decoding_metrics`);
- GET /server_info: every ServerArgs field and "version";
- decode log line (scheduler metrics, every --decode-log-interval steps): "Decode batch,
  #running-req: 1, ..., accept len: 2.45, accept rate: 0.61, ..." (0.5.6: "Decode batch. ...").

Servers get an argv LIST (never a shell string) and are stopped (SIGTERM, then SIGKILL of the
group) even when the caller fails. sglang is the optional extra `pip install
'eagle3-runner[sglang]'` or any interpreter that has it (`interpreter`); nothing here imports it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_runner.runner.drafts.layout import ALGORITHM
from eagle3_runner.runner.errors import ServerError
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.spec.server import MAX_HTTP_PORT

READY_LINE = "The server is fired up and ready to roll!"
ACCEPT_LEN_RE = re.compile(r"accept len:\s*([0-9]+(?:\.[0-9]+)?)")
# a log line that says why a server stopped; SGLang 0.5.14 logs "Ignore import error when
# loading ... Can not import FA3" for model files it never uses (harmless without FA3)
_ERROR_RE = re.compile(r"(Error|Exception|error:|Traceback|Assertion|CUDA error|Killed)")
_HARMLESS_RE = re.compile(r"Ignore import error|Can not import FA3")
# meta_info key of the accepted drafts per request (0.5.14; `spec_accepted_drafts` is its alias)
CORRECT_KEYS = ("spec_num_correct_drafts", "spec_accepted_drafts")
# meta_info key of the verify passes per accepted-draft count (0.5.14; `spec_accept_histogram`
# is its alias): histogram[n] = the request's verify passes that accepted exactly n drafts
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")


def interpreter(python: str) -> str:
    """stages.bench.sglang.python as an executable: a path (with `/`, `~` or `$VAR`) expanded
    like a spec path (runner.files.expand_path), a bare name (python3) left for PATH."""
    return str(expand_path(python)) if any(c in python for c in "/~$") else python


def sglang_available(python: str = "python3") -> tuple[bool, str]:
    """Whether `python` can import sglang. Checks this interpreter in-process when `python` is it
    (or the default), else runs `python -c 'import sglang'` (10 s timeout)."""
    import importlib.util
    import shutil
    python = interpreter(python)
    if python in ("python3", "python", sys.executable) and \
            (shutil.which(python) in (None, sys.executable) or python == sys.executable):
        return (importlib.util.find_spec("sglang") is not None), "module 'sglang' not found"
    try:
        r = subprocess.run([python, "-c", "import sglang"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot run {python}: {e}"
    return r.returncode == 0, (r.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]


def free_ports(n: int, host: str = "127.0.0.1", highest: int = MAX_HTTP_PORT) -> list[int]:
    """n distinct free TCP ports on `host`, each at most `highest` (default MAX_HTTP_PORT, 55535:
    SGLang 0.5.14 refuses an HTTP port whose + 10000 is past 65535, and the kernel hands out
    ports up to 60999): sockets bound to port 0 and held open together (so the kernel hands out
    different ports) until n are low enough, read, then closed. Another process could still
    take one before the server binds it; a server that then fails to bind says so in its log
    (ServerError). Raises RuntimeError when 64 x n tries find fewer than n."""
    socks, ports = [], []
    try:
        for _ in range(64 * n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            socks.append(s)
            s.bind((host, 0))
            if s.getsockname()[1] <= highest:
                ports.append(s.getsockname()[1])
                if len(ports) == n:
                    return ports
        raise RuntimeError(f"found {len(ports)} of {n} free TCP ports at most {highest} on {host}")
    finally:
        for s in socks:
            s.close()


def server_argv(python: str, model_path: str, port: int, host: str = "127.0.0.1", tp: int = 1,
                draft_path: str | None = None, num_steps: int | None = None,
                eagle_topk: int | None = None, num_draft_tokens: int | None = None,
                cuda_graph: bool = True, cuda_graph_max_bs: int | None = None,
                context_length: int | None = None, extra: list[str] = (), *,
                dtype: str | None = None, mem_fraction_static: float | None = None,
                nccl_port: int | None = None, algorithm: str = ALGORITHM) -> list[str]:
    """The sglang.launch_server argv as a list. With draft_path: --speculative-algorithm
    `algorithm` (EAGLE3 exactly: SGLang's is_eagle3() matches only that string; another value is
    for the conformance lab) and all three of steps/topk/draft tokens (SGLang wants all or none).
    Without: the no-speculation baseline. dtype: --dtype (the target's compute dtype; SGLang's
    default `auto` follows config.json, float32 for a GGUF converted here); nccl_port: the port
    torch.distributed binds even at tp 1 (pass a free one when servers start side by side).
    Every flag set here is in runner/spec/server.py GUARDED_FLAGS. Raises ValueError when a
    speculative server lacks one of the three counts."""
    argv = [interpreter(python), "-m", "sglang.launch_server", "--model-path", str(model_path),
            "--host", host, "--port", str(port), "--tp-size", str(tp)]
    if draft_path is not None:
        if None in (num_steps, eagle_topk, num_draft_tokens):
            raise ValueError("speculative server needs num_steps, eagle_topk and num_draft_tokens")
        argv += ["--speculative-algorithm", algorithm,
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
    if dtype is not None:
        argv += ["--dtype", dtype]
    if mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(mem_fraction_static)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    return argv + [str(x) for x in extra]


# ----------------------------------------------------------------------------------------------
# what a server says


def parse_accept_lens(log_text: str) -> list[float]:
    """Every `accept len: X` value of the decode log lines (one per logging interval)."""
    return [float(m.group(1)) for line in log_text.splitlines() if "Decode batch" in line
            for m in [ACCEPT_LEN_RE.search(line)] if m]


def error_line(log_text: str) -> str | None:
    """The last line of a server log that names an error (a Python exception, an assertion, a
    CUDA error, argparse's `error:`), SGLang's harmless FA3 import notes left out; None when
    there is none."""
    hits = [ln.strip() for ln in log_text.splitlines()
            if _ERROR_RE.search(ln) and not _HARMLESS_RE.search(ln)]
    return hits[-1] if hits else None


def correct_drafts(meta: dict) -> int | None:
    """Accepted drafts of one request (meta_info `spec_num_correct_drafts`), None when absent."""
    return next((int(meta[k]) for k in CORRECT_KEYS if k in meta), None)


def tau_from_meta(metas: list[dict]) -> float:
    """tau of speculative responses, on the embedded engine's definition (engine/speculative.py
    Stats.tau: tokens per verify pass, the bonus token included, the prefill's first token NOT
    counted): 1 + sum(spec_num_correct_drafts) / sum(spec_verify_ct). A server that reports no
    correct-draft count: (sum(completion_tokens) - n) / sum(spec_verify_ct), the same count up to
    the tokens of the last round cut at max_new_tokens or a stop. SGLang's own
    spec_accept_length also counts the prefill's token (server_accept_length).
    Raises ValueError when a response carries no spec_verify_ct (not a speculative server, or a
    request that never verified)."""
    if not metas or any("spec_verify_ct" not in m for m in metas):
        raise ValueError("meta_info has no spec_verify_ct: the server is not speculative (check "
                         "--speculative-algorithm EAGLE3)")
    verify = sum(int(m["spec_verify_ct"]) for m in metas)
    if not verify:
        return float("nan")
    correct = [correct_drafts(m) for m in metas]
    if None not in correct:
        return 1 + sum(correct) / verify
    return (sum(int(m["completion_tokens"]) for m in metas) - len(metas)) / verify


def accept_per_pos_from_meta(metas: list[dict], num_steps: int) -> list[float]:
    """Per-position acceptance of speculative responses, on the embedded engine's definition
    (engine/speculative.py Stats.accept_per_pos: position j's share of verify passes that
    accepted more than j drafts), from SGLang 0.5.14's per-request histogram (meta_info
    `spec_correct_drafts_histogram`, alias `spec_accept_histogram`: entry n = the verify passes
    that accepted exactly n drafts; tokenizer_manager.py; a request's list may stop at its
    longest accept). Pooled over `metas` (sums, not a mean of ratios); `num_steps` positions.
    [] when a response carries no histogram (a server older than the key), one with a count that
    is not a non-negative integer (a recording edited or damaged: a string count crashed the
    bench's read-back, a negative one gave an acceptance above 1), one whose counts do not sum to
    its spec_verify_ct, or nothing verified: the caller stores NULL rather than a made-up
    number."""
    hist = [0] * (num_steps + 1)
    for m in metas:
        h = next((m[k] for k in HISTOGRAM_KEYS if k in m), None)
        if not isinstance(h, list) or not all(isinstance(c, int) and not isinstance(c, bool)
                                              and c >= 0 for c in h) \
                or sum(h) != m.get("spec_verify_ct"):
            return []  # absent, or not one count per verify pass: not what we read it as
        for n, count in enumerate(h):
            hist[min(n, num_steps)] += count
    total = sum(hist)
    return [sum(hist[j + 1:]) / total for j in range(num_steps)] if total else []


def server_accept_length(metas: list[dict]) -> float:
    """SGLang's accept length over responses, as its meta_info `spec_accept_length` defines it
    for one: sum(completion_tokens) / sum(spec_verify_ct) (the prefill's token counted, so ~1/
    verify passes above tau_from_meta). Raises ValueError like tau_from_meta."""
    tau_from_meta(metas)
    verify = sum(int(m["spec_verify_ct"]) for m in metas)
    return sum(int(m["completion_tokens"]) for m in metas) / verify if verify else float("nan")


# ----------------------------------------------------------------------------------------------
# HTTP


def get_json(url: str, timeout: float = 10.0) -> dict:
    """GET url -> the JSON body. Raises OSError (urllib.error.URLError) or ValueError."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def post_json(url: str, payload: dict, timeout: float) -> dict:
    """POST a JSON body -> the JSON answer. An HTTP error status becomes ServerError with the
    server's own message ({"error": {"message": ...}} on SGLang's 400s); a connection failure
    stays OSError."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:2000]
        try:
            body = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise ServerError(f"{url}: HTTP {e.code}: {body}", str(body))


def server_info(url: str, timeout: float = 10.0) -> dict:
    """GET /server_info (0.5.14; /get_server_info before it): server args, scheduler info and
    "version". {} when neither answers."""
    for path in ("/server_info", "/get_server_info"):
        try:
            return get_json(url + path, timeout)
        except (OSError, ValueError):
            continue
    return {}


def generate(url: str, input_ids: list[int], max_new: int, temperature: float, timeout: float,
             stop_ids=()) -> tuple[dict, float]:
    """One /generate request -> (response JSON, client wall seconds). stop_ids: token ids that
    end the completion besides the model's own EOS (`stop_token_ids`)."""
    params = {"max_new_tokens": max_new, "temperature": temperature}
    if stop_ids:
        params["stop_token_ids"] = list(stop_ids)
    t0 = time.perf_counter()
    out = post_json(url + "/generate", {"input_ids": list(input_ids), "sampling_params": params},
                    timeout)
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# processes


@dataclass
class Server:
    """One launched server process: its argv, address, log file and process (own group)."""

    name: str
    argv: list[str]
    host: str
    port: int
    log_path: Path
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    ready_s: float | None = None  # seconds from launch to ready (wait_ready)
    _seen: int = 0  # log bytes already searched for READY_LINE

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def said_ready(self) -> bool:
        """Whether READY_LINE has appeared in the log since the last call (reads new bytes only)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(self._seen - len(READY_LINE), 0))
                new = f.read()
        except OSError:
            return False
        self._seen = max(self._seen - len(READY_LINE), 0) + len(new)
        return READY_LINE.encode() in new


def launch(name: str, argv: list[str], host: str, port: int, log_path: Path,
           env: dict | None = None) -> Server:
    """Start a server (own process group: start_new_session; stdout and stderr appended to
    log_path) and return at once. env: the server's whole environment (None = this process's)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return Server(name, list(argv), host, port, Path(log_path), proc)


def wait_ready(srv: Server, timeout_s: float, poll_s: float = 1.0) -> None:
    """Block until `srv` is ready (READY_LINE in its log, or GET /health 200); sets srv.ready_s.
    Raises ServerError (message and log tail) when the process exits first, or after timeout_s
    seconds from its launch (stages.bench.sglang.startup_timeout_s); the process is left
    running for the caller to stop. A server already found ready returns at once (its ready_s
    kept)."""
    while srv.ready_s is None:
        if srv.proc.poll() is not None:
            tail = srv.log_tail()
            raise ServerError(f"sglang server {srv.name} exited with code {srv.proc.returncode} "
                              f"during startup; log {srv.log_path}:\n{tail}", tail)
        if srv.said_ready() or _status(srv.url + "/health") == 200:
            srv.ready_s = time.monotonic() - srv.started
            return
        if time.monotonic() - srv.started > timeout_s:
            tail = srv.log_tail()
            raise ServerError(f"sglang server {srv.name} not ready after {timeout_s:.0f} s "
                              f"(stages.bench.sglang.startup_timeout_s); log {srv.log_path}:\n"
                              f"{tail}", tail)
        time.sleep(poll_s)


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


def stop_all(servers: list[Server], grace_s: float = 30.0) -> None:
    """Stop every server: SIGTERM to all groups first, then each waited for (and SIGKILLed)."""
    for s in servers:
        if s.proc.poll() is None:
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for s in servers:
        stop_server(s.proc, grace_s)


@contextmanager
def server(argv: list[str], host: str, port: int, log_path: Path, startup_timeout_s: float,
           env: dict | None = None, name: str = "server"):
    """launch + wait_ready as a context: yields the base URL, always stops the server. Raises
    ServerError when it exits or is not ready in time (the log tail is in the message)."""
    srv = launch(name, argv, host, port, log_path, env)
    with ExitStack() as stack:
        stack.callback(stop_server, srv.proc)
        wait_ready(srv, startup_timeout_s)
        yield srv.url
