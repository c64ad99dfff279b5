"""Replay recorded SGLang servers (tests/data/sglang/<set>/<server>/, README there) for the CPU
tests: a fake `sglang.launch_server` that reads the argv the runner builds, picks the recorded
server of the same shape, prints its log up to the ready line, then serves /health,
/server_info and /generate with the recorded answers (the rest of its log printed at the first
request; which recorded server: `pick`); a recorded server that never became ready prints its log and exits 1, as it did
(environment SGLANG_REPLAY_SERVER=<folder> picks a recorded server by name).

    fake_sglang(tmp_path, SET_DIR) -> a folder to put first on PYTHONPATH
    recording_sets() -> every set folder (for pytest.mark.parametrize)
    spec_servers(set_dir) -> its speculative servers that answered
    load_generate(server_dir) -> the recorded generate.jsonl lines

Run as a script: python tests/sglang_replay.py SET_DIR launch_server-args...
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "sglang"
HAND = DATA / "handwritten"
READY = "The server is fired up and ready to roll!"


def recording_sets() -> list[Path]:
    return sorted(d for d in DATA.iterdir() if d.is_dir())


def spec_servers(set_dir: Path) -> list[Path]:
    """The recorded speculative servers that answered (s<K>-k<k>-n<N>-cg<0|1> with requests)."""
    return sorted(x for x in Path(set_dir).glob("s*-k*-n*-cg*") if (x / "generate.jsonl").exists())


def load_generate(server_dir: Path) -> list[dict]:
    f = Path(server_dir) / "generate.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def server_name(argv: list[str]) -> str:
    """The recording folder of a launch_server argv: plain-cg<0|1> or s<K>-k<k>-n<N>-cg<0|1>."""
    def flag(f):
        return argv[argv.index(f) + 1] if f in argv else None
    cg = int("--disable-cuda-graph" not in argv)
    if flag("--speculative-draft-model-path") is None:
        return f"plain-cg{cg}"
    return (f"s{flag('--speculative-num-steps')}-k{flag('--speculative-eagle-topk')}-"
            f"n{flag('--speculative-num-draft-tokens')}-cg{cg}")


def signature(argv: list[str]) -> tuple:
    """The speculative settings of an argv: (flag, value) of every --speculative-* flag but the
    draft's path (ports, paths and the interpreter differ between a recording and a replay)."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith("--speculative") and a != "--speculative-draft-model-path":
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
            out.append((a, nxt))
    return tuple(sorted(out))


def pick(set_dir: Path, argv: list[str]) -> Path | None:
    """The recorded server for a launch_server argv: the folder named like the draft's folder (a
    lab case's variant), else the one recorded with the same speculative settings ("good" first
    when several were), else by shape (server_name), any cuda_graph setting."""
    draft = argv[argv.index("--speculative-draft-model-path") + 1] \
        if "--speculative-draft-model-path" in argv else None
    if draft and (set_dir / Path(draft).name / "argv.json").exists():
        return set_dir / Path(draft).name
    same = sorted(d for d in set_dir.iterdir() if (d / "argv.json").exists() and
                  signature(json.loads((d / "argv.json").read_text())) == signature(argv))
    if same:
        return next((d for d in same if d.name == "good"), same[0])
    name = server_name(argv)
    stem = re.sub(r"-cg\d$", "", name)
    shaped = sorted(d for d in set_dir.glob(stem + "-cg*") if d.is_dir())
    return set_dir / name if (set_dir / name).is_dir() else (shaped[0] if shaped else None)


def fake_sglang(root: Path, set_dir: Path) -> Path:
    """A package `sglang` under root whose launch_server replays set_dir; returns root (put it
    first on the servers' PYTHONPATH)."""
    pkg = Path(root) / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("__version__ = 'replay'\n")
    (pkg / "launch_server.py").write_text(
        "import runpy, sys\n"
        f"sys.argv = [{str(Path(__file__).resolve())!r}, {str(Path(set_dir).resolve())!r}] + "
        "sys.argv[1:]\n"
        f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')\n")
    return Path(root)


def main(set_dir: str, argv: list[str]) -> int:
    forced = os.environ.get("SGLANG_REPLAY_SERVER")  # a recorded folder by name (a refusal)
    folder = Path(set_dir) / forced if forced else pick(Path(set_dir), argv)
    if folder is None:
        print(f"replay: no recorded server like {server_name(argv)} in {set_dir}", flush=True)
        return 3
    log = (folder / "server.log").read_text().splitlines()
    records = load_generate(folder)
    if not records:  # it never became ready: say what it said, exit as it did
        print("\n".join(log), flush=True)
        return 1
    info = json.loads((folder / "server_info.json").read_text())
    cut = next((i + 1 for i, ln in enumerate(log) if READY in ln), len(log))
    time.sleep(0.3)  # not ready at once
    print("\n".join(log[:cut]), flush=True)
    rest = {"lines": log[cut:]}
    served = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path in ("/server_info", "/get_server_info"):
                self._send(200, info)
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            mx = req.get("sampling_params", {}).get("max_new_tokens")
            hit = next((r for r in records if r["request"]["input_ids"] == req["input_ids"]
                        and r["max_new_tokens"] == mx), None)
            if hit is None:  # not a recorded prompt: the recorded answers in turn
                hit = records[served["n"] % len(records)]
            served["n"] += 1
            if rest["lines"]:
                print("\n".join(rest["lines"]), flush=True)
                rest["lines"] = []
            self._send(200, hit["response"])

        def log_message(self, *a):
            pass

    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    ThreadingHTTPServer((host, int(argv[argv.index("--port") + 1])), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
