"""Issue 21 item 4 and issue 23 item 4: what can be checked before a stage runs is checked by
`runner validate` / `runner plan`, and a spec's relative paths resolve against its own folder.

Every test here is a pure validate/plan call (fake stages where something is applied): no
weights, no torch, milliseconds each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_plan import fake_stages, make_spec, reasons  # noqa: F401 - fixture

from eagle3_runner.runner.apply import apply
from eagle3_runner.runner.errors import PlanError, SpecError
from eagle3_runner.runner.plan import build_plan
from eagle3_runner.runner.spec.load import load_spec

ROOT = Path(__file__).resolve().parent.parent


def _problems(data, overrides=()) -> dict:
    with pytest.raises(SpecError) as ei:
        load_spec(data=data, overrides=list(overrides))
    return dict(ei.value.problems)


def _hf_target(tmp: Path, **over) -> Path:
    """An HF folder shaped like SmolLM2-135M (9 heads, 3 kv heads) without weights."""
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
           "max_position_embeddings": 8192, **over}
    d = tmp / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _spec(tmp: Path, **over) -> dict:
    return {"name": "c", "target": {"path": str(_hf_target(tmp))},
            "drafter": {"draft_vocab_size": 4096}, "stages": {"extract": {}, "train": {}}, **over}


# -- the draft geometry against the target's defaults -------------------------------------------


@pytest.mark.parametrize("drafter, field, words", [
    ({"num_key_value_heads": 7}, "drafter.num_key_value_heads", ["7", "9", "1, 3, 9"]),
    ({"num_attention_heads": 8}, "drafter.num_key_value_heads", ["3", "8"]),  # kv from target
    ({"head_dim": 63}, "drafter.head_dim", ["63", "even"]),
    ({"num_attention_heads": 7}, "drafter.head_dim", ["576", "7"]),  # no head_dim to fall back on
    ({"num_attention_heads": 3}, None, []),  # head_dim 576 / 3 = 192, 3 kv heads divide 3
])
def test_draft_geometry_is_checked_against_the_target_defaults(tmp_path, drafter, field, words):
    d = _spec(tmp_path)
    d["drafter"].update(drafter)
    if field is None:
        load_spec(data=d)
        return
    msg = _problems(d).get(field) or next(m for f, m in _problems(d).items() if field in m)
    assert all(w in msg for w in words), msg


def test_unknown_geometry_and_undividable_hidden_are_named(tmp_path):
    d = _spec(tmp_path)
    (Path(d["target"]["path"]) / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
         "num_attention_heads": 7}))  # no head_dim, no intermediate_size; 576 % 7 != 0
    probs = _problems(d)
    assert "declare drafter.intermediate_size" in probs["drafter.intermediate_size"]
    assert "drafter.head_dim" in probs["drafter.head_dim"] or "head_dim" in probs["drafter.head_dim"]


def test_a_variant_with_bad_geometry_is_named(tmp_path):
    d = _spec(tmp_path, variants=[{"name": "kv7", "overrides": {"drafter.num_key_value_heads": 7}}])
    assert any(f.startswith("variants.kv7") for f in _problems(d))


# -- names, environment variables ---------------------------------------------------------------


def test_a_long_name_is_a_validation_error_not_file_name_too_long(tmp_path):
    name = "a" * 300
    assert "at most 100" in _problems(_spec(tmp_path, name=name))["name"]
    assert "at most 64" in _problems(_spec(tmp_path, variants=[
        {"name": "v" * 80, "overrides": {"stages.train.lr": 1e-3}}]))["variants.0.name"]
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({**_spec(tmp_path), "name": name}))
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "plan", str(spec)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "error: name" in r.stderr


def test_environment_variables_expand_like_a_shell(tmp_path, monkeypatch):
    monkeypatch.setenv("USER", "alice")
    monkeypatch.delenv("USERNAME", raising=False)
    monkeypatch.delenv("NOPE_UNSET", raising=False)
    monkeypatch.setenv("EAGLE3_TEST_DIR", str(tmp_path))
    ok = load_spec(data=_spec(tmp_path, work_dir="$EAGLE3_TEST_DIR/${USER}/$USER-w"))
    assert str(ok.resolved_work_dir()) == f"{tmp_path}/alice/alice-w"
    # ${USERNAME} is USERNAME, never ${USER} + "NAME"; unset = an error naming it
    probs = _problems(_spec(tmp_path, work_dir="/x/${USERNAME}"))
    assert "USERNAME is not set" in probs["work_dir"]
    for field, over in (("results.path", {"results": {"path": "$NOPE_UNSET/r.duckdb"}}),
                        ("data.path", {"data": {"source": "jsonl", "path": "${NOPE_UNSET}"}}),
                        ("target.path", {"target": {"path": "/m/$NOPE_UNSET",
                                                    "num_hidden_layers": 30,
                                                    "hidden_size": 576, "vocab_size": 49152}}),
                        ("work_dir", {"work_dir": "/x/${unclosed"})):
        msg = _problems(_spec(tmp_path, **over))[field]
        assert "NOPE_UNSET" in msg or "unclosed" in msg, msg
    # $EAGLE3_CACHE has a default; a lone $ stays
    monkeypatch.delenv("EAGLE3_CACHE", raising=False)
    s = load_spec(data=_spec(tmp_path, work_dir="${EAGLE3_CACHE}/w$"))
    assert str(s.resolved_work_dir()).endswith("/.cache/eagle3-runner/w$")


# -- the bench servers' guarded flags and host --------------------------------------------------


@pytest.mark.parametrize("arg", [
    "--speculative-algorithm", "--speculative-algorithm=EAGLE", "--speculative_algorithm",
    "--speculative-algo", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens", "--speculative-draft-model-path", "--model-path",
    "--model", "--host", "--port=1", "--tp", "--tp-size", "--context-length",
    "--disable-cuda-graph", "--cuda-graph-max-bs"])
def test_extra_args_may_not_override_the_flags_the_runner_sets(tmp_path, arg):
    d = _spec(tmp_path, stages={"bench": {"backend": "sglang",
                                          "sglang": {"extra_args": [arg, "x"]}}})
    msg = _problems(d)["stages.bench.sglang.extra_args"]
    assert repr(arg) in msg and "instead" in msg


def test_harmless_extra_args_pass(tmp_path):
    load_spec(data=_spec(tmp_path, stages={"bench": {"sglang": {"extra_args": [
        "--max-total-tokens", "16384", "--disable-cuda-graph-padding", "--log-level=info"]}}}))


@pytest.mark.parametrize("host, ok", [("0.0.0.0", False), ("10.1.2.3", False), ("::", False),
                                      ("example.org", False), ("127.0.0.1", True),
                                      ("127.0.0.2", True), ("::1", True), ("localhost", True)])
def test_sglang_host_is_loopback_only(tmp_path, host, ok):
    d = _spec(tmp_path, stages={"bench": {"sglang": {"host": host}}})
    if ok:
        load_spec(data=d)
    else:
        assert "loopback only" in _problems(d)["stages.bench.sglang.host"]


# -- plan: input paths, the results file, num_samples -------------------------------------------


def test_missing_inputs_fail_the_plan_naming_the_field(tmp_path):
    with pytest.raises(PlanError, match=r"data.path = .*does not exist \(extract reads it\)"):
        build_plan(make_spec(tmp_path, ["data.path=" + str(tmp_path / "none.jsonl")]))
    with pytest.raises(PlanError, match=r"target.path = .*does not exist"):
        build_plan(make_spec(tmp_path, ["target.path=" + str(tmp_path / "none.gguf")]))
    # on Slurm the path may exist on the compute nodes only: a warning, not an error
    plan = build_plan(make_spec(tmp_path, ["target.path=" + str(tmp_path / "none.gguf"),
                                           "executor.kind=slurm"]))
    assert any("none.gguf" in w for w in plan.warnings)


def test_a_missing_target_names_the_path_it_looked_at(tmp_path, monkeypatch):
    """A target.path through ${EAGLE3_CACHE} that is not there: the error shows the path as
    written and as expanded (an empty or wrong EAGLE3_CACHE is then plain to see)."""
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpecError) as ei:
        load_spec(data={"name": "x", "target": {"path": "${EAGLE3_CACHE}/none.gguf"},
                        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
                        "data": {"source": "jsonl", "path": str(tmp_path / "d.jsonl")}})
    assert f"'${{EAGLE3_CACHE}}/none.gguf' (= {tmp_path / 'cache' / 'none.gguf'}): no such " \
        "file or folder" in str(ei.value)


def test_a_results_file_that_is_not_duckdb_fails_the_plan(tmp_path):
    (tmp_path / "r.duckdb").write_text("not a database\n" * 10)
    with pytest.raises(PlanError, match="results.path: .* not a DuckDB file"):
        build_plan(make_spec(tmp_path))


def test_long_paths_are_refused_before_any_file_is_looked_at(tmp_path):
    with pytest.raises(SpecError, match="work_dir = .*at most 255"):
        make_spec(tmp_path, ["work_dir=" + str(tmp_path / ("w" * 300))])
    with pytest.raises(SpecError, match="data.path = .*at most 255"):
        make_spec(tmp_path, ["data.path=" + str(tmp_path / ("d" * 300))])
    deep = str(tmp_path / "/".join(["d" * 200] * 20))  # each part fine, the whole too long
    with pytest.raises(PlanError, match="work_dir = .*at most 3800"):
        build_plan(make_spec(tmp_path, ["work_dir=" + deep]))


def test_num_samples_above_the_extract_is_refused(tmp_path, fake_stages):
    import test_plan

    def extract(ctx):
        test_plan._fake_run(ctx)
        return {"samples": 20}

    fake_stages.setattr(sys.modules["eagle3_runner.jobs.extract"], "run", extract)
    # first apply: the extract is not there at plan time; train refuses before it runs
    spec = make_spec(tmp_path, ["stages.train.num_samples=50", "stages.train.eval_samples=4"])
    _, outcomes = apply(spec, build_plan(spec), quiet=True)
    by = {o.job.stage: o for o in outcomes}
    assert by["extract"].status == "done" and by["train"].status == "failed"
    assert "stages.train.num_samples = 50" in by["train"].error and "16 are available" in \
        by["train"].error
    # later plans know the extract: the plan itself refuses, naming the count
    with pytest.raises(PlanError, match="16 are available"):
        build_plan(spec)
    ok = make_spec(tmp_path, ["stages.train.num_samples=16", "stages.train.eval_samples=4"])
    assert reasons(build_plan(ok))["train"][0] == "run"


def _gz_data(tmp_path: Path, n: int) -> Path:
    """A real gzip JSONL file of n distinct usable conversations."""
    import gzip
    f = tmp_path / "convs.jsonl.gz"
    f.write_bytes(gzip.compress("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": f"answer {i}"}]})
        + "\n" for i in range(n)).encode()))
    return f


def _schedule_warnings(spec) -> list[str]:
    from eagle3_runner.runner.plan_checks import input_problems
    errors, warns = input_problems(spec)  # runner validate
    assert errors == []
    return [w for w in warns if w.startswith(("stages.train.batch_size",
                                              "stages.train.warmup_steps"))]


def test_a_batch_above_the_training_samples_and_a_warmup_past_the_steps_are_warned(
        tmp_path, fake_stages):
    """20 conversations, data.holdout 2, train.eval_samples 4: at most 14 samples train. A
    batch_size above them (each epoch one step of fewer samples) and warmup_steps at or above
    the optimizer steps (the learning rate never leaves its warm-up) are warned about by
    validate and plan with the numbers and the fix: before the run as an upper bound from the
    data's count, once the extract is there from its own count (the num_samples rule's)."""
    import test_plan
    data = _gz_data(tmp_path, 20)
    base = [f"data.path={data}", "data.holdout=2", "stages.train.eval_samples=4",
            "stages.train.warmup_steps=2", "stages.train.epochs=2"]
    fine = make_spec(tmp_path, base + ["stages.train.batch_size=4"])  # 2 x 4 = 8 steps
    assert _schedule_warnings(fine) == [] and _plan_train_warnings(fine) == []
    spec = make_spec(tmp_path, base + ["stages.train.batch_size=100",
                                       "stages.train.warmup_steps=1000"])
    bs, wu = _schedule_warnings(spec)
    assert bs.startswith("stages.train.batch_size = 100: the train stage trains on at most 14 "
                         "samples (the data gives 18 training conversations after "
                         "data.holdout"), bs
    assert "each epoch is one optimizer step of at most 14 samples, not 100" in bs
    assert "Set batch_size <= 14" in bs
    assert wu.startswith("stages.train.warmup_steps = 1000: the train stage takes at most 2 "
                         "optimizer steps (at most 14 samples, batch_size 100, epochs 2)"), wu
    assert "never leaves its warm-up" in wu and "Set warmup_steps below 2" in wu
    assert _plan_train_warnings(spec) == [bs, wu]

    def extract(ctx):  # the extract keeps 10 of the 18 conversations (tokenizer drops)
        test_plan._fake_run(ctx)
        return {"samples": 10}
    fake_stages.setattr(sys.modules["eagle3_runner.jobs.extract"], "run", extract)
    apply(spec, build_plan(spec, only=("extract",)), quiet=True)
    warned = _plan_train_warnings(spec)
    assert warned == [
        "stages.train.batch_size = 100: the train stage trains on 6 samples (the extract holds "
        "10 samples, less train.eval_samples = 4), so each epoch is one optimizer step of 6 "
        "samples, not 100. Set batch_size <= 6, or train on more data (data.max_samples).",
        "stages.train.warmup_steps = 1000: the train stage takes 2 optimizer steps (6 samples, "
        "batch_size 100, epochs 2), so the learning rate never leaves its warm-up: it ends at "
        "0.2% of stages.train.lr. Set warmup_steps below 2 (e.g. 1)."], warned
    # the warm-up alone, on the exact count: 6 samples / batch 2 x 2 epochs = 6 steps
    w6 = make_spec(tmp_path, base + ["stages.train.batch_size=2", "stages.train.warmup_steps=6"])
    (w,) = _plan_train_warnings(w6)
    assert w.startswith("stages.train.warmup_steps = 6: the train stage takes 6 optimizer steps "
                        "(6 samples, batch_size 2, epochs 2)"), w
    w5 = make_spec(tmp_path, base + ["stages.train.batch_size=2", "stages.train.warmup_steps=5"])
    assert _plan_train_warnings(w5) == []


def _plan_train_warnings(spec) -> list[str]:
    return [w for w in build_plan(spec).warnings if w.startswith("stages.train.")]


def test_the_schedule_is_not_warned_about_when_the_count_is_unknown(tmp_path, monkeypatch):
    """No count before the run, nothing said: a data file too big to count, or a regenerate
    stage's output."""
    import eagle3_runner.data.conversations as conversations
    data = _gz_data(tmp_path, 20)
    over = [f"data.path={data}", "data.holdout=2", "stages.train.batch_size=100"]
    assert _schedule_warnings(make_spec(tmp_path, over))  # counted: said
    monkeypatch.setattr(conversations, "COUNT_MAX_BYTES", 10)
    assert _schedule_warnings(make_spec(tmp_path, over)) == []
    monkeypatch.undo()
    regen = make_spec(tmp_path, over + ["stages.regenerate={}"])
    assert regen.stages.regenerate is not None and _schedule_warnings(regen) == []
    assert _plan_train_warnings(regen) == []


# -- paths relative to the spec file (issue 23 item 4) ------------------------------------------


def _spec_file(tmp_path) -> Path:
    d = tmp_path / "project" / "specs"
    d.mkdir(parents=True)
    _hf_target(d.parent)  # project/hf
    (d.parent / "data.jsonl").write_text(
        '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    spec = {"name": "rel", "work_dir": "../runs/${name}", "target": {"path": "../hf"},
            "drafter": {"draft_vocab_size": 4096},
            "data": {"source": "jsonl", "path": "../data.jsonl"},
            "stages": {"extract": {}, "train": {}},
            "results": {"path": "../runs/results.duckdb"},
            "variants": [{"name": "v", "overrides": {"data.path": "../data.jsonl",
                                                     "stages.train.lr": 1e-3}}]}
    (d / "s.yaml").write_text(yaml.safe_dump(spec))
    return d / "s.yaml"


def test_relative_paths_resolve_against_the_spec_file_from_any_cwd(tmp_path):
    spec = _spec_file(tmp_path)
    project = spec.parent.parent
    outs = []
    for cwd in (ROOT, tmp_path, spec.parent):
        r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "plan", str(spec),
                            "--json"], cwd=cwd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        plan = json.loads(r.stdout)
        plan["disk"].pop("free_bytes")  # a reading of the machine (others write to the disk)
        outs.append(plan)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0]["work_dir"] == str(project / "runs" / "rel")
    assert outs[0]["results"] == str(project / "runs" / "results.duckdb")
    s = load_spec(spec)
    assert s.target.path == str(project / "hf") and s.data.path == str(project / "data.jsonl")
    assert s.variants[0].overrides["data.path"] == str(project / "data.jsonl")
    # -o overrides are part of the spec: relative to its file too; absolute paths, ~ and
    # ${EAGLE3_CACHE} stay as written
    s = load_spec(spec, overrides=["data.path=other.jsonl", "results.path=/abs/r.duckdb",
                                   "work_dir=${EAGLE3_CACHE}/w"])
    assert s.data.path == str(spec.parent / "other.jsonl")
    assert s.results.path == "/abs/r.duckdb" and s.work_dir == "${EAGLE3_CACHE}/w"
    # the defaults of work_dir and results.path are relative to the spec file as well
    bare = yaml.safe_load(spec.read_text())
    del bare["work_dir"], bare["results"]
    spec.write_text(yaml.safe_dump(bare))
    s = load_spec(spec)
    assert s.resolved_work_dir() == spec.parent / "runs" / "rel"
    assert s.results.path == str(spec.parent / "runs" / "results.duckdb")


def test_every_flag_the_runner_gives_sglang_is_guarded():
    """runner/spec/server.py GUARDED_FLAGS must list what targets/sglang.py server_argv sets."""
    from eagle3_runner.targets.sglang import server_argv
    from eagle3_runner.runner.spec.server import GUARDED_FLAGS
    argv = server_argv("python3", "/m", 30000, "127.0.0.1", 1, "/d", 3, 1, 4, True, 8, 4096,
                       dtype="bfloat16", mem_fraction_static=0.1, nccl_port=30001)
    argv += server_argv("python3", "/m", 30000, cuda_graph=False)
    assert {a for a in argv if a.startswith("--")} <= set(GUARDED_FLAGS)
