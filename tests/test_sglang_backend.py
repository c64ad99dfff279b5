"""SGLang backend: argv building, log/meta_info parsing against recorded formats, server
lifecycle (health check, clean stop of the process group), the missing-extra error."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_runner.target.sglang import (parse_accept_lens, server, server_argv, sglang_available,
                                 tau_from_meta, generate)
from eagle3_runner.runner.errors import StageError

DATA = Path(__file__).parent / "data" / "sglang"


def test_spec_argv_is_a_list_with_eagle3_and_all_three_counts():
    argv = server_argv("python3", "/m/t", 30000, tp=2, draft_path="/m/d", num_steps=3,
                       eagle_topk=1, num_draft_tokens=4, cuda_graph=True, cuda_graph_max_bs=8)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    kv = dict(zip(argv[3::1], argv[4::1]))
    assert kv["--speculative-algorithm"] == "EAGLE3"
    assert kv["--speculative-draft-model-path"] == "/m/d"
    assert (kv["--speculative-num-steps"], kv["--speculative-eagle-topk"],
            kv["--speculative-num-draft-tokens"]) == ("3", "1", "4")
    assert kv["--tp-size"] == "2" and kv["--port"] == "30000" and kv["--model-path"] == "/m/t"
    assert kv["--cuda-graph-max-bs"] == "8" and "--disable-cuda-graph" not in argv


def test_baseline_argv_has_no_speculation_and_can_disable_cuda_graph():
    argv = server_argv("/venv/bin/python", "/m/t", 30001, cuda_graph=False,
                       extra=["--mem-fraction-static", "0.5"])
    assert not any(a.startswith("--speculative") for a in argv)
    assert "--disable-cuda-graph" in argv and argv[-2:] == ["--mem-fraction-static", "0.5"]
    with pytest.raises(ValueError):
        server_argv("python3", "/m/t", 1, draft_path="/d", num_steps=3)


def test_parse_decode_log_accept_len_both_formats():
    vals = parse_accept_lens((DATA / "decode_log.txt").read_text())
    assert vals == [2.45, 2.10, 1.00]


def test_tau_from_recorded_meta_info():
    spec = json.loads((DATA / "generate_spec.json").read_text())["meta_info"]
    base = json.loads((DATA / "generate_baseline.json").read_text())["meta_info"]
    assert tau_from_meta([spec]) == pytest.approx(8 / 3)
    assert tau_from_meta([spec, {**spec, "completion_tokens": 4, "spec_verify_ct": 4}]) == \
        pytest.approx(12 / 7)
    with pytest.raises(ValueError, match="EAGLE3"):
        tau_from_meta([base])


def test_missing_sglang_fails_at_validation_naming_the_extra():
    from eagle3_runner.jobs.bench import check_backend
    from eagle3_runner.runner.spec.load import load_spec
    ok, _ = sglang_available("python3")
    if ok:
        pytest.skip("sglang is installed here")
    data = {"name": "t", "target": {"path": "/nonexistent.gguf", "num_hidden_layers": 30,
                                    "hidden_size": 576, "vocab_size": 49152},
            "drafter": {"draft_vocab_size": 2048},
            "stages": {"bench": {"backend": "sglang"}}}
    spec = load_spec(data=data, check_target=False)
    with pytest.raises(StageError, match=r"eagle3-runner\[sglang\]"):
        check_backend(spec)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    time.sleep(0.5)  # not healthy at once
    body = open(sys.argv[2]).read().encode()
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a):
            print("Decode batch. #running-req: 1, accept len: 2.67, gen throughput (token/s): 9.0",
                  flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def test_server_lifecycle_health_generate_and_stop_even_on_error(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    port = _free_port()
    argv = [sys.executable, str(script), str(port), str(DATA / "generate_spec.json")]
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError):
        with server(argv, "127.0.0.1", port, log, startup_timeout_s=30) as url:
            out, dt = generate(url, [1, 2, 3], 8, 0.0, timeout=10)
            assert tau_from_meta([out["meta_info"]]) == pytest.approx(8 / 3) and dt > 0
            raise RuntimeError("bench failed mid-way")
    with socket.socket() as s:  # the server is gone: its port is free again
        assert s.connect_ex(("127.0.0.1", port)) != 0
    vals = parse_accept_lens(log.read_text())
    assert vals and set(vals) == {2.67}  # one log line per request (health + generate)


def test_server_that_exits_reports_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"]
    with pytest.raises(StageError, match="out of memory"):
        with server(argv, "127.0.0.1", _free_port(), tmp_path / "s.log", startup_timeout_s=30):
            pass
