"""Where generation stops: the target's end-of-turn ids (runner/target_config.py stop_token_ids,
targets/load.py end_of_turn_ids), never the tokenizer's eos_token when the model says otherwise.

Issue 43: transformers 5.17 converts SmolLM2's GGUF with eos_token <|im_start|> (id 1) while the
GGUF header and the converted generation_config.json say 2 (<|im_end|>). `im_start` below is that
folder, made from the real conversion's tokenizer and config files (no weights: nothing here
loads the model)."""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_runner.runner.target_config import StopIds, stop_ids_note, stop_token_ids

IM_START, IM_END = 1, 2
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")


def _rewrite(path: Path, **changes) -> None:
    """Set (or, with None, delete) top-level keys of a JSON file."""
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


def _copy_small_files(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in SMALL_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    return dest


@pytest.fixture
def im_start(smollm2_path, tmp_path) -> Path:
    """SmolLM2's converted HF folder, weights left out, its tokenizer_config.json eos_token
    rewritten to <|im_start|> as transformers 5.17 writes it."""
    from eagle3_runner.targets.load import hf_folder
    folder = _copy_small_files(hf_folder(smollm2_path), tmp_path / "im_start")
    _rewrite(folder / "tokenizer_config.json", eos_token="<|im_start|>")
    return folder


def _tok(folder: Path):
    from eagle3_runner.targets.load import load_tokenizer
    return load_tokenizer(folder)


# ----------------------------------------------------------------------------------------------
# the rule


def test_the_generation_config_wins_over_the_tokenizer(im_start):
    from eagle3_runner.targets.load import end_of_turn_ids
    tok = _tok(im_start)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_start|>", IM_START)  # the 5.17 quirk
    assert stop_token_ids(im_start) == StopIds(
        (IM_END,), f"{im_start / 'generation_config.json'} eos_token_id")
    assert stop_token_ids(im_start, tok.eos_token_id).ids == (IM_END,)
    assert end_of_turn_ids(im_start, tok) == (IM_END,)


def test_a_list_valued_eos_token_id_gives_every_id(im_start):
    from eagle3_runner.targets.load import end_of_turn_ids
    _rewrite(im_start / "generation_config.json", eos_token_id=[2, 5, 2])
    assert stop_token_ids(im_start).ids == (2, 5)
    assert end_of_turn_ids(im_start, _tok(im_start)) == (2, 5)


def test_without_a_generation_config_config_json_then_the_tokenizer(im_start):
    from eagle3_runner.targets.load import end_of_turn_ids
    tok = _tok(im_start)
    (im_start / "generation_config.json").unlink()
    assert stop_token_ids(im_start) == StopIds((IM_END,), f"{im_start / 'config.json'} "
                                                          "eos_token_id")
    _rewrite(im_start / "config.json", eos_token_id=None)
    assert stop_token_ids(im_start, IM_START) == StopIds((IM_START,),
                                                         "the tokenizer's eos_token_id")
    assert end_of_turn_ids(im_start, tok) == (IM_START,)  # nothing else says: the tokenizer
    assert stop_token_ids(im_start).ids == ()


def test_a_generation_config_without_eos_falls_through_and_a_bad_one_is_an_error(im_start):
    from eagle3_runner.runner.errors import StageError, TargetConfigError
    from eagle3_runner.targets.load import end_of_turn_ids
    _rewrite(im_start / "generation_config.json", eos_token_id=None)
    _rewrite(im_start / "config.json", eos_token_id=[7])
    assert stop_token_ids(im_start).ids == (7,)
    _rewrite(im_start / "generation_config.json", eos_token_id="<|im_end|>")
    with pytest.raises(TargetConfigError, match="generation_config.json eos_token_id = "
                                                "'<|im_end|>': expected a token id"):
        stop_token_ids(im_start)
    with pytest.raises(StageError, match="^target.path: .*generation_config.json"):
        end_of_turn_ids(im_start, _tok(im_start))


def _gguf(path: Path, **kv) -> Path:
    """A GGUF file of header key/values only (ints as uint32, strings), no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv) + 1)
    for key, value in {"general.architecture": "llama", **kv}.items():
        k = key.encode()
        out += struct.pack("<Q", len(k)) + k
        if isinstance(value, str):
            out += struct.pack("<IQ", 8, len(value.encode())) + value.encode()
        else:
            out += struct.pack("<II", 4, value)
    path.write_bytes(out)
    return path


def test_a_gguf_without_a_converted_folder_stops_at_its_header_ids(smollm2_path, tmp_path,
                                                                   monkeypatch, im_start):
    """The header's tokenizer.ggml.eos_token_id (+ eot_token_id when different), converted or
    not, whatever the tokenizer says."""
    from eagle3_runner.targets.load import end_of_turn_ids
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "empty-cache"))  # no converted folder
    assert stop_token_ids(smollm2_path) == StopIds(
        (IM_END,), f"{smollm2_path} tokenizer.ggml.eos_token_id")
    assert end_of_turn_ids(smollm2_path, _tok(im_start)) == (IM_END,)
    assert stop_ids_note(smollm2_path) is None  # no converted tokenizer to compare yet
    both = _gguf(tmp_path / "eot.gguf", **{"tokenizer.ggml.eos_token_id": 2,
                                           "tokenizer.ggml.eot_token_id": 5})
    assert stop_token_ids(both) == StopIds(
        (2, 5), f"{both} tokenizer.ggml.eos_token_id + tokenizer.ggml.eot_token_id")
    same = _gguf(tmp_path / "same.gguf", **{"tokenizer.ggml.eos_token_id": 2,
                                            "tokenizer.ggml.eot_token_id": 2})
    assert stop_token_ids(same).ids == (2,)
    none = _gguf(tmp_path / "none.gguf")
    assert stop_token_ids(none, 9) == StopIds((9,), "the tokenizer's eos_token_id")


def test_a_gguf_whose_converted_tokenizer_says_im_start_is_warned_about(smollm2_path, tmp_path,
                                                                       monkeypatch, im_start):
    from eagle3_runner.runner.files import converted_dir
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    shutil.copytree(im_start, converted_dir(smollm2_path))
    note = stop_ids_note(smollm2_path)
    assert note is not None and "tokenizer.ggml.eos_token_id" in note
    assert "<|im_start|> (id 1" in note and "id 2 <|im_end|>" in note


# ----------------------------------------------------------------------------------------------
# validate and plan warn, without torch


def _spec_data(tmp_path: Path, target: Path, stages: dict) -> dict:
    data = tmp_path / "data.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "hi"}, '
                    '{"from": "gpt", "value": "hello"}]}\n')
    return {"name": "eot", "work_dir": str(tmp_path / "work"),
            "target": {"path": str(target), "device": "cpu", "dtype": "float32"},
            "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 2048},
            "data": {"source": "jsonl", "path": str(data)}, "stages": stages,
            "results": {"path": str(tmp_path / "r.duckdb")}}


PIPELINE = {"extract": {}, "train": {}, "export": {}, "bench": {"configs": [{"num_steps": 2}]}}


def test_validate_and_plan_warn_naming_both_eos(im_start, tmp_path):
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.plan_checks import input_problems
    from eagle3_runner.runner.spec.load import load_spec
    spec = load_spec(data=_spec_data(tmp_path, im_start, PIPELINE))
    errors, warnings = input_problems(spec)
    assert not errors
    [w] = [w for w in warnings if "eos_token" in w]
    assert w.startswith(f"target.path = {str(im_start)!r}: the tokenizer's eos_token is "
                        f"<|im_start|> (id 1, {im_start / 'tokenizer_config.json'})")
    assert f"model's end of turn is id 2 <|im_end|> ({im_start / 'generation_config.json'}" in w
    assert "every stage stops at id 2 <|im_end|>" in w
    assert w in build_plan(spec).warnings
    # no stage that generates: nothing to warn about
    quiet = load_spec(data=_spec_data(tmp_path, im_start, {"extract": {}, "train": {}}))
    assert not [w for w in input_problems(quiet)[1] if "eos_token" in w]
    # a tokenizer that agrees with the model
    _rewrite(im_start / "tokenizer_config.json", eos_token={"content": "<|im_end|>"})
    assert not [w for w in input_problems(spec)[1] if "eos_token" in w]


def test_the_cli_warns_without_importing_torch(im_start, tmp_path):
    spec = tmp_path / "eot.yaml"
    spec.write_text(json.dumps(_spec_data(tmp_path, im_start, PIPELINE)))  # YAML reads JSON
    code = ("import sys\nfrom eagle3_runner.runner.cli import main\n"
            f"assert main(['validate', {str(spec)!r}]) == 0\n"
            f"assert main(['plan', {str(spec)!r}]) == 0\n"
            "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    said = r.stdout + r.stderr
    assert said.count("warning: target.path") == 2, said  # validate, then plan
    assert "eos_token is <|im_start|> (id 1" in said and "id 2 <|im_end|>" in said


# ----------------------------------------------------------------------------------------------
# the stages stop at 2


def _ctx(spec, stage: str, out: Path, **inputs):
    from eagle3_runner.runner.stage import StageContext
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(spec=spec, stage=stage, variant="base", run_id="eot", inputs=inputs,
                        out_dir=out, db_path=out / "r.duckdb")


class Caught(Exception):
    pass


def _bench_spec(tmp_path: Path, target: Path, backend: str):
    from eagle3_runner.runner.spec.load import load_spec
    bench = {"backend": backend, "prompt_sets": ["mtbench"], "num_prompts": 2,
             "max_new_tokens": [8], "configs": [{"num_steps": 2}]}
    if backend == "sglang":
        bench["sglang"] = {"python": sys.executable}
    return load_spec(data=_spec_data(tmp_path, target, {**PIPELINE, "bench": bench}))


def test_the_bench_stops_at_the_models_end_of_turn_on_both_backends(im_start, tmp_path,
                                                                    monkeypatch):
    """backend sglang: the ids handed to the SGLang servers (stop_token_ids); embedded: the
    ids the engines stop at."""
    from eagle3_runner.jobs import bench
    from eagle3_runner.targets.sglang_bench import record
    seen = {}

    def sglang_part(ctx, export_dir, sets, stop_ids, dtype, snapshots=()):
        seen["sglang"] = tuple(stop_ids)
        raise Caught

    def embedded(ctx, export_dir, target, drafter, device, sets, stop, sgl):
        seen["embedded"] = tuple(stop)
        raise Caught
    monkeypatch.setattr(bench, "sglang_part", sglang_part)
    monkeypatch.setattr(bench, "_embedded", embedded)
    monkeypatch.setattr(bench, "load_engine_parts",
                        lambda spec, export_dir: (None, None, _tok(im_start), "cpu", None))
    for backend in ("sglang", "embedded"):
        spec = _bench_spec(tmp_path, im_start, backend)
        ctx = _ctx(spec, "bench", tmp_path / backend, export=tmp_path / "export")
        with pytest.raises(Caught):
            if backend == "sglang":
                bench.run_sglang_only(ctx, tmp_path / "export")
            else:
                bench.run(ctx)
    assert seen == {"sglang": (IM_END,), "embedded": (IM_END,)}
    row = record("mtbench", "p", 8, [1, 2, 3], 0.0, seen["sglang"], {"meta_info": {}}, 0.1)
    assert row["request"]["sampling_params"]["stop_token_ids"] == [IM_END]


def _regen_spec(tmp_path: Path, target: Path, engine: str, **params):
    from eagle3_runner.runner.spec.load import load_spec
    data = _spec_data(tmp_path, target, {"regenerate": {"max_new_tokens": 6, "batch_size": 2,
                                                        **params}, **PIPELINE})
    data["target"]["engine"] = engine
    if engine == "sglang":
        data["target"]["sglang"] = {"python": sys.executable}
    return load_spec(data=data)


def test_regenerate_through_sglang_asks_to_stop_at_the_models_end_of_turn(im_start, tmp_path,
                                                                          monkeypatch):
    """Every /generate request of the stage's SGLang path (synthetic prompts and answers) carries
    stop_token_ids with 2 and never the tokenizer's <|im_start|>."""
    from eagle3_runner.engine import sglang_generate
    from eagle3_runner.jobs import regenerate as R
    from eagle3_runner.targets import sglang_target
    from eagle3_runner.targets.sglang_target import TargetServer
    tok = _tok(im_start)
    asked = []

    def stream_call(srv, prompts, params, on_result):  # a made-up server, answered at once
        for i, (ids, p) in enumerate(zip(prompts, params)):
            asked.append(p)
            k = len(asked)
            text = f"How would I bake bread number {k} at home?" if "stop_token_ids" in p else "ok"
            out = tok.encode(text, add_special_tokens=False)[:p["max_new_tokens"] - 1] + [IM_END]
            on_result(i, out, "stop", {"prompt_tokens": len(ids)})

    @contextlib.contextmanager
    def stage_server(spec, role, cfg, log_dir):
        yield TargetServer("http://stand-in", role, info={"version": "0.5.14"}, per_call=2)
    monkeypatch.setattr(sglang_generate, "stream_call", stream_call)
    monkeypatch.setattr(sglang_target, "stage_server", stage_server)
    spec = _regen_spec(tmp_path, im_start, "sglang", synthetic_prompts=2,
                       synthetic_max_tokens=16)
    convs = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"}]]
    m, _info = R._regenerate_sglang(_ctx(spec, "regenerate", tmp_path / "out"), convs, None)
    assert m["conversations"] == 3 and m["conversations_synthetic"] == 2
    stops = [p["stop_token_ids"] for p in asked if "stop_token_ids" in p]
    warm = [p for p in asked if "stop_token_ids" not in p]
    assert len(warm) == 2  # warm_up's requests (greedy, then the synthetic sampling)
    synthetic = [s for s, p in zip(stops, [p for p in asked if "stop_token_ids" in p])
                 if p["max_new_tokens"] == 16]
    answers = [s for s, p in zip(stops, [p for p in asked if "stop_token_ids" in p])
               if p["max_new_tokens"] == 6]
    assert synthetic and all(s == [IM_END] for s in synthetic)  # never <|im_start|>
    assert len(answers) == 3 and all(s == [IM_END] for s in answers)


def test_regenerate_on_the_embedded_engine_stops_at_the_models_end_of_turn(im_start, tmp_path,
                                                                           monkeypatch):
    from eagle3_runner.jobs import regenerate as R
    from eagle3_runner.models import llama
    from eagle3_runner.targets import load
    seen = {}

    def regenerate(target, tok, convs, params, max_length, out_dir, guard=None, *, stop_ids,
                   carried=None):
        seen["stop_ids"] = tuple(stop_ids)
        return {}
    monkeypatch.setattr(load, "load_target", lambda spec: (None, _tok(im_start), {}))
    monkeypatch.setattr(llama, "from_hf_model", lambda hf: None)
    monkeypatch.setattr(R, "regenerate", regenerate)
    spec = _regen_spec(tmp_path, im_start, "embedded")
    R._regenerate_embedded(_ctx(spec, "regenerate", tmp_path / "out"), [], None)
    assert seen == {"stop_ids": (IM_END,)}


def test_the_synthetic_prompts_stop_at_the_models_end_of_turn_only(im_start):
    from eagle3_runner.data.synthetic import user_turn_prefix
    from eagle3_runner.targets.load import end_of_turn_ids
    tok = _tok(im_start)
    _ids, stop = user_turn_prefix(tok, end_of_turn_ids(im_start, tok))
    assert stop == [IM_END]  # the tokenizer's eos (<|im_start|>, 1) would end every turn early
