"""SGLang as the target of the regenerate, extract and online train stages (target.engine:
sglang; runner/engines.py decides): the server a stage launches on its GPUs (or the one at
target.sglang.server), its native /generate calls with token ids, for generation and for
capture, and the two capture transports. Nothing here imports sglang (the server is another
process) or torch; the server side of the capture is targets/sglang_models/capture.py with the
hooks of targets/sglang_hooks.py. Facts: SGLang 0.5.14 (entrypoints/http_server.py,
managers/tokenizer_manager.py, managers/io_struct.py GenerateReqInput, server_args.py).

Generation (`stream_call`): a batched /generate of token ids rendered by OUR chat template (the
server never renders: --skip-tokenizer-init), `stream: true` with a huge per-request
`stream_interval`, so each request of the batch comes back on its own as soon as it finishes
(SGLang sends a request's chunk at its first token and when it finishes; tokenizer_manager.py
_handle_batch_request tags each with "index"), while the call stays open for the others: no
request waits for the slowest of its call. `output_ids` holds the answer, the stop token included
when it ended on one; meta_info.finish_reason.type is "stop" | "length" | "abort";
meta_info.cached_tokens counts the prompt tokens the radix cache reused.

Capture (`capture_call`, max_new_tokens 1, every prompt position): the capture server's model
class (targets/sglang_models/capture.py) captures the aux layers at the drafter's ids (SGLang's
own set_eagle3_layers_to_capture, so the ids mean what they mean when SGLang serves the drafter)
and the last decoder layer's output BEFORE the final norm, and the rows come back as
[aux_0 | aux_1 | aux_2 | last], (n_aux + 1) x H wide per prompt position, by either transport:
- file: the server's tensor-parallel rank 0 writes each request's rows as raw bf16 to
  SINK/<rid>.bin (written, then renamed) on this host; the call's response only says the request
  finished. 2 bytes per float.
- json: `return_hidden_states: true` (server flag --enable-return-hidden-states);
  meta_info.hidden_states[0] is the prompt's [P][W] block (the scheduler's `.tolist()`, then JSON
  text: ~13-20 bytes per float; Kimi-K2.5, W = 4 x 7,168 = 28,672, is ~0.5 MB per token, on the
  scheduler's own thread).
Both need --disable-radix-cache (a prefix hit leaves the hit rows uncomputed) and
--chunked-prefill-size -1 (a chunked prompt splits its rows over forwards), and a json server must
carry only capture traffic (a prefill mixing requests with and without hidden states misaligns
the scheduler's row offsets): the runner's capture servers are started that way and take no
other traffic.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from eagle3_runner.runner.engines import CAPTURE, GENERATE, get_json, server_info_problems
from eagle3_runner.runner.errors import StageError
from eagle3_runner.targets.sglang import server, server_argv

CAPTURE_PACKAGE = "eagle3_runner.targets.sglang_models"  # SGLANG_EXTERNAL_MODEL_PACKAGE
LAYERS_ENV = "EAGLE3_CAPTURE_LAYERS"  # the drafter's aux ids, eagle_config convention, "1,29,57"
ARCHS_ENV = "EAGLE3_CAPTURE_ARCHS"  # the target's architectures to wrap, "LlamaForCausalLM"
SINK_ENV = "EAGLE3_CAPTURE_SINK"  # the file transport's folder
RID_PREFIX = "e3cap-"  # the rids whose rows the file transport writes
STREAM_EVERY = 1 << 30  # stream_interval: a request's chunks = its first token and its end

try:  # the capture responses are large: orjson parses ~5x faster where it is installed
    import orjson as _orjson
    _loads = _orjson.loads
except ImportError:  # pragma: no cover - the fallback
    _loads = json.loads


@dataclass
class TargetServer:
    """A running SGLang server a stage talks to: url (http://host:port), role (GENERATE /
    CAPTURE), transport ("file" | "json", capture only), sink (the file transport's folder),
    width (capture: (n_aux + 1) x H floats per row), info (/server_info), timeout (seconds per
    call), per_call (prompts per /generate call), context (the model's context length),
    launched (the runner started it with the target's own folder)."""

    url: str
    role: str
    transport: str = "json"
    sink: Path | None = None
    width: int = 0
    info: dict = field(default_factory=dict)
    timeout: float = 3600.0
    per_call: int = 64
    context: int | None = None
    launched: bool = False


# ----------------------------------------------------------------------------------------------
# launching


def server_dtype(spec) -> str:
    """--dtype of a target server: target.dtype, auto = bfloat16 (the servers run on GPUs)."""
    return "bfloat16" if spec.target.dtype == "auto" else spec.target.dtype


def target_flags(spec, role: str, max_prefill_tokens: int | None = None) -> list[str]:
    """The launch_server flags the runner sets for a target server beyond server_argv's
    (model, host, port, tp, cuda graphs): dtype, ep/dp, memory, and per role: a generation server
    skips the tokenizer (token ids in, output_ids out); a capture server turns the radix cache
    and chunked prefill off and the prefill CUDA graphs too (the torch.compile'd piecewise graphs
    would trace the capture hooks), caps a prefill at max_prefill_tokens (stages.extract.
    batch_tokens) and, for the json transport, returns hidden states. runner/spec/server.py
    TARGET_GUARDED_FLAGS refuses each in target.sglang.extra_args."""
    o = spec.target.sglang_options
    flags = ["--dtype", server_dtype(spec), "--skip-tokenizer-init"]
    if o.ep > 1:
        flags += ["--ep-size", str(o.ep)]
    if o.dp > 1:
        flags += ["--dp-size", str(o.dp)]
    if spec.target.trust_remote_code:
        flags.append("--trust-remote-code")
    if o.mem_fraction_static is not None:
        flags += ["--mem-fraction-static", str(o.mem_fraction_static)]
    if o.max_running_requests is not None:
        flags += ["--max-running-requests", str(o.max_running_requests)]
    if role == CAPTURE:
        flags += ["--disable-radix-cache", "--chunked-prefill-size", "-1",
                  "--cuda-graph-backend-prefill", "disabled"]
        if max_prefill_tokens:
            flags += ["--max-prefill-tokens", str(max(max_prefill_tokens, spec.data.max_length))]
        if o.capture_transport == "json":
            flags.append("--enable-return-hidden-states")
    return flags


def capture_env(spec, cfg: dict, sink: Path | None, package_root: Path) -> dict:
    """The environment of a capture server: SGLang loads our model class
    (SGLANG_EXTERNAL_MODEL_PACKAGE, sglang/srt/models/registry.py; PYTHONPATH gets
    `package_root`, a folder holding `eagle3_runner`), which wraps the target's architectures
    (config.json `architectures`) and captures the drafter's aux ids (eagle_config convention);
    the file transport's folder when `sink` is given."""
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    if not archs:
        raise StageError(f"target.path: {spec.target.path} has no config.json `architectures`; "
                         "SGLang dispatches on it, and the capture server wraps that class")
    env = {"SGLANG_EXTERNAL_MODEL_PACKAGE": CAPTURE_PACKAGE,
           LAYERS_ENV: ",".join(str(k) for k in spec.aux_ids), ARCHS_ENV: ",".join(archs),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(package_root),
                                                      os.environ.get("PYTHONPATH")]))}
    if sink is not None:
        env[SINK_ENV] = str(sink)
    return env


@contextmanager
def package_root() -> Iterator[Path]:
    """A temporary folder whose `eagle3_runner` links to this package, so the server's
    interpreter (target.sglang.python, maybe not the one running the stage) imports the same
    capture code."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="eagle3-pkg-") as d:
        (Path(d) / "eagle3_runner").symlink_to(root, target_is_directory=True)
        yield Path(d)


@contextmanager
def sink_dir() -> Iterator[Path]:
    """The file transport's folder: in /dev/shm when there is one (RAM; the stage reads and
    deletes each file at once), removed afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="eagle3-capture-", dir=base) as d:
        yield Path(d)


def capture_width(spec, cfg: dict) -> int:
    """Floats per captured row: the aux layers' and the last layer's hidden states."""
    return (len(spec.aux_ids) + 1) * int(cfg["hidden_size"])


@contextmanager
def stage_server(spec, role: str, cfg: dict, log_dir: Path, rank: int = 0, world: int = 1,
                 max_prefill_tokens: int | None = None) -> Iterator[TargetServer]:
    """The SGLang server of a stage for `role`, from target.sglang: a server launched with the
    stage's flags (rank 0 launches it and every rank waits for it; it is stopped when the block
    ends, whatever happens), or the one at target.sglang.server. Checks it (check_server) before
    yielding. Raises StageError when it does not start, answers wrong, or cannot capture."""
    from eagle3_runner.runner import dist as D
    from eagle3_runner.targets.load import hf_folder
    o = spec.target.sglang_options
    transport = o.capture_transport if role == CAPTURE else "json"
    width = capture_width(spec, cfg) if role == CAPTURE else 0

    def made(url: str, sink: Path | None) -> TargetServer:
        srv = TargetServer(url, role, transport, sink, width, timeout=o.request_timeout_s,
                           per_call=o.requests_per_call,
                           context=spec.target.max_position_embeddings,
                           launched=o.server is None)
        srv.info = check_server(srv, spec)
        return srv

    if o.server is not None:
        yield made(o.server.rstrip("/"), None)  # the file transport needs the server's sink
        return                                  # env: docs/sglang-target.md
    url = f"http://{o.host}:{o.port}"
    if rank != 0:  # rank 0 launches it and shares its sink folder
        sink = D.all_gather_object(None)[0]
        D.barrier()  # rank 0's server is up
        try:
            yield made(url, Path(sink) if sink else None)
        finally:
            D.barrier()  # rank 0 stops it once every rank is done
        return
    with package_root() as pkg, sink_dir() as sink:
        sink = sink if transport == "file" else None
        D.all_gather_object(str(sink) if sink else None)
        argv = server_argv(o.python, str(hf_folder(spec)), o.port, o.host, o.tp,
                           cuda_graph_max_bs=o.cuda_graph_max_bs,
                           extra=target_flags(spec, role, max_prefill_tokens) + o.extra_args)
        env = capture_env(spec, cfg, sink, pkg) if role == CAPTURE else {}
        try:
            with server(argv, o.host, o.port, Path(log_dir) / f"sglang-{role}.log",
                        o.startup_timeout_s, env={**os.environ, **env}) as url:
                srv = made(url, sink)
                D.barrier()
                try:
                    yield srv
                finally:
                    D.barrier()
        except StageError as e:
            raise StageError(e if str(e).startswith("target.sglang") else f"target.sglang: {e}")


def check_server(srv: TargetServer, spec) -> dict:
    """/model_info and /server_info of a server about to be used (runner/engines.py
    server_info_problems), and for capture one 2-token probe whose rows must be srv.width wide
    (else the server does not run our capture model: SGLANG_EXTERNAL_MODEL_PACKAGE). Returns
    /server_info. Raises StageError naming what is wrong."""
    try:
        mi, si = get_json(srv.url + "/model_info"), get_json(srv.url + "/server_info")
    except (OSError, ValueError) as e:
        raise StageError(f"target.sglang: {srv.url} does not answer /model_info, /server_info "
                         f"({e})")
    problems = server_info_problems(mi, si, spec, srv.role, srv.url, not srv.launched)
    if problems:
        raise StageError("target.sglang: " + "; ".join(problems))
    if srv.role == CAPTURE:
        capture_call(srv, [[0, 0]])  # raises when the rows are not srv.width wide
    return si


# ----------------------------------------------------------------------------------------------
# HTTP


def _post(url: str, payload: dict, timeout: float):
    """POST JSON; the open response (a file-like of bytes). Raises StageError with the server's
    error message for an HTTP error, OSError when it does not answer."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        body = e.read()[:2000].decode(errors="replace")
        raise StageError(f"SGLang {url}: HTTP {e.code}: {body}")


def sampling(max_new: int, temperature: float, top_p: float, stop_ids, seed: int | None,
             stream: bool = False) -> dict:
    """A request's sampling_params (SGLang 0.5.14 sampling/sampling_params.py SamplingParams:
    an unknown key is an HTTP 500). temperature 0 = greedy (SGLang: < 1e-6 -> top_k 1).
    sampling_seed is honoured only under --enable-deterministic-inference (SGLang's
    sampling_batch_info.py); otherwise SGLang samples with its own generator."""
    p = {"max_new_tokens": int(max_new), "temperature": float(temperature),
         "top_p": float(top_p), "skip_special_tokens": False}
    if stop_ids:
        p["stop_token_ids"] = [int(t) for t in stop_ids]
    if seed is not None:
        p["sampling_seed"] = int(seed)
    if stream:
        p["stream_interval"] = STREAM_EVERY
    return p


def finished(obj: dict) -> tuple[list, str, dict] | None:
    """(output_ids, "stop" | "length", meta_info) of a finished /generate result, None while it
    runs. Raises StageError for an aborted request (SGLang's message in it)."""
    meta = obj.get("meta_info") or {}
    fin = meta.get("finish_reason")
    if not fin:
        return None
    kind = fin.get("type") if isinstance(fin, dict) else str(fin)
    if kind == "abort":
        raise StageError(f"SGLang aborted request {meta.get('id')}: {fin.get('message', fin)}")
    return list(obj.get("output_ids") or []), ("stop" if kind == "stop" else "length"), meta


def stream_call(srv: TargetServer, prompts: list[list[int]], params: list[dict],
                on_result: Callable[[int, list, str, dict], None]) -> None:
    """One batched, streamed /generate (module docstring): on_result(index in `prompts`,
    output_ids, finish, meta_info) as each request finishes. Raises StageError for an HTTP or
    aborted request, or when the stream ends before every request finished."""
    left = set(range(len(prompts)))
    with _post(srv.url + "/generate", {"input_ids": prompts, "sampling_params": params,
                                       "stream": True}, srv.timeout) as r:
        for line in r:
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            obj = _loads(body)
            if "error" in obj:
                raise StageError(f"SGLang {srv.url}/generate: {obj['error']}")
            got = finished(obj)
            if got is not None:
                i = int(obj.get("index", 0))
                left.discard(i)
                on_result(i, *got)
    if left:
        raise StageError(f"SGLang {srv.url}/generate: the stream ended with {len(left)} of "
                         f"{len(prompts)} requests unfinished")


def capture_call(srv: TargetServer, prompts: list[list[int]]) -> list[np.ndarray]:
    """Capture the rows of every prompt position (module docstring): [float32 [len(p), width]]
    per prompt, columns [aux (ascending ids) | last (pre-norm)]. Raises StageError when the
    server answers another width (not our capture model), loses rows, or a file does not arrive
    within srv.timeout."""
    rids = [f"{RID_PREFIX}{uuid.uuid4().hex}" for _ in prompts]
    payload = {"input_ids": prompts, "rid": rids,
               "sampling_params": sampling(1, 0.0, 1.0, (), None)}
    if srv.transport == "json":
        payload["return_hidden_states"] = True
    with _post(srv.url + "/generate", payload, srv.timeout) as r:
        out = _loads(r.read())
    if isinstance(out, dict):
        out = [out]
    if srv.transport == "json":
        return [json_rows(o, len(p), srv.width) for o, p in zip(out, prompts)]
    return [file_rows(srv.sink, rid, len(p), srv.width, srv.timeout)
            for rid, p in zip(rids, prompts)]


def json_rows(obj: dict, n: int, width: int) -> np.ndarray:
    """The prompt rows of one json-transport response: meta_info.hidden_states[0], the prefill
    block (SGLang 0.5.14 batch_result_processor.py: one [P][W] block, then one row per decode
    step), as float32 [n, width]. Raises StageError for a missing block or another shape."""
    hs = (obj.get("meta_info") or {}).get("hidden_states")
    if not hs:
        raise StageError("SGLang returned no hidden states: start the capture server with "
                         "--enable-return-hidden-states (the runner's capture servers have it)")
    a = np.asarray(hs[0], dtype=np.float32)
    return _shaped(a, n, width)


def _shaped(a: np.ndarray, n: int, width: int) -> np.ndarray:
    if a.ndim != 2 or a.shape[1] != width:
        raise StageError(f"SGLang captured rows of shape {list(a.shape)}, expected [{n}, {width}] "
                         "(aux layers + the last layer): the server does not run the capture "
                         f"model ({CAPTURE_PACKAGE} through SGLANG_EXTERNAL_MODEL_PACKAGE, "
                         "docs/sglang-target.md)")
    if a.shape[0] != n:
        raise StageError(f"SGLang captured {a.shape[0]} rows for a {n}-token prompt: a prefix "
                         "cache hit or a chunked prefill (the capture server needs "
                         "--disable-radix-cache --chunked-prefill-size -1)")
    return a


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (bf16 is float32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def file_rows(sink: Path, rid: str, n: int, width: int, timeout: float) -> np.ndarray:
    """The rows the file transport wrote for `rid` (SINK/<rid>.bin: raw bf16, [n, width]) as
    float32, the file deleted. Waits for it (the server writes after answering); SINK/<rid>.err
    holds the server side's refusal. Raises StageError on an .err, a wrong size or a timeout."""
    path, err = sink / f"{rid}.bin", sink / f"{rid}.err"
    t0 = time.monotonic()
    while not path.exists():
        if err.exists():
            raise StageError(f"the capture server refused {rid}: {err.read_text()}")
        if time.monotonic() - t0 > timeout:
            raise StageError(f"the capture server wrote no rows for {rid} in {timeout:.0f} s "
                             f"(target.sglang.request_timeout_s; its folder {sink})")
        time.sleep(0.002)
    bits = np.fromfile(path, dtype=np.uint16)
    path.unlink()
    if bits.size % width:
        raise StageError(f"{path}: {bits.size} values, not rows of {width}")
    return _shaped(bf16_to_float32(bits).reshape(-1, width), n, width)


# ----------------------------------------------------------------------------------------------
# many calls in flight


def in_flight(calls: Iterator[Callable[[], object]], limit: int,
              on_done: Callable[[object], None]) -> None:
    """Run the zero-argument `calls` (drawn lazily) with at most `limit` running at once in
    threads (HTTP waits release the GIL), handing each result to on_done in this thread, in
    completion order. Raises the first call's exception after the running ones end."""
    results: queue.Queue = queue.Queue()
    running = 0

    def work(fn):
        try:
            results.put((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            results.put((False, e))

    it = iter(calls)
    error = None
    while True:
        while error is None and running < limit and (fn := next(it, None)) is not None:
            threading.Thread(target=work, args=(fn,), daemon=True).start()
            running += 1
        if not running:
            break
        ok, value = results.get()
        running -= 1
        if not ok:
            error = error or value
        elif error is None:
            on_done(value)
    if error is not None:
        raise error

