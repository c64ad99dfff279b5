"""A replay of recorded SGLang responses over real HTTP, for the CPU tests of the SGLang target
(tests/test_sglang_target.py): the client code (targets/sglang_target.py,
engine/sglang_generate.py, targets/capture.py capture_sglang) talks to it exactly as to a server.

Fixtures: tests/data/sglang_target/*.json, written by scripts/bench/sglang_record.py `convert`
from what scripts/gpu/sglang_target.sh recorded on the H200 through its recording proxy (or, with
"recorded": false, its `standin` stand-ins until those exist). A fixture holds the server's
/model_info and /server_info, and per prompt (its input_ids) the finished /generate result of a
generation request and the response of a capture request (json: meta_info.hidden_states; file:
the rows' raw bf16 bytes, base64). The replay answers any batch the client composes from those
prompts: a generation request with the recorded result of each prompt (streamed: one SSE chunk per
request, tagged with its index, as SGLang 0.5.14 streams a batch), a capture request with the
recorded response (file: the recorded rows written to the sink folder under the request's own
rids). A prompt it has no record of gets HTTP 400, as SGLang answers a bad request.

Paced (`pace` seconds per output token): each streamed request's result is sent that long after
its call arrived, so requests finish one by one as on a server, and the replay counts the
generation requests it holds (`live`, its maximum `max_live`): what a client keeps in flight.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "data" / "sglang_target"


def fixtures(section: str) -> list[Path]:
    """The fixture files that hold `section` ("generate" or "capture")."""
    return [p for p in sorted(FIXTURES.glob("*.json")) if json.loads(p.read_text()).get(section)]


def key(ids) -> str:
    return json.dumps([int(x) for x in ids])


class Replay:
    """A replay server of fixture `path` on loopback `port` (0: a free one; `url`), stopped by
    close(). sink: the folder the file transport's rows go to. calls: the /generate bodies
    received. pace: seconds per output token before a streamed result is sent (module
    docstring); live / max_live: the streamed requests held now / at most."""

    def __init__(self, path: Path, sink: Path | None = None, port: int = 0, pace: float = 0.0):
        self.fx = json.loads(Path(path).read_text())
        self.gen = {key(g["input_ids"]): g for g in self.fx.get("generate", [])}
        self.cap = {key(c["input_ids"]): c for c in self.fx.get("capture", [])}
        self.sink, self.calls, self.pace = sink, [], pace
        self.live = self.max_live = 0
        self.lock = threading.Lock()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                body = {"/model_info": replay.fx["model_info"], "/health": {},
                        "/server_info": replay.fx["server_info"]}.get(self.path)
                if body is None:
                    return self._json(404, {"error": {"message": f"no {self.path}"}})
                self._json(200, body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                replay.calls.append(req)
                try:
                    status, out, stream = replay.answer(req)
                except KeyError as e:
                    return self._json(400, {"error": {"message": f"replay: {e}"}})
                if not stream:
                    return self._json(status, out)
                replay.held(len(out))
                t0 = time.monotonic()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for obj in sorted(out, key=lambda o: len(o["output_ids"])):  # as they finish
                    time.sleep(max(0.0, t0 + replay.pace * len(obj["output_ids"]) -
                                   time.monotonic()))
                    replay.held(-1)
                    self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def held(self, n: int) -> None:
        """n more (or fewer) streamed requests held."""
        with self.lock:
            self.live += n
            self.max_live = max(self.max_live, self.live)

    def answer(self, req: dict) -> tuple[int, object, bool]:
        """(status, body, streamed) for a /generate body. Raises KeyError for a prompt (or a
        max_new_tokens) the fixture has no record of."""
        prompts = req["input_ids"]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        sp = req.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        capture = sps[0].get("max_new_tokens") == 1 and (
            req.get("return_hidden_states") or str((req.get("rid") or [""])[0]).startswith(
                "e3cap-"))
        if capture:
            out = []
            for i, ids in enumerate(prompts):
                c = self.cap[key(ids)] if key(ids) in self.cap else _missing("capture", ids)
                obj = json.loads(json.dumps(c["json"]))
                if not req.get("return_hidden_states"):
                    obj["meta_info"].pop("hidden_states", None)
                elif "hidden_states" not in obj["meta_info"]:
                    raise KeyError(f"no json rows recorded for {ids[:8]}")
                rid = (req.get("rid") or [None] * len(prompts))[i]
                if rid and str(rid).startswith("e3cap-") and self.sink is not None:
                    if not c.get("bin_b64"):
                        raise KeyError(f"no file rows recorded for {ids[:8]}")
                    (self.sink / f"{rid}.bin").write_bytes(base64.b64decode(c["bin_b64"]))
                out.append(obj)
            return 200, out if len(out) > 1 or isinstance(req["input_ids"][0], list) else out[0], \
                False
        out = []
        for i, (ids, p) in enumerate(zip(prompts, sps)):
            g = self.gen[key(ids)] if key(ids) in self.gen else _missing("generate", ids)
            want = g["sampling_params"].get("max_new_tokens")
            if p.get("max_new_tokens") != want:
                raise KeyError(f"{ids[:8]}... was recorded with max_new_tokens {want}, asked "
                               f"{p.get('max_new_tokens')}")
            out.append({**g["result"], "index": i})
        return 200, out, bool(req.get("stream"))

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _missing(what: str, ids):
    raise KeyError(f"no {what} record for the prompt {list(ids)[:8]}... ({len(ids)} ids)")
