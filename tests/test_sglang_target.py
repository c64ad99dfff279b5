"""SGLang as the target (issue 35): the engine choice and the plan's view of it, then the client
code against recorded SGLang responses replayed over HTTP (tests/sglang_target_replay.py; fixtures in
tests/data/sglang_target/: real recordings from scripts/gpu/sglang_target.sh, or stand-ins marked
"recorded": false until those exist), and the server-side capture hooks on their own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_target_replay import Replay, fixtures
from eagle3_runner.runner.engines import (CAPTURE, GENERATE, EMBEDDED_MAX_B, check_sglang,
                                          choose_engine, server_info_problems)
from eagle3_runner.runner.errors import PlanError, SpecError, StageError
from eagle3_runner.runner.spec.load import load_spec

ROOT = Path(__file__).resolve().parent.parent


def spec_of(tmp: Path, target=None, stages=None, overrides=(), cfg=None, executor=None):
    """A spec over a config-only target folder (a Llama of SmolLM2's geometry by default)."""
    folder = tmp / "target"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg or {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
        "hidden_size": 576, "vocab_size": 49152, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536}))
    data_file = tmp / "data.jsonl"
    data_file.write_text('{"conversations": [{"from": "human", "value": "hi"}, '
                         '{"from": "gpt", "value": "hello"}]}\n')
    return load_spec(data={
        "name": "s", "work_dir": str(tmp / "work"), "target": {"path": str(folder), **(target or {})},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
        "data": {"source": "jsonl", "path": str(data_file)},
        "stages": stages or {"extract": {}, "train": {}, "export": {}},
        "executor": executor or {"kind": "local"},
        "results": {"path": str(tmp / "r.duckdb")}}, overrides=list(overrides))


def cfg_of(spec) -> dict:
    return json.loads((Path(spec.target.path) / "config.json").read_text())


# ----------------------------------------------------------------------------------------------
# the engine choice: one rule


def test_auto_keeps_a_small_llama_on_our_engines_and_sends_the_rest_to_sglang(tmp_path):
    s = spec_of(tmp_path, stages={"regenerate": {}, "extract": {}, "train": {}})
    cfg = cfg_of(s)
    assert [choose_engine(s, st, cfg).engine for st in ("regenerate", "extract")] == \
        ["embedded", "hf"]
    assert choose_engine(s, "train", cfg) is None  # offline train does not run the target
    # SGLang declared, one GPU: the measured small-Llama rule keeps our engines
    s1 = spec_of(tmp_path, target={"sglang": {}}, stages={"regenerate": {}, "extract": {},
                                                          "train": {}})
    c = choose_engine(s1, "regenerate", cfg)
    assert c.engine == "embedded" and f"<= {EMBEDDED_MAX_B:g}B" in c.why
    # on two GPUs, or a larger target, or a server that already runs: SGLang
    s2 = spec_of(tmp_path, target={"sglang": {"tp": 2}}, stages={"regenerate": {}, "extract": {},
                                                                 "train": {}})
    assert choose_engine(s2, "extract", cfg).engine == "sglang"
    assert "on 2 GPUs" in choose_engine(s2, "regenerate", cfg).why
    s3 = spec_of(tmp_path, target={"sglang": {}, "num_parameters_b": 8.0},
                 stages={"regenerate": {}, "extract": {}, "train": {}})
    assert choose_engine(s3, "regenerate", cfg).engine == "sglang"
    s4 = spec_of(tmp_path, target={"sglang": {"server": "http://127.0.0.1:1"}},
                 stages={"regenerate": {}, "extract": {}, "train": {}})
    assert choose_engine(s4, "regenerate", cfg).why.startswith("auto: target.sglang.server")


def test_declared_engines_that_cannot_run_a_stage_are_refused_at_validation(tmp_path):
    with pytest.raises(SpecError, match="no transformers generation path"):
        spec_of(tmp_path, target={"engine": "hf"}, stages={"regenerate": {}, "extract": {},
                                                           "train": {}})
    deepseek = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 1000}
    with pytest.raises(SpecError, match="needs SGLang"):  # auto, no target.sglang
        spec_of(tmp_path, stages={"regenerate": {}, "extract": {}, "train": {}}, cfg=deepseek,
                overrides=["drafter.aux_layer_ids=[1,3,5]"])
    with pytest.raises(SpecError, match="is not one; use sglang"):
        spec_of(tmp_path, target={"engine": "embedded"}, cfg=deepseek,
                stages={"regenerate": {}, "extract": {}, "train": {}},
                overrides=["drafter.aux_layer_ids=[1,3,5]"])
    # embedded captures through transformers; online training's own embedded capture is
    # stages.train.online_capture, never beside an SGLang target
    s = spec_of(tmp_path, target={"engine": "embedded"})
    assert choose_engine(s, "extract", cfg_of(s)).engine == "hf"
    online = {"train": {"features": "online", "online_capture": "embedded"}}
    s = spec_of(tmp_path, stages=online)
    assert choose_engine(s, "train", cfg_of(s)).engine == "embedded"
    with pytest.raises(SpecError, match="online_capture = 'embedded' runs the target on our"):
        spec_of(tmp_path, target={"engine": "sglang"}, stages=online)


def test_target_sglang_refuses_runner_flags_a_public_host_and_launch_fields_with_a_server(
        tmp_path):
    for bad, msg in [({"extra_args": ["--disable-radix-cache"]}, "sets --disable-radix-cache"),
                     ({"extra_args": ["--tp=2"]}, "use target.sglang.tp instead"),
                     ({"extra_args": ["--speculative-algo", "EAGLE3"]}, "no speculation"),
                     ({"host": "0.0.0.0"}, "loopback only"),
                     ({"tp": 4, "ep": 3}, "must divide tp"),
                     ({"server": "http://127.0.0.1:30000", "tp": 8}, "remove tp"),
                     ({"server": "127.0.0.1:30000"}, "give a URL")]:
        with pytest.raises(SpecError, match=msg):
            spec_of(tmp_path, target={"sglang": bad})


def test_the_plan_prints_each_stage_engine_and_the_server_layout(tmp_path, monkeypatch):
    from eagle3_runner.runner import engines
    from eagle3_runner.runner.cli import _render_plan
    from eagle3_runner.runner.plan import build_plan
    monkeypatch.setattr(engines, "sglang_version", lambda python, timeout=30.0: ("0.5.14", ""))
    s = spec_of(tmp_path, target={"sglang": {"tp": 2, "dp": 2, "version": "0.5.14"}},
                stages={"regenerate": {}, "extract": {}, "train": {}},
                executor={"kind": "local", "gpus_per_node": 4, "gpu_memory_gb": 139})
    text = _render_plan(build_plan(s))
    assert "engine: regenerate: sglang (auto: a 0.16B-parameter target, a Llama, on 4 GPUs" \
        in text
    assert "memory: extract: layout SGLang server, 2 replica(s) x tp 2 = GPUs 0-3 of 4" in text
    with pytest.raises(PlanError, match=r"tp x dp = 2 x 2 = 4 GPUs, but the stage has 2"):
        build_plan(spec_of(tmp_path, target={"sglang": {"tp": 2, "dp": 2}},
                           executor={"kind": "local", "gpus_per_node": 2}))
    with pytest.raises(PlanError, match="extract through SGLang runs one process"):
        build_plan(spec_of(tmp_path, target={"engine": "sglang"},
                           executor={"kind": "local", "nproc_per_node": 2, "gpus_per_node": 2}))
    monkeypatch.setattr(engines, "sglang_version", lambda python, timeout=30.0: ("0.5.6", ""))
    with pytest.raises(PlanError, match="has sglang 0.5.6, target.sglang.version is 0.5.14"):
        build_plan(s)


def test_online_training_beside_the_server_must_leave_the_drafter_room(tmp_path, monkeypatch):
    from eagle3_runner.runner import engines
    from eagle3_runner.runner.plan import build_plan
    monkeypatch.setattr(engines, "sglang_version", lambda python, timeout=30.0: ("0.5.14", ""))
    stages = {"train": {"features": "online"}, "export": {}}
    ex = {"kind": "local", "gpus_per_node": 1, "gpu_memory_gb": 4}
    ok = build_plan(spec_of(tmp_path, target={"engine": "sglang",
                                              "sglang": {"mem_fraction_static": 0.5}},
                            stages=stages, executor=ex))
    (m,) = ok.memory["stages"]
    assert m["fits"] and m["drafter_gib"] > 0 and "training ranks beside it" in m["layout"]
    with pytest.raises(PlanError, match="drafter's .* does not fit"):
        build_plan(spec_of(tmp_path, target={"engine": "sglang",
                                             "sglang": {"mem_fraction_static": 0.94}},
                           stages=stages, executor=ex))


# ----------------------------------------------------------------------------------------------
# a running server, replayed


@pytest.fixture
def replay(request, tmp_path):
    r = Replay(request.param, sink=tmp_path)
    yield r
    r.close()


def _capture_spec(tmp_path, fx: dict, transport: str, **sglang):
    g = fx["meta"]["geometry"] if "meta" in fx and "geometry" in fx["meta"] else \
        {"hidden_size": 576, "num_hidden_layers": 30, "aux_ids": [1, 14, 26]}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "num_hidden_layers": g["num_hidden_layers"], "hidden_size": g["hidden_size"],
           "vocab_size": 49152, "num_attention_heads": 2, "num_key_value_heads": 2,
           "intermediate_size": 16}
    s = spec_of(tmp_path, cfg=cfg, target={"engine": "sglang",
                                           "sglang": {"transport": transport, **sglang}},
                overrides=[f"drafter.aux_layer_ids={g['aux_ids']}"])
    return s, cfg


def _server(replay, spec, cfg, transport):
    from eagle3_runner.targets.sglang_target import TargetServer, capture_width, check_server
    srv = TargetServer(replay.url, CAPTURE, transport, replay.sink, capture_width(spec, cfg),
                       timeout=5.0, per_call=2, launched=True)
    srv.info = check_server(srv, spec)
    return srv


@pytest.mark.parametrize("replay", fixtures("capture"), indirect=True, ids=lambda p: p.name)
@pytest.mark.parametrize("transport", ["json", "file"])
def test_capture_rows_come_back_as_recorded_by_either_transport(replay, transport, tmp_path):
    from eagle3_runner.targets.capture import capture_sglang
    fx = replay.fx
    if transport == "json":  # a json-transport server writes no files (no sink folder)
        replay.sink = None
    spec, cfg = _capture_spec(tmp_path, fx, transport)
    srv = _server(replay, spec, cfg, transport)  # /model_info, /server_info and the 2-id probe
    n_aux, H = len(spec.aux_ids), int(cfg["hidden_size"])
    prompts = [c["input_ids"] for c in fx["capture"]]
    aux, last = capture_sglang(srv, prompts, n_aux, H, torch.bfloat16, calls=2)
    assert aux.shape == (len(prompts), max(map(len, prompts)), n_aux * H)
    for i, c in enumerate(fx["capture"]):
        rows = torch.tensor(c["json"]["meta_info"]["hidden_states"][0], dtype=torch.float32)
        n = len(c["input_ids"])
        assert torch.equal(aux[i, :n].float(), rows[:, :n_aux * H])  # bf16 values, exactly
        assert torch.equal(last[i, :n].float(), rows[:, n_aux * H:])
        assert not aux[i, n:].any()  # right padding, as capture()
    sent = [c for c in replay.calls if c["sampling_params"]["max_new_tokens"] == 1]
    assert all(bool(c.get("return_hidden_states")) == (transport == "json") for c in sent)
    assert not list(tmp_path.glob("*.bin"))  # every file read and deleted


@pytest.mark.parametrize("replay", fixtures("capture"), indirect=True, ids=lambda p: p.name)
def test_a_server_without_the_capture_model_or_with_a_radix_cache_is_refused(replay, tmp_path):
    from eagle3_runner.targets.sglang_target import TargetServer, check_server
    spec, cfg = _capture_spec(tmp_path, replay.fx, "json")
    wide = TargetServer(replay.url, CAPTURE, "json", None, 7, timeout=5.0, launched=True)
    with pytest.raises(StageError, match="does not run the capture model"):
        check_server(wide, spec)
    info = {**replay.fx["server_info"], "disable_radix_cache": False, "chunked_prefill_size": 8}
    problems = server_info_problems(replay.fx["model_info"], info, spec, CAPTURE, "S")
    assert any("radix cache on" in p for p in problems)
    assert any("chunks prefills at 8 tokens" in p for p in problems)
    # the plan's check of target.sglang.server: the replayed server answers
    s = spec_of(tmp_path, target={"sglang": {"server": replay.url, "version": "9.9"}})
    assert any("runs SGLang 0.5.14, target.sglang.version is 9.9" in p
               for p in check_sglang(s, CAPTURE))


@pytest.mark.parametrize("replay", fixtures("capture"), indirect=True, ids=lambda p: p.name)
def test_extract_shards_from_the_server_hold_its_rows(replay, tmp_path):
    """extract_samples on a TargetData whose target is the (replayed) server: the shards hold
    the recorded rows, split into aux and last, in the features format."""
    from eagle3_runner.jobs.extract import extract_samples
    from eagle3_runner.targets.capture import TargetData
    from eagle3_runner.targets.features import open_features  # noqa: F401 - the format's reader
    from safetensors.torch import load_file
    spec, cfg = _capture_spec(tmp_path, replay.fx, "file")
    srv = _server(replay, spec, cfg, "file")
    caps = [c for c in replay.fx["capture"] if len(c["input_ids"]) > 2]
    samples = [(c["input_ids"], [1] * len(c["input_ids"])) for c in caps]
    td = TargetData(None, None, cfg, samples, {}, {}, 0, srv, spec)
    out = tmp_path / "x"
    out.mkdir()
    res = extract_samples(td, samples, list(spec.aux_ids), out, 8, 4096, progress=False)
    (sh,) = res["shards"]
    t = load_file(str(out / sh["file"]))
    H, n_aux = int(cfg["hidden_size"]), len(spec.aux_ids)
    assert t["aux_hidden"].dtype == torch.bfloat16 and t["aux_hidden"].shape[1] == n_aux * H
    off = t["offsets"].tolist()
    for k, i in enumerate(t["sample_ids"].tolist()):
        rows = torch.tensor(caps[i]["json"]["meta_info"]["hidden_states"][0])
        assert torch.equal(t["aux_hidden"][off[k]:off[k + 1]].float(), rows[:, :n_aux * H])
        assert torch.equal(t["last_hidden"][off[k]:off[k + 1]].float(), rows[:, n_aux * H:])


@pytest.mark.parametrize("transport", ["file", "json"])
def test_a_stage_launches_its_capture_server_with_the_runner_flags_and_stops_it(
        transport, tmp_path, monkeypatch):
    """stage_server: `python -m sglang.launch_server` (here tests/fake_sglang_server.py serving
    a capture fixture) with the capture flags and environment, checked before use (the probe),
    captures through it, and the server is gone after the block."""
    import socket
    import stat
    import sys
    from eagle3_runner.targets.capture import capture_sglang
    from eagle3_runner.targets.sglang_target import stage_server
    fx_path = fixtures("capture")[0]
    fx = json.loads(fx_path.read_text())
    with socket.socket() as so:  # a free port
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'fake_sglang_server.py'} "
                  '"$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    spec, cfg = _capture_spec(tmp_path, fx, transport, python=str(py), port=port,
                              startup_timeout_s=60)
    log = tmp_path / "fake.json"
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))
    monkeypatch.setenv("FAKE_SGLANG_FIXTURE", str(fx_path))
    H, n_aux = int(cfg["hidden_size"]), len(spec.aux_ids)
    prompts = [c["input_ids"] for c in fx["capture"]]
    with stage_server(spec, CAPTURE, cfg, tmp_path / "logs", max_prefill_tokens=4096) as srv:
        assert srv.transport == transport and srv.launched and srv.width == (n_aux + 1) * H
        aux, _last = capture_sglang(srv, prompts, n_aux, H)
        url = srv.url
    row = torch.tensor(fx["capture"][-1]["json"]["meta_info"]["hidden_states"][0])
    assert torch.equal(aux[-1, :len(prompts[-1])].float(), row[:, :n_aux * H])
    seen = json.loads(log.read_text())
    argv = seen["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"]
    for flag in ("--disable-radix-cache", "--skip-tokenizer-init"):
        assert flag in argv
    assert argv[argv.index("--chunked-prefill-size") + 1] == "-1"
    assert argv[argv.index("--max-prefill-tokens") + 1] == "4096"
    assert ("--enable-return-hidden-states" in argv) == (transport == "json")
    env = seen["env"]
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "eagle3_runner.targets.sglang_models"
    assert env["EAGLE3_CAPTURE_LAYERS"] == ",".join(map(str, spec.aux_ids))
    assert env["EAGLE3_CAPTURE_ARCHS"] == "LlamaForCausalLM"
    assert ("EAGLE3_CAPTURE_SINK" in env) == (transport == "file")
    from eagle3_runner.runner.engines import get_json
    with pytest.raises(OSError):  # stopped
        get_json(url + "/health", timeout=2)


@pytest.mark.parametrize("replay", fixtures("generate"), indirect=True, ids=lambda p: p.name)
def test_the_generator_contract_over_a_server(replay):
    """SglangGenerator.run: every request's recorded answer, with at most `rows` in flight over
    calls of up to per_call prompts; follow-ups returned by on_done run too."""
    from eagle3_runner.engine.generate import Request
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.targets.sglang_target import TargetServer
    recs = replay.fx["generate"]
    srv = TargetServer(replay.url, GENERATE, timeout=10.0, per_call=2)
    gen = SglangGenerator(srv, rows=3, max_new=max(r["sampling_params"]["max_new_tokens"]
                                                   for r in recs))
    first, later = recs[:len(recs) // 2], recs[len(recs) // 2:]
    got: dict = {}

    def on_done(results):
        for r in results:
            got[r.key] = r
        return [Request(("f", r.key), later[r.key]["input_ids"],
                        later[r.key]["sampling_params"]["max_new_tokens"])
                if isinstance(r.key, int) and r.key < len(later) else None for r in results]
    st = gen.run((Request(i, r["input_ids"], r["sampling_params"]["max_new_tokens"])
                  for i, r in enumerate(first)), on_done)
    for i, r in enumerate(first):
        assert got[i].tokens == r["result"]["output_ids"]
        assert got[i].finish == r["result"]["meta_info"]["finish_reason"]["type"]
    for i in range(min(len(first), len(later))):
        assert got[("f", i)].tokens == later[i]["result"]["output_ids"]
    n = len(got)
    assert st["new_tokens"] == sum(len(x.tokens) for x in got.values())
    assert st["prefills"] >= -(-n // 2)  # calls of <= 2 prompts
    calls = [c for c in replay.calls if c.get("stream")]
    assert max(len(c["input_ids"]) for c in calls) <= 2
    assert all(c["sampling_params"][0]["stream_interval"] > 10 ** 6 for c in calls)


@pytest.mark.parametrize("replay", fixtures("generate"), indirect=True, ids=lambda p: p.name)
def test_regenerate_through_a_server_writes_the_same_shards_and_resumes(replay, tmp_path):
    """jobs/regenerate.py regenerate() with the SGLang engine: every turn's prompt is rendered by
    our template and answered with the server's output_ids; a second run resumes with nothing
    left to ask."""
    from eagle3_runner.data.prompts import render
    from eagle3_runner.data.regen_store import read_records
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer
    from eagle3_runner.targets.sglang_target import TargetServer
    meta = replay.fx["meta"]
    tok = load_tokenizer(asset_path("smollm2"))
    stop = end_of_turn_ids(asset_path("smollm2"), tok)
    p = RegenerateStage(**meta["params"])
    srv = TargetServer(replay.url, GENERATE, timeout=10.0, per_call=2)
    gen = SglangGenerator(srv, p.batch_size, p.max_new_tokens)
    m = regenerate(None, tok, meta["conversations"], p, meta["max_length"], tmp_path, gen=gen,
                   progress=False, stop_ids=stop)
    recs = read_records(tmp_path)
    warm = json.dumps(render(tok, [{"role": "user", "content": "Hello!"}]))  # warm_up's request
    answers = {json.dumps(r["input_ids"]): r["result"]["output_ids"]
               for r in replay.fx["generate"] if json.dumps(r["input_ids"]) != warm}
    assert sum(len(r["finish"]) for r in recs) == len(answers)  # every turn, once
    assert m["tokens_generated"][0] == sum(map(len, answers.values()))
    assert m["tokens_per_s_answers_real"][0] > 0 and "decode_slot_use" not in m
    asked = len(replay.calls)
    m2 = regenerate(None, tok, meta["conversations"], p, meta["max_length"], tmp_path, gen=gen,
                    progress=False, stop_ids=stop)
    assert m2["resumed_conversations"] == len(recs)
    assert len(replay.calls) == asked + 1  # the warm-up request only
    assert read_records(tmp_path) == recs


# ----------------------------------------------------------------------------------------------
# the server side: the capture hooks on SGLang-shaped modules


class _Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend


class _Norm(torch.nn.Module):  # SGLang's RMSNorm(x, residual) -> (normed, x + residual)
    def forward(self, x, residual=None):
        if residual is None:
            return x * 2
        s = x + residual
        return s * 2, s


class _Logits(torch.nn.Module):  # SGLang's LogitsProcessor: aux is the 5th positional argument
    def forward(self, input_ids, hidden, lm_head, fb, aux=None):
        return torch.cat(aux, -1) if aux is not None else hidden


class _Model(torch.nn.Module):
    """The call pattern of SGLang 0.5.14's LlamaForCausalLM.forward: layers capture the stream
    entering layers ids+1, the final norm fuses the residual add, the logits processor gets the
    aux list."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.norm = _Norm()
        self.logits_processor = _Logits()
        self.layers_to_capture = []

    def set_eagle3_layers_to_capture(self, ids):
        self.layers_to_capture = [k + 1 for k in ids]

    def forward(self, x, fb):
        aux, h, res = [], x, torch.zeros_like(x)
        for i in range(4):
            if i in self.layers_to_capture:
                aux.append(h + res)
            h, res = h * 0 + i + 1.0, h + res
        final, _ = self.model.norm(h, res)
        return self.logits_processor(None, final, None, fb, aux)


def test_the_hooks_append_the_pre_norm_last_hidden_and_write_prefill_rows(tmp_path):
    from types import SimpleNamespace
    from eagle3_runner.targets.sglang_hooks import Sink, install_capture
    m = _Model()
    sink = Sink(tmp_path)
    install_capture(m, [0, 1], sink)
    x = torch.arange(10, dtype=torch.bfloat16).view(5, 2)  # 5 tokens of 2 requests, H = 2
    fb = SimpleNamespace(forward_mode=_Mode(True), rids=["e3cap-a", "other"],
                         extend_seq_lens_cpu=[3, 2], extend_prefix_lens_cpu=[0, 0])
    out = m(x, fb)
    assert out.shape == (5, 3 * 2)  # [aux layer 0 out | aux layer 1 out | last pre-norm]
    h, res = x, torch.zeros_like(x)
    for i in range(4):
        h, res = h * 0 + i + 1.0, h + res
    assert torch.equal(out[:, 4:], h + res)  # before the norm (the norm would double it)
    sink.pool.shutdown(wait=True)
    bits = np.fromfile(tmp_path / "e3cap-a.bin", dtype=np.int16)
    assert torch.equal(torch.from_numpy(bits).view(torch.bfloat16).view(3, 6), out[:3])
    assert not (tmp_path / "other.bin").exists()  # not a capture request
    # a prefill that does not start at 0 (a cache hit): an .err, no rows
    fb2 = SimpleNamespace(forward_mode=_Mode(True), rids=["e3cap-b"], extend_seq_lens_cpu=[2],
                          extend_prefix_lens_cpu=[3])
    m(x[:2], fb2)
    assert "prefix cache hit" in (tmp_path / "e3cap-b.err").read_text()
    m(x[:1], SimpleNamespace(forward_mode=_Mode(False), rids=["e3cap-c"]))  # decode: nothing
    assert not (tmp_path / "e3cap-c.bin").exists()


def test_file_rows_wait_for_the_file_and_report_the_server_refusal(tmp_path):
    from eagle3_runner.targets.sglang_target import bf16_to_float32, file_rows
    rows = torch.randn(3, 4).to(torch.bfloat16)
    (tmp_path / "r1.bin").write_bytes(rows.view(torch.int16).numpy().tobytes())
    got = file_rows(tmp_path, "r1", 3, 4, 1.0)
    assert torch.equal(torch.from_numpy(got), rows.float())
    assert not (tmp_path / "r1.bin").exists()
    (tmp_path / "r2.err").write_text("its prefill starts at position 5")
    with pytest.raises(StageError, match="refused r2: its prefill starts"):
        file_rows(tmp_path, "r2", 3, 4, 1.0)
    with pytest.raises(StageError, match="wrote no rows for r3"):
        file_rows(tmp_path, "r3", 3, 4, 0.05)
    assert bf16_to_float32(np.array([0x3F80], dtype=np.uint16))[0] == 1.0


# ----------------------------------------------------------------------------------------------
# what a stage records when a server holds the model


@pytest.mark.slow
def test_head_and_config_without_the_model_equal_the_loaded_ones():
    """load_head (the checkpoint's tensors) and hf_config (AutoConfig) give what load_target's
    model gives: the same target_head.safetensors and the same manifest config hash."""
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.targets.capture import target_head
    from eagle3_runner.targets.load import config_sha256, hf_config, load_head, load_target
    path = asset_path("smollm2")
    model, _tok, cfg = load_target(path, device="cpu", dtype="float32")
    want = target_head(model)
    got = load_head(path, torch.float32)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert config_sha256(hf_config(path)) == config_sha256(cfg)
