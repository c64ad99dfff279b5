"""The SGLang serving engine from outside (targets/sglang.py) and the sglang bench backend
(targets/sglang_bench.py), on recorded servers (tests/data/sglang/<set>/, replayed by
tests/sglang_replay.py): argv building, the log and meta_info parsers against what servers said,
the server lifecycle (ready line, free ports, several servers at once, clean stop, a refusal and a
hang reported with the log), and the rows computed from recorded responses."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sglang_replay import HAND, fake_sglang, load_generate, recording_sets  # noqa: E402
from sglang_replay import spec_servers as _spec_servers  # noqa: E402

from eagle3_runner.runner.errors import ServerError, StageError  # noqa: E402
from eagle3_runner.targets.sglang import (error_line, free_ports, generate, launch,  # noqa: E402
                                         parse_accept_lens, server, server_accept_length,
                                         accept_per_pos_from_meta,
                                         server_argv, server_info, sglang_available, stop_all,
                                         tau_from_meta, wait_ready)

SETS = recording_sets()


def test_spec_argv_is_a_list_with_eagle3_and_all_three_counts():
    argv = server_argv("python3", "/m/t", 30000, tp=2, draft_path="/m/d", num_steps=3,
                       eagle_topk=1, num_draft_tokens=4, cuda_graph=True, cuda_graph_max_bs=8,
                       dtype="bfloat16", mem_fraction_static=0.1, nccl_port=30001)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    kv = dict(zip(argv[3::1], argv[4::1]))
    assert kv["--speculative-algorithm"] == "EAGLE3"
    assert kv["--speculative-draft-model-path"] == "/m/d"
    assert (kv["--speculative-num-steps"], kv["--speculative-eagle-topk"],
            kv["--speculative-num-draft-tokens"]) == ("3", "1", "4")
    assert kv["--tp-size"] == "2" and kv["--port"] == "30000" and kv["--model-path"] == "/m/t"
    assert kv["--cuda-graph-max-bs"] == "8" and "--disable-cuda-graph" not in argv
    assert (kv["--dtype"], kv["--mem-fraction-static"], kv["--nccl-port"]) == \
        ("bfloat16", "0.1", "30001")


def test_baseline_argv_has_no_speculation_and_can_disable_cuda_graph(monkeypatch):
    argv = server_argv("/venv/bin/python", "/m/t", 30001, cuda_graph=False,
                       extra=["--mem-fraction-static", "0.5"])
    assert not any(a.startswith("--speculative") for a in argv)
    assert "--disable-cuda-graph" in argv and argv[-2:] == ["--mem-fraction-static", "0.5"]
    with pytest.raises(ValueError):
        server_argv("python3", "/m/t", 1, draft_path="/d", num_steps=3)
    monkeypatch.setenv("HOME", "/home/u")  # a wrapper path is expanded like a spec path
    assert server_argv("~/sglang-python", "/m", 1)[0] == "/home/u/sglang-python"


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(6)
    assert len(set(ports)) == 6
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_free_ports_leave_room_for_sglangs_grpc_port(monkeypatch):
    """SGLang 0.5.14 refuses to start when --port + 10000 is past 65535 (the H200 smoke server of
    2026-12-05 got 57059 from the kernel and stopped: 'SGLANG_GRPC_PORT (67059) must be between
    1 and 65535'): every port picked is at most 55535, however high the kernel's picks run."""
    from eagle3_runner.runner.spec.server import MAX_HTTP_PORT
    assert MAX_HTTP_PORT == 55535
    picks = iter([60999, 57059, 40000, 58000, 41000, 42000])
    real = socket.socket

    class Fake(real):  # the kernel's picks, scripted: high ones first
        def bind(self, addr):
            self._port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self._port)
    monkeypatch.setattr(socket, "socket", Fake)
    assert free_ports(3) == [40000, 41000, 42000]
    monkeypatch.setattr(socket, "socket", real)
    assert all(p <= MAX_HTTP_PORT for p in free_ports(40))


def test_decode_log_accept_len_both_formats():
    assert parse_accept_lens((HAND / "s3-k1-n4-cg1" / "server.log").read_text()) == \
        [2.45, 2.10, 1.00]
    assert parse_accept_lens((HAND / "plain-cg1" / "server.log").read_text()) == []


@pytest.mark.parametrize("rec", SETS, ids=lambda p: p.name)
def test_every_recorded_speculative_log_and_response_parses(rec):
    """Against what each recorded server said: decode-log accept lengths are >= 1; tau is
    1 + accepted drafts / verify passes, SGLang's spec_accept_length (where recorded) is
    exactly server_accept_length, and it counts the prefill's token (so it is above tau unless
    the last round was cut); a plain server's response has no spec_verify_ct."""
    servers = _spec_servers(rec)
    assert servers, f"{rec}: no speculative server recorded"
    for d in servers:
        assert all(v >= 1 for v in parse_accept_lens((d / "server.log").read_text()))
        for r in load_generate(d):
            m = r["response"]["meta_info"]
            assert len(r["response"]["output_ids"]) == m["completion_tokens"]
            tau = tau_from_meta([m])
            assert tau == pytest.approx(1 + m["spec_num_correct_drafts"] / m["spec_verify_ct"])
            if "spec_accept_length" in m:
                assert server_accept_length([m]) == pytest.approx(m["spec_accept_length"])
            assert server_accept_length([m]) >= tau - (m["spec_num_correct_drafts"] + 1
                                                       ) / m["spec_verify_ct"]
    for r in load_generate(rec / "plain-cg1"):
        with pytest.raises(ValueError, match="EAGLE3"):
            tau_from_meta([r["response"]["meta_info"]])


@pytest.mark.parametrize("rec", SETS, ids=lambda p: p.name)
def test_recorded_histograms_give_per_position_acceptance_consistent_with_tau(rec):
    """SGLang's per-request accept histogram, pooled into per-position acceptance, sums back to
    tau - 1 (tau = 1 + accepted drafts / verify passes), falls with the position, and has one
    entry per draft step."""
    for d in _spec_servers(rec):
        steps = int(d.name.split("-")[0][1:])  # s<num_steps>-k..-n..-cg..
        metas = [r["response"]["meta_info"] for r in load_generate(d)]
        pos = accept_per_pos_from_meta(metas, steps)
        hists = [m.get("spec_correct_drafts_histogram", m.get("spec_accept_histogram"))
                 for m in metas]
        if any(h is None or sum(h) != m["spec_verify_ct"] for h, m in zip(hists, metas)):
            assert pos == []  # none recorded, or not one count per verify pass: NULL
            continue
        assert len(pos) == steps
        assert sum(pos) == pytest.approx(tau_from_meta(metas) - 1)
        assert all(a >= b for a, b in zip(pos, pos[1:]))


def test_accept_per_pos_pools_histograms_of_different_lengths():
    a = {"spec_verify_ct": 4, "spec_correct_drafts_histogram": [1, 1, 2]}
    b = {"spec_verify_ct": 2, "spec_accept_histogram": [1, 0, 0, 1]}
    # passes accepting 0/1/2/3 drafts: 2, 1, 2, 1 of 6
    assert accept_per_pos_from_meta([a, b], 3) == pytest.approx([4 / 6, 3 / 6, 1 / 6])
    assert accept_per_pos_from_meta([a, {"spec_verify_ct": 2}], 3) == []
    assert accept_per_pos_from_meta([a, {**b, "spec_verify_ct": 3}], 3) == []


@pytest.mark.parametrize("hist", [[1, "2"], [None, 3], [-1, 4], [0.5, 2.5], [True, 2]])
def test_accept_per_pos_refuses_counts_that_are_not_counts(hist):
    """A histogram count that is not a non-negative integer (an edited or damaged recording) is
    NULL, not a TypeError in the bench's read-back ("2", None) nor a made-up acceptance (-1 gave
    1.5 at position 1, 0.5 was truncated to 0)."""
    m = {"spec_verify_ct": 3, "spec_accept_histogram": hist}
    assert accept_per_pos_from_meta([m], 2) == []


def test_tau_pools_requests_and_falls_back_without_correct_drafts():
    a = {"completion_tokens": 8, "spec_verify_ct": 3, "spec_num_correct_drafts": 4}
    b = {"completion_tokens": 11, "spec_verify_ct": 5, "spec_num_correct_drafts": 5}
    assert tau_from_meta([a, b]) == pytest.approx(1 + 9 / 8)
    assert server_accept_length([a, b]) == pytest.approx(19 / 8)
    old = [{k: v for k, v in m.items() if k != "spec_num_correct_drafts"} for m in (a, b)]
    assert tau_from_meta(old) == pytest.approx((19 - 2) / 8)  # the prefill tokens left out


@pytest.mark.parametrize("rec", SETS, ids=lambda p: p.name)
def test_error_line_names_why_a_recorded_server_refused(rec):
    refused = [d for d in rec.iterdir() if (d / "server.log").exists()
               and not (d / "generate.jsonl").exists()]  # lab refusals: test_sglang_lab.py
    for d in refused:
        assert error_line((d / "server.log").read_text()), d
    assert error_line("[x] Ignore import error when loading sglang.srt.models.x: Can not import "
                      "FA3\nok") is None


def _env(tmp_path, rec: Path) -> dict:
    import os
    root = fake_sglang(tmp_path / "fake", rec)
    return {**os.environ, "PYTHONPATH": f"{root}:{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.parametrize("rec", SETS, ids=lambda p: p.name)
def test_servers_side_by_side_answer_as_recorded_and_stop(rec, tmp_path):
    """The plain and a speculative recorded server, launched at once on free ports: each is
    ready at its ready line, /server_info gives the recorded version, /generate the recorded
    answer; stop_all frees both ports."""
    env = _env(tmp_path, rec)
    spec_dir = _spec_servers(rec)[0]
    K, k, N = (int(x[1:]) for x in spec_dir.name.split("-")[:3])
    p1, n1, p2, n2 = free_ports(4)
    servers = [
        launch("plain", server_argv(sys.executable, "/m", p1, nccl_port=n1), "127.0.0.1", p1,
               tmp_path / "plain.log", env),
        launch("spec", server_argv(sys.executable, "/m", p2, draft_path="/d", num_steps=K,
                                   eagle_topk=k, num_draft_tokens=N, nccl_port=n2),
               "127.0.0.1", p2, tmp_path / "spec.log", env)]
    try:
        for srv, d in zip(servers, [rec / "plain-cg1", spec_dir]):
            wait_ready(srv, 60, poll_s=0.1)
            assert srv.ready_s > 0
            want = json.loads((d / "server_info.json").read_text())
            assert server_info(srv.url)["version"] == want["version"]
            r0 = load_generate(d)[0]
            got, dt = generate(srv.url, r0["request"]["input_ids"], r0["max_new_tokens"], 0.0, 10)
            assert got == r0["response"] and dt > 0
    finally:
        stop_all(servers)
    for p in (p1, p2):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", p)) != 0


def test_refused_and_hung_servers_raise_with_their_log(tmp_path):
    """A recorded refusal (its log replayed, its exit) and a server that never says it is ready:
    ServerError naming the exit or the timeout, with the log tail."""
    env = {**_env(tmp_path, HAND), "SGLANG_REPLAY_SERVER": "refused-kv-dtype"}
    port = free_ports(1)[0]
    srv = launch("refused", server_argv(sys.executable, "/m", port), "127.0.0.1", port,
                 tmp_path / "r.log", env)
    with pytest.raises(ServerError, match="unrecognized arguments") as e:
        wait_ready(srv, 30, poll_s=0.1)
    assert "exited with code 1" in str(e.value) and error_line(e.value.log_tail)
    hung = launch("hung", [sys.executable, "-c", "import time; print('loading', flush=True); "
                           "time.sleep(60)"], "127.0.0.1", port, tmp_path / "h.log")
    try:
        with pytest.raises(ServerError, match="not ready after 1 s") as e:
            wait_ready(hung, 1, poll_s=0.1)
        assert "loading" in e.value.log_tail
    finally:
        stop_all([hung])
    assert hung.proc.poll() is not None


def test_server_context_stops_even_on_error(tmp_path):
    env = _env(tmp_path, HAND)
    port = free_ports(1)[0]
    with pytest.raises(RuntimeError):
        with server(server_argv(sys.executable, "/m", port), "127.0.0.1", port,
                    tmp_path / "s.log", 30, env) as url:
            assert generate(url, [1, 2], 8, 0.0, 10)[0]["output_ids"]
            raise RuntimeError("bench failed mid-way")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


# ----------------------------------------------------------------------------------------------
# the rows of recorded responses


def _measured(rec: Path):
    """The recorded servers of a set as the backend's Measured, plus the bench settings they
    answer (their configurations, prompts and max_new_tokens)."""
    from eagle3_runner.runner.spec.stage_blocks import SpecParams
    from eagle3_runner.targets.sglang_bench import Measured, Planned
    plain = load_generate(rec / "plain-cg1")
    sets = {}
    for r in plain:
        sets.setdefault(r["prompt_set"], []).append((r["prompt_id"], r["request"]["input_ids"]))
    out = {"plain-cg1": Measured(Planned("plain-cg1", True), {
        (r["prompt_set"], r["max_new_tokens"], r["prompt_id"]): (r["response"], r["client_s"])
        for r in plain}, info=json.loads((rec / "plain-cg1" / "server_info.json").read_text()))}
    configs = []
    for d in _spec_servers(rec):
        K, k, N = (int(x[1:]) for x in d.name.split("-")[:3])
        c = SpecParams(num_steps=K, eagle_topk=k, num_draft_tokens=N)
        configs.append(c)
        out[d.name] = Measured(Planned(d.name, True, c), {
            (r["prompt_set"], r["max_new_tokens"], r["prompt_id"]): (r["response"], r["client_s"])
            for r in load_generate(d)}, info=json.loads((d / "server_info.json").read_text()),
            accept_lens=parse_accept_lens((d / "server.log").read_text()))
    mx = sorted({r["max_new_tokens"] for r in plain})
    p = SimpleNamespace(max_new_tokens=mx, temperature=0.0, configs=configs, cuda_graph=[True])
    return out, p, sets


@pytest.mark.parametrize("rec", SETS, ids=lambda p: p.name)
def test_rows_of_recorded_servers(rec):
    """Per recorded configuration: the summary's tau pools 1 + accepted / verify over the
    prompts, tok/s are completion tokens per server e2e second, the break-even tau is the round
    (e2e / verify passes) in plain tokens, lossless compares output_ids with the plain server's;
    a failed plain server turns every configuration into a failed row."""
    from eagle3_runner.targets.sglang_bench import rows_and_summaries
    measured, p, sets = _measured(rec)
    rows, sums = rows_and_summaries(measured, p, sets, 123)
    assert sums and all(s["backend"] == "sglang" and s["train_samples"] == 123 for s in sums)
    for s in sums:
        d = next(m for m in measured.values() if m.planned.config is not None and
                 m.planned.name.startswith(f"s{s['num_steps']}-k{s['eagle_topk']}-"))
        got = [d.responses[k] for k in d.responses if k[1] == s["max_new_tokens"]]
        base = [measured["plain-cg1"].responses[k] for k in d.responses
                if k[1] == s["max_new_tokens"]]
        if not got:
            continue
        metas = [r["meta_info"] for r, _ in got]
        assert s["tau"] == pytest.approx(1 + sum(m["spec_num_correct_drafts"] for m in metas) /
                                         sum(m["spec_verify_ct"] for m in metas))
        spec_s = sum(m["e2e_latency"] for m in metas)
        assert s["spec_tok_s"] == pytest.approx(sum(m["completion_tokens"] for m in metas) / spec_s)
        base_ms = 1000 * sum(b["meta_info"]["e2e_latency"] for b, _ in base) / \
            sum(b["meta_info"]["completion_tokens"] for b, _ in base)
        assert s["break_even_tau"] == pytest.approx(
            1000 * spec_s / sum(m["spec_verify_ct"] for m in metas) / base_ms)
        same = sum(r["output_ids"] == b["output_ids"] for (r, _), (b, _) in zip(got, base))
        assert s["lossless_prompts"] == same and s["server_version"]
        # no target margins here: a difference is unjudged, never "not lossless" (bench_rows
        # UNJUDGED; every recorded real SGLang 0.5.14 set differs on some prompt)
        assert "not lossless" not in s["flags"]
        unjudged = f"differs from plain on {len(got) - same}/{len(got)} prompts (unjudged"
        assert (unjudged in s["flags"]) == (same < len(got)), s["flags"]
        # per position from SGLang's own accept histograms (NULL where none is recorded)
        if all(sum(m.get("spec_correct_drafts_histogram", [-1])) == m["spec_verify_ct"]
               for m in metas):
            assert len(s["accept_per_pos"]) == s["num_steps"]
            assert sum(s["accept_per_pos"]) == pytest.approx(s["tau"] - 1)
        else:
            assert "accept_per_pos" not in s
    assert {r["prompt_id"] for r in rows} <= {pid for v in sets.values() for pid, _ in v}
    measured["plain-cg1"].error = "sglang server plain-cg1 exited with code 1: CUDA out of memory"
    _, sums = rows_and_summaries(measured, p, sets, 123)
    assert all(s["flags"] == "sglang server failed" and "out of memory" in s["explanation"]
               and s["n_prompts"] == 0 for s in sums)


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


def test_fixture_script_keeps_what_the_tests_read(tmp_path):
    """scripts/gpu/sglang_fixtures.py over a recorded bench folder: argv paths replaced, the
    first prompts of every server, the ready line, decode lines and errors of each log kept."""
    import importlib.util
    path = Path(__file__).parents[1] / "scripts" / "gpu" / "sglang_fixtures.py"
    spec = importlib.util.spec_from_file_location("sglang_fixtures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "set"
    assert mod.main(["--bench", str(HAND), "--out", str(out), "--prompts", "1"]) == 0
    for d in HAND.iterdir():
        assert (out / d.name / "server.log").exists()
    argv = json.loads((out / "s3-k1-n4-cg1" / "argv.json").read_text())
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "/runs/export"
    assert [r["prompt_id"] for r in load_generate(out / "plain-cg1")] == ["mtbench-81"]
    log = (out / "s3-k1-n4-cg1" / "server.log").read_text()
    assert "fired up and ready" in log and parse_accept_lens(log) == [2.45, 2.10, 1.00]
    assert error_line((out / "refused-kv-dtype" / "server.log").read_text())
    long = "\n".join([f"[t] Decode batch, #running-req: 1, accept len: 1.{i % 10}0, x"
                      for i in range(100)] + ["[t] boring"] * 50 + ["[t] RuntimeError: boom"])
    kept = mod.trim_log(long, 5)
    assert len(parse_accept_lens(kept)) == 5 and "RuntimeError: boom" in kept


@pytest.mark.parametrize("rec", SETS, ids=lambda p: p.name)
def test_a_resumed_bench_reads_back_the_servers_it_measured(rec, tmp_path, monkeypatch):
    """A bench cut short resumes (jobs/bench.py): a server whose recording was marked complete
    (keep_measured) on this machine is read back, answers and all, and not launched again; one
    marked on another machine or boot, one missing a request, or any when not resuming, is
    measured again."""
    import shutil
    from eagle3_runner.runner import bench_rows
    from eagle3_runner.targets import sglang_bench as B
    measured, p, sets = _measured(rec)
    root = tmp_path / "sglang"
    for name, m in measured.items():
        shutil.copytree(rec / name, root / name)
        B.keep_measured(root, m)
    got = B.load_measured(root, measured["plain-cg1"].planned, sets, p.max_new_tokens)
    assert got.responses == measured["plain-cg1"].responses and got.info
    spec_name = next(n for n in measured if n != "plain-cg1")
    assert B.load_measured(root, measured[spec_name].planned, sets,
                           p.max_new_tokens).accept_lens == measured[spec_name].accept_lens
    # the bench's own constructor: nothing left to launch when every server is there
    opts = SimpleNamespace(parallel=2, curve_parallel=None, port=None, host="127.0.0.1")
    bp = SimpleNamespace(**vars(p), sglang=opts)
    bench = B.SglangBench(None, bp, tmp_path, "m", tmp_path, sets, resume=True)
    assert set(bench.done) == set(measured) and bench.waves == []
    assert bench.measure().keys() == measured.keys()
    # a request missing from the recording, or another machine: measured again
    lines = (root / spec_name / "generate.jsonl").read_text().splitlines()
    (root / spec_name / "generate.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert B.load_measured(root, measured[spec_name].planned, sets, p.max_new_tokens) is None
    monkeypatch.setattr(B, "machine", lambda: "another-boot")
    assert B.load_measured(root, measured["plain-cg1"].planned, sets, p.max_new_tokens) is None
    monkeypatch.setattr(B, "machine", bench_rows.machine)
    fresh = B.SglangBench(None, bp, tmp_path, "m", tmp_path, sets, resume=False)
    assert fresh.done == {} and not (root / "plain-cg1" / B.MEASURED).exists()


# ----------------------------------------------------------------------------------------------
# waves: the timed servers with few neighbours, the curve's after them


def _pays_plan(curve: int = 4):
    """plan_servers of a bench shaped like specs/smollm2-pays-gpu.yaml: one cuda_graph setting,
    3/1/4, 5/1/6 and 5/4/8, and `curve` snapshot drafters."""
    from eagle3_runner.runner.spec.stage_blocks import SpecParams
    from eagle3_runner.targets.sglang_bench import plan_servers
    p = SimpleNamespace(cuda_graph=[True], configs=[
        SpecParams(num_steps=3), SpecParams(num_steps=5),
        SpecParams(num_steps=5, eagle_topk=4, num_draft_tokens=8)])
    snaps = [{"step": 400 * (i + 1), "dir": f"/snap/{i}", "samples": 100 * (i + 1)}
             for i in range(curve)]
    return plan_servers(p, snaps)


def _names(waves) -> list[list[str]]:
    return [[pl.name for pl in w] for w in waves]


TIMED = ["plain-cg1", "s3-k1-n4-cg1", "s5-k1-n6-cg1", "s5-k4-n8-cg1"]
SNAPS = [f"snap{400 * i:06d}-s3-k1-n4-cg1" for i in (1, 2, 3, 4)]


@pytest.mark.parametrize("parallel,curve_parallel,want", [
    (2, 4, [TIMED[:2], TIMED[2:], SNAPS]),  # the pays spec
    (2, None, [TIMED[:2], TIMED[2:], SNAPS[:2], SNAPS[2:]]),  # default: curve_parallel = parallel
    (1, 8, [[t] for t in TIMED] + [SNAPS]),
    (3, 3, [TIMED[:3], TIMED[3:], SNAPS[:3], SNAPS[3:]]),  # room left: no curve server joins
    (8, None, [TIMED, SNAPS]),  # the timed wave never takes a curve server, even with room
    (8, 1, [TIMED] + [[s] for s in SNAPS]),
])
def test_waves_time_each_server_beside_few_and_start_the_curve_after(parallel, curve_parallel,
                                                                     want):
    """plan_waves: the timed servers (plain, configurations) in plan order, `parallel` at a
    time; then the curve's snapshot servers, `curve_parallel` (None = parallel) at a time; no
    wave mixes the two (an idle neighbour slows a timed server: BENCHMARKS.md, 2026-12-07)."""
    from eagle3_runner.targets.sglang_bench import plan_waves
    waves = plan_waves(_pays_plan(), parallel, curve_parallel)
    assert _names(waves) == want
    for w in waves:
        assert len({pl.snapshot is None for pl in w}) == 1  # all timed or all curve
    assert plan_waves([], 2, 4) == []
    # the timed ones go first whatever order they come in, each kind keeping its own order
    plan = _pays_plan()
    mixed = [plan[4], plan[0], plan[5], plan[1], plan[2], plan[6], plan[3], plan[7]]
    assert _names(plan_waves(mixed, 2, 4)) == [TIMED[:2], TIMED[2:], SNAPS]
    # no curve: the timed waves alone
    assert _names(plan_waves(_pays_plan(curve=0), 2, 4)) == [TIMED[:2], TIMED[2:]]


def test_the_bench_launches_its_waves_and_resumes_without_the_measured(tmp_path):
    """SglangBench's waves are plan_waves' (stages.bench.sglang parallel / curve_parallel); a
    resumed bench leaves out the servers it measured (their recordings read back) and waves the
    rest the same way."""
    from eagle3_runner.runner.spec.stage_blocks import BenchStage, SglangOptions
    from eagle3_runner.targets import sglang_bench as B
    plan = _pays_plan()
    snaps = [pl.snapshot for pl in plan if pl.snapshot is not None]
    p = BenchStage(configs=[pl.config.model_dump() for pl in plan[1:4]], cuda_graph=[True],
                   max_new_tokens=[8], sglang=SglangOptions(parallel=2, curve_parallel=4))
    sets = {"mtbench": [("mtbench-81", [1, 2, 3])]}
    bench = B.SglangBench(None, p, tmp_path, "m", tmp_path, sets, snapshots=snaps)
    assert _names(bench.waves) == [TIMED[:2], TIMED[2:], SNAPS]
    # the plain server and one snapshot were measured by an earlier run on this machine
    for name in ("plain-cg1", SNAPS[1]):
        pl = next(x for x in plan if x.name == name)
        (tmp_path / "sglang" / name).mkdir(parents=True)
        (tmp_path / "sglang" / name / "generate.jsonl").write_text(json.dumps(B.record(
            "mtbench", "mtbench-81", 8, [1, 2, 3], 0.0, (), {"meta_info": {}}, 0.1)) + "\n")
        B.keep_measured(tmp_path / "sglang", B.Measured(pl))
    resumed = B.SglangBench(None, p, tmp_path, "m", tmp_path, sets, snapshots=snaps,
                            resume=True)
    assert set(resumed.done) == {"plain-cg1", SNAPS[1]}
    assert _names(resumed.waves) == [TIMED[1:3], TIMED[3:], [SNAPS[0]] + SNAPS[2:]]
    default = BenchStage(**{**p.model_dump(), "sglang": {"parallel": 3}})
    assert _names(B.SglangBench(None, default, tmp_path, "m", tmp_path, sets,
                                snapshots=snaps).waves) == [TIMED[:3], TIMED[3:], SNAPS[:3],
                                                            SNAPS[3:]]


def test_a_replayed_bench_measures_timed_servers_without_curve_neighbours(tmp_path, monkeypatch):
    """The recorded H200 servers replayed (tests/sglang_replay.py), the pays spec's shape with 2
    snapshot drafters, parallel 3 and curve_parallel 2: measure() runs 3 waves (3 timed, the
    fourth alone, though a wave of 3 has room for a curve server, then the curve's 2); while a
    timed server is measured at most 2 others are up, all ready, and never a curve one; the two curve
    servers are up together; every server answers every prompt and the curve gets its rows."""
    from eagle3_runner.runner.spec.stage_blocks import BenchStage, SglangOptions
    from eagle3_runner.targets import sglang_bench as B
    rec = next(d for d in SETS if d.name == "h200-0.5.14")
    measured, rp, sets = _measured(rec)
    sets = {k: v[:2] for k, v in sets.items()}
    root = fake_sglang(tmp_path / "fake", rec)
    import os
    monkeypatch.setenv("PYTHONPATH", f"{root}:{os.environ.get('PYTHONPATH', '')}")
    p = BenchStage(configs=[c.model_dump() for c in rp.configs], cuda_graph=[True],
                   max_new_tokens=rp.max_new_tokens,
                   sglang=SglangOptions(python=sys.executable, startup_timeout_s=60,
                                        parallel=3, curve_parallel=2))
    snaps = [{"step": s, "dir": str(tmp_path / f"step-{s:06d}"), "samples": 64 * s}
             for s in (200, 400)]
    up: set = set()
    seen: dict = {}
    unready: dict = {}  # a timed server's wave neighbours still starting while it is measured
    servers: dict = {}
    real_launch, real_stop, real_one = B.launch, B.stop_all, B.SglangBench._measure_one

    def launch(name, *a, **k):
        up.add(name)
        servers[name] = real_launch(name, *a, **k)
        return servers[name]

    def stop_all(servers):
        up.difference_update(s.name for s in servers)
        return real_stop(servers)

    def measure_one(self, pl, srv):
        seen[pl.name] = set(up)
        unready[pl.name] = {n for n in up if servers[n].ready_s is None} - {pl.name}
        return real_one(self, pl, srv)

    monkeypatch.setattr(B, "launch", launch)
    monkeypatch.setattr(B, "stop_all", stop_all)
    monkeypatch.setattr(B.SglangBench, "_measure_one", measure_one)
    bench = B.SglangBench(None, p, tmp_path / "out", "/m", tmp_path / "export", sets,
                          snapshots=snaps)
    curve = {f"snap{s:06d}-s3-k1-n4-cg1" for s in (200, 400)}
    assert [len(w) for w in bench.waves] == [3, 1, 2]
    assert {pl.name for pl in bench.waves[2]} == curve
    bench.start()
    got = bench.measure()
    assert not up and set(got) == set(measured) | curve
    assert all(m.error is None and len(m.responses) == 2 * len(rp.max_new_tokens)
               for m in got.values()), {n: m.error for n, m in got.items()}
    for name, alive in seen.items():
        assert name in alive
        if name in curve:
            assert alive == curve
        else:
            assert len(alive) <= 3 and not alive & curve, (name, alive)
            assert not unready[name], (name, unready[name])  # no neighbour still starting
    rows = B.curve_rows(got, p, sets)
    assert {r["snapshot_step"] for r in rows} == {200, 400} and all(r["tau"] > 1 for r in rows)
