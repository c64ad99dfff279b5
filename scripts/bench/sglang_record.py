#!/usr/bin/env python
"""Recordings of real SGLang traffic for the CPU tests (tests/sglang_target_replay.py replays them):

  Recorder   a forwarding HTTP proxy in front of a real server: every exchange the client code
             makes (GET /model_info, /server_info; POST /generate, streamed or not) goes through
             and is appended to RAW/<name>.jsonl as {method, path, request, status, body_b64};
             scripts/bench/bench_sglang_target.py runs its small recorded passes through it.
             Rows the file transport wrote are copied to RAW/files/<rid>.bin by that script.
  convert    python scripts/bench/sglang_record.py convert RAW/<name>.jsonl OUT.json
             [--meta RAW/<name>.meta.json]: the fixture tests/data/sglang_target/*.json holds:
             model_info, the /server_info fields the client reads, and per prompt the finished
             result of its generation request, or its capture response (json rows) and its file
             rows (base64); --meta adds what the recording ran (conversations, parameters).
  standin    python scripts/bench/sglang_record.py standin OUTDIR: the hand-made stand-ins
             ("recorded": false) the tests use until real recordings replace them: generation
             answers made up for conversations rendered with SmolLM2's tokenizer (regenerate()
             itself run over a made-up engine, so multi-turn prompts carry the made-up answers),
             and capture rows of a tiny geometry.

Run on the device by scripts/gpu/sglang_target.sh (which brings RAW back under $OUT); here:
  python scripts/bench/sglang_record.py convert OUT/raw/generate.jsonl \\
      tests/data/sglang_target/smollm2-0.5.14-generate.json --meta OUT/raw/generate.meta.json
  python scripts/bench/sglang_record.py convert OUT/raw/capture.jsonl \\
      tests/data/sglang_target/smollm2-0.5.14-capture.json --meta OUT/raw/capture.meta.json
then delete the standin-*.json files.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the /server_info fields the client reads (runner/engines.py server_info_problems,
# targets/sglang_target.py): the rest of SGLang's ~300 server args stay out of the fixtures
SERVER_KEYS = ("version", "model_path", "dtype", "tp_size", "dp_size", "ep_size",
               "enable_return_hidden_states", "disable_radix_cache", "chunked_prefill_size",
               "speculative_algorithm", "skip_tokenizer_init", "context_length",
               "max_prefill_tokens", "attention_backend")


class Recorder:
    """A proxy on a free loopback port (`url`) to `upstream`, logging to `log` (JSONL)."""

    def __init__(self, upstream: str, log: Path):
        self.upstream, self.log, self.lock = upstream.rstrip("/"), Path(log), threading.Lock()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _forward(self, body: bytes | None):
                req = urllib.request.Request(rec.upstream + self.path, data=body,
                                             method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=3600) as r:
                        status, ctype, data = r.status, r.headers.get("Content-Type"), r.read()
                except urllib.error.HTTPError as e:
                    status, ctype, data = e.code, e.headers.get("Content-Type"), e.read()
                rec.write({"method": self.command, "path": self.path,
                           "request": json.loads(body) if body else None, "status": status,
                           "content_type": ctype, "body_b64": base64.b64encode(data).decode()})
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers["Content-Length"])))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def write(self, entry: dict) -> None:
        with self.lock, open(self.log, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _chunks(body: bytes, streamed: bool) -> list[dict]:
    if not streamed:
        out = json.loads(body)
        return out if isinstance(out, list) else [out]
    return [json.loads(line[5:]) for line in body.split(b"\n")
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]")]


def convert(raw: Path, out: Path, meta: Path | None = None) -> dict:
    """A raw log (Recorder) -> the fixture dict, written to `out` (module docstring)."""
    files = raw.parent / "files"
    fx: dict = {"recorded": True, "source": str(raw.name), "generate": [], "capture": []}
    seen_gen, cap = set(), {}
    for line in raw.read_text().splitlines():
        e = json.loads(line)
        body = base64.b64decode(e["body_b64"])
        if e["method"] == "GET" and e["status"] == 200 and e["path"] in ("/model_info",
                                                                         "/server_info"):
            obj = json.loads(body)
            fx[e["path"][1:]] = obj if e["path"] == "/model_info" else \
                {k: obj.get(k) for k in SERVER_KEYS}
            continue
        if e["path"] != "/generate" or e["status"] != 200:
            continue
        req = e["request"]
        prompts = req["input_ids"] if isinstance(req["input_ids"][0], list) else [req["input_ids"]]
        sp = req.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        rids = req.get("rid") if isinstance(req.get("rid"), list) else [None] * len(prompts)
        chunks = _chunks(body, bool(req.get("stream")))
        if sps[0].get("max_new_tokens") == 1:  # capture
            for i, (ids, obj) in enumerate(zip(prompts, chunks)):
                c = cap.setdefault(json.dumps(ids), {"input_ids": ids})
                if req.get("return_hidden_states") or "json" not in c:
                    c["json"] = obj
                b = files / f"{rids[i]}.bin" if rids[i] else None
                if b is not None and b.exists():
                    c["bin_b64"] = base64.b64encode(b.read_bytes()).decode()
            continue
        for obj in chunks:
            fin = (obj.get("meta_info") or {}).get("finish_reason")
            i = int(obj.get("index", 0))
            if fin and json.dumps(prompts[i]) not in seen_gen:
                seen_gen.add(json.dumps(prompts[i]))
                fx["generate"].append({"input_ids": prompts[i], "sampling_params": sps[i],
                                       "result": {k: v for k, v in obj.items() if k != "index"}})
    fx["capture"] = list(cap.values())
    if meta is not None:
        fx["meta"] = json.loads(Path(meta).read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fx, separators=(",", ":")))
    return fx


# ----------------------------------------------------------------------------------------------
# stand-ins


def _bf16(x: float) -> float:
    """x rounded to a bfloat16 value (as the server's rows are)."""
    import numpy as np
    bits = np.array([x], dtype=np.float32).view(np.uint32)
    return float(((bits + 0x8000) & 0xFFFF0000).view(np.float32)[0])


def standin(outdir: Path) -> None:
    """The stand-in fixtures (module docstring), recorded: false."""
    import numpy as np
    sys.path.insert(0, str(ROOT / "tests"))
    from regen_helpers import conversations, params
    from eagle3_runner.engine.generate import Result
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer
    info = {"version": "0.5.14", "model_path": "stand-in", "dtype": "bfloat16", "tp_size": 1,
            "dp_size": 1, "ep_size": 1, "speculative_algorithm": None,
            "skip_tokenizer_init": True, "context_length": None, "chunked_prefill_size": 8192,
            "disable_radix_cache": False, "enable_return_hidden_states": False}
    tok = load_tokenizer(asset_path("smollm2"))
    stop = end_of_turn_ids(asset_path("smollm2"), tok)
    eos = stop[0]
    gen_records: list = []

    class MadeUp:  # answers every request with made-up ids, as an engine would
        R, M = 4, 8

        def run(self, requests, on_done, temperature=0.0, top_p=1.0, stop_ids=(), bar=None):
            todo, n = list(requests), 0
            while todo:
                req = todo.pop(0)
                k = len(gen_records)
                ids = tok.encode(f" made-up answer {k}", add_special_tokens=False)[:req.max_new - 1]
                ids = ids + ([eos] if len(ids) < req.max_new else [])
                fin = "stop" if ids[-1] == eos else "length"
                gen_records.append({
                    "input_ids": list(req.ids),
                    "sampling_params": {"max_new_tokens": req.max_new},
                    "result": {"output_ids": ids, "meta_info": {
                        "id": f"standin-{k}", "prompt_tokens": len(req.ids),
                        "completion_tokens": len(ids), "cached_tokens": 0,
                        "finish_reason": {"type": fin, **({"matched": eos} if fin == "stop"
                                                          else {"length": len(ids)})}}}})
                n += len(ids)
                nxt = on_done([Result(req.key, ids, fin, len(req.ids))])
                todo += [x for x in nxt or [] if x is not None]
            return {"new_tokens": n, "prefill_tokens": 0, "reused_tokens": 0, "steps": 0,
                    "prefills": 0, "seconds": 1e-3, "wait_s": 0.0, "kv_lens": []}

    import tempfile
    convs, p = conversations(6), params(synthetic_prompts=0, max_new_tokens=8, batch_size=4)
    with tempfile.TemporaryDirectory() as d:
        regenerate(None, tok, convs, p, 96, Path(d), progress=False, gen=MadeUp(),
                   stop_ids=stop)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "standin-generate.json").write_text(json.dumps({
        "recorded": False, "source": "scripts/bench/sglang_record.py standin",
        "model_info": {"model_path": "stand-in", "architectures": ["LlamaForCausalLM"]},
        "server_info": {**info, "skip_tokenizer_init": True},
        "generate": gen_records,
        "meta": {"conversations": convs, "params": p.model_dump(), "max_length": 96}}, indent=0))
    # capture: a tiny target (H 8, 4 layers, eagle ids [0, 1, 2]): rows = aux 3 x 8 | last 8
    H, ids_list, caps = 8, [[0, 0], [5, 6, 7], [9, 8, 7, 6, 5]], []
    for ids in ids_list:
        rows = [[_bf16(math.sin(0.37 * t + 0.11 * j + 0.05 * sum(ids))) for j in range(4 * H)]
                for t in range(len(ids))]
        bits = np.array(rows, dtype=np.float32).view(np.uint32) >> 16
        caps.append({"input_ids": ids, "json": {"output_ids": [1], "meta_info": {
            "id": "standin", "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 1}, "hidden_states": [rows]}},
            "bin_b64": base64.b64encode(bits.astype(np.uint16).tobytes()).decode()})
    (outdir / "standin-capture.json").write_text(json.dumps({
        "recorded": False, "source": "scripts/bench/sglang_record.py standin",
        "model_info": {"model_path": "stand-in", "architectures": ["LlamaForCausalLM"]},
        "server_info": {**info, "disable_radix_cache": True, "chunked_prefill_size": -1,
                        "enable_return_hidden_states": True},
        "capture": caps,
        "meta": {"geometry": {"hidden_size": H, "num_hidden_layers": 4, "aux_ids": [0, 1, 2]}}},
        indent=0))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("raw", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--meta", type=Path)
    s = sub.add_parser("standin")
    s.add_argument("outdir", type=Path, nargs="?", default=ROOT / "tests/data/sglang_target")
    a = ap.parse_args(argv)
    if a.cmd == "convert":
        fx = convert(a.raw, a.out, a.meta)
        print(f"{a.out}: {len(fx['generate'])} generation and {len(fx['capture'])} capture "
              "records")
    else:
        standin(a.outdir)
        print(f"stand-ins in {a.outdir}")


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
