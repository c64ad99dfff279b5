"""Spec validation: every rejection of issue 2 names the field path, the value and why.

The target geometry is declared (and target.path points nowhere) unless a test is about reading
the model's own config, so these tests need no weights and never import torch."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_runner.runner.drafts.checks import default_aux_ids
from eagle3_runner.runner.errors import SpecError
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.stages import STAGE_ORDER

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))

# A valid spec shaped like SmolLM2-135M (L=30, H=576, V=49152) with declared geometry.
BASE = {
    "name": "t",
    "target": {"path": "/nonexistent/model.gguf", "num_hidden_layers": 30, "hidden_size": 576,
               "vocab_size": 49152, "max_position_embeddings": 8192},
    "drafter": {"algorithm": "EAGLE3", "aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
    "stages": {"bench": {"configs": [{"num_steps": 3}]}},
}


def spec_dict(**sections) -> dict:
    d = copy.deepcopy(BASE)
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k].update(v)
        else:
            d[k] = v
    return d


def problems(data=None, overrides=(), path=None) -> list[tuple[str, str]]:
    """The (field, message) pairs of a spec that must fail."""
    with pytest.raises(SpecError) as ei:
        load_spec(path, overrides=list(overrides), data=None if path else (data or spec_dict()))
    assert ei.value.problems, "SpecError without problems"
    return ei.value.problems


def one(field: str, probs) -> str:
    """The message of the single problem at `field` (fails if the field is not named)."""
    hits = [m for f, m in probs if f == field]
    assert hits, f"no problem names {field!r}: {probs}"
    return hits[0]


def test_base_is_valid():
    s = load_spec(data=spec_dict())
    assert s.aux_ids == [1, 14, 26]
    assert s.feature_width == 3 * 576
    assert s.draft_hidden == 576


# -- algorithm --------------------------------------------------------------------------------


@pytest.mark.parametrize("alg", ["EAGLE", "eagle3", "Eagle3", "EAGLE-3", "EAGLE3 ", "NEXTN"])
def test_algorithm_must_be_exactly_eagle3(alg):
    msg = one("drafter.algorithm", problems(spec_dict(drafter={"algorithm": alg})))
    assert repr(alg) in msg  # the value
    assert "'EAGLE3'" in msg  # what is expected
    assert "is_eagle3()" in msg and "aux hidden states" in msg  # why


# -- aux layer ids ----------------------------------------------------------------------------


def test_aux_ids_last_capturable_is_L_minus_2():
    # SGLang captures id k at the input of layer k+1 inside `for i in range(L)`: k <= L-2.
    assert load_spec(data=spec_dict(drafter={"aux_layer_ids": [0, 14, 28]})).aux_ids == [0, 14, 28]
    msg = one("drafter.aux_layer_ids", problems(spec_dict(drafter={"aux_layer_ids": [1, 14, 29]})))
    assert "[29]" in msg and "30-layer" in msg and "0..28" in msg
    assert "input of layer k+1" in msg and "subtract 1" in msg


def test_aux_ids_hf_index_form_of_last_layer_rejected():
    # HF hidden_states index L (= the final output) is off by one in eagle_config terms
    msg = one("drafter.aux_layer_ids", problems(spec_dict(drafter={"aux_layer_ids": [2, 15, 30]})))
    assert "[30]" in msg


@pytest.mark.parametrize("ids", [[-1, 1, 26]])
def test_aux_ids_negative_rejected(ids):
    assert "[-1]" in one("drafter.aux_layer_ids",
                         problems(spec_dict(drafter={"aux_layer_ids": ids})))


@pytest.mark.parametrize("ids,why", [([14, 1, 26], "ascending"), ([1, 1, 26], "distinct"),
                                     ([1, 26], "3 distinct"), ([1, 5, 14, 26], "3 distinct")])
def test_aux_ids_shape_rejected(ids, why):
    msg = one("drafter.aux_layer_ids", problems(spec_dict(drafter={"aux_layer_ids": ids})))
    assert str(ids) in msg and why in msg


@pytest.mark.parametrize("bad", [1.5, "1", True])
def test_aux_ids_must_be_integers(bad):
    probs = problems(spec_dict(drafter={"aux_layer_ids": [bad, 14, 26]}))
    assert any(f.startswith("drafter.aux_layer_ids") for f, _ in probs), probs


def test_default_aux_ids_only_when_capturable():
    assert default_aux_ids(30) == [1, 14, 26]
    d = spec_dict()
    del d["drafter"]["aux_layer_ids"]
    assert load_spec(data=d).aux_ids == [1, 14, 26]
    d["target"]["num_hidden_layers"] = 4  # default would be [1, 1, 0]
    msg = one("drafter.aux_layer_ids", problems(d))
    assert "[1, 1, 0]" in msg


# -- widths and geometry ----------------------------------------------------------------------


def test_fc_width_all_layers_concatenated_rejected():
    probs = problems(spec_dict(drafter={"fc_in_features": 31 * 576}))
    msg = one("drafter.fc_in_features", probs)
    assert "17856" in msg and "3 x 576 = 1728" in msg
    assert load_spec(data=spec_dict(drafter={"fc_in_features": 1728})).feature_width == 1728


def test_draft_hidden_differs_needs_target_hidden_size():
    msg = one("drafter.hidden_size", problems(spec_dict(drafter={"hidden_size": 512})))
    assert "512" in msg and "576" in msg and "target_hidden_size" in msg
    ok = load_spec(data=spec_dict(drafter={"hidden_size": 512, "target_hidden_size": 576}))
    assert ok.draft_hidden == 512 and ok.feature_width == 1728
    msg = one("drafter.target_hidden_size",
              problems(spec_dict(drafter={"hidden_size": 512, "target_hidden_size": 640})))
    assert "640" in msg and "576" in msg


def test_draft_vocab_missing_null_or_too_large():
    d = spec_dict()
    del d["drafter"]["draft_vocab_size"]
    msg = one("drafter.draft_vocab_size", problems(d))
    assert "missing" in msg and "lm_head" in msg
    msg = one("drafter.draft_vocab_size", problems(spec_dict(drafter={"draft_vocab_size": None})))
    assert "null" in msg and "lm_head" in msg
    msg = one("drafter.draft_vocab_size", problems(spec_dict(drafter={"draft_vocab_size": 50000})))
    assert "50000" in msg and "49152" in msg
    assert load_spec(data=spec_dict(drafter={"draft_vocab_size": 49152}))


def test_heads_times_head_dim_vs_projections():
    dr = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    load_spec(data=spec_dict(drafter={**dr, "q_proj_out_features": 576, "kv_proj_out_features": 192}))
    msg = one("drafter.head_dim", problems(spec_dict(drafter={**dr, "q_proj_out_features": 1152})))
    assert "9 x 64 = 576" in msg and "1152" in msg and "head_dim = 128" in msg
    msg = one("drafter.head_dim", problems(spec_dict(drafter={**dr, "kv_proj_out_features": 256})))
    assert "192" in msg and "256" in msg
    # a declared projection without the geometry to check it against is an error, not a pass
    for proj in ("q_proj_out_features", "kv_proj_out_features"):
        probs = problems(spec_dict(drafter={proj: 576}))
        assert "head_dim" in one(f"drafter.{proj}", probs)
    msg = one("drafter.num_key_value_heads",
              problems(spec_dict(drafter={"num_attention_heads": 9, "num_key_value_heads": 4})))
    assert "divide" in msg


# -- speculative parameters -------------------------------------------------------------------


def bench_cfg(**cfg):
    return spec_dict(stages={"bench": {"configs": [{"num_steps": 3}, cfg]}})


def test_topk1_num_draft_tokens_must_be_steps_plus_1():
    assert load_spec(data=bench_cfg(num_steps=3, eagle_topk=1, num_draft_tokens=4))
    msg = one("stages.bench.configs.1.num_draft_tokens",
              problems(bench_cfg(num_steps=3, eagle_topk=1, num_draft_tokens=6)))
    assert "6" in msg and "num_steps+1 = 4" in msg and "silently overrides" in msg


def test_num_draft_tokens_bounded_by_tree_size():
    # SGLang's bound, 1 + topk + (steps - 1) * topk^2 (eagle_utils.py), not steps * topk + 1
    assert load_spec(data=bench_cfg(num_steps=3, eagle_topk=2, num_draft_tokens=11))
    assert load_spec(data=bench_cfg(num_steps=3, eagle_topk=4, num_draft_tokens=16))
    msg = one("stages.bench.configs.1.num_draft_tokens",
              problems(bench_cfg(num_steps=3, eagle_topk=2, num_draft_tokens=12)))
    assert "= 11" in msg and "1 + topk + (num_steps - 1) x topk^2" in msg
    assert "required" in one("stages.bench.configs.1.num_draft_tokens",
                             problems(bench_cfg(num_steps=3, eagle_topk=2)))


def test_draft_context_shorter_than_serving_context():
    msg = one("drafter.max_position_embeddings",
              problems(spec_dict(drafter={"max_position_embeddings": 4096})))
    assert "4096" in msg and "8192" in msg
    d = spec_dict(stages={"bench": {"context_length": 16384}})
    msg = one("drafter.max_position_embeddings", problems(d))
    assert "16384" in msg
    d["drafter"]["max_position_embeddings"] = 16384
    assert load_spec(data=d)


def test_samples_longer_than_the_targets_context():
    """data.max_length past target.max_position_embeddings (100000 against 8192) is refused."""
    msg = one("data.max_length", problems(spec_dict(data={"source": "sharegpt",
                                                          "max_length": 100000})))
    assert "100000" in msg and "at most 8192" in msg
    assert load_spec(data=spec_dict(data={"source": "sharegpt", "max_length": 8192}))


def test_max_length_left_out_fits_a_short_target_and_survives_the_round_trip():
    """A 512-token target with data.max_length left out trains on 512-token samples (not the
    2048 default, refused), and the spec re-validates from its JSON as runner/job.py does (CI of
    2026-12-04: every train stage of a 512-token test target failed there)."""
    short = spec_dict(target={"max_position_embeddings": 512}, data={"source": "sharegpt"})
    s = load_spec(data=short)
    assert s.data.max_length == 512
    assert Spec.model_validate_json(s.model_dump_json()).data.max_length == 512
    msg = one("data.max_length", problems({**short, "data": {"source": "sharegpt",
                                                            "max_length": 2048}}))
    assert "at most 512" in msg


# -- unknown keys -----------------------------------------------------------------------------


@pytest.mark.parametrize("data,field,suggest", [
    ({"nmae": "x"}, "nmae", "name"),
    ({"drafter": {"draft_vocab": 32000}}, "drafter.draft_vocab", "draft_vocab_size"),
    ({"drafter": {"algoritm": "EAGLE3"}}, "drafter.algoritm", "algorithm"),
    ({"stages": {"train": {"ttt_step": 7}}}, "stages.train.ttt_step", "ttt_steps"),
    ({"stages": {"bench": {"configs": [{"num_steps": 3, "eagle_top_k": 1}]}}},
     "stages.bench.configs.0.eagle_top_k", "eagle_topk"),
    ({"stages": {"bench": {"sglang": {"prot": 30000}}}}, "stages.bench.sglang.prot", "port"),
    ({"executor": {"kind": "slurm", "partiton": "gpu"}}, "executor.partiton", "partition"),
    ({"executor": {"kind": "slurm", "gpus_per_nod": 8}}, "executor.gpus_per_nod", "gpus_per_node"),
    ({"executor": {"kind": "slurm", "stages": {"bench": {"timeout": 9}}}},
     "executor.stages.bench.timeout", "timeout_min"),
    ({"target": {"hidden": 576}}, "target.hidden", "hidden_size"),
])
def test_unknown_keys_did_you_mean(data, field, suggest):
    d = spec_dict()
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    msg = one(field, problems(d))
    assert f"Did you mean '{suggest}'" in msg, msg


def test_a_section_that_is_not_a_mapping_names_its_fields():
    msg = one("stages", problems(spec_dict(stages=[1, 2])))
    assert "should be a mapping of its fields: " in msg and "train" in msg and "(got [1, 2])" in msg
    assert "instance of" not in msg, msg


def test_slurm_extra_sbatch_allowlist():
    d = spec_dict(executor={"kind": "slurm", "extra_sbatch": {"uid": "0"}})
    assert "allowed" in one("executor.extra_sbatch", problems(d))


# -- YAML safety ------------------------------------------------------------------------------


def test_python_yaml_tag_is_an_error_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    spec = tmp_path / "evil.yaml"
    spec.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n"
                    "target: {path: x}\n")
    probs = problems(path=spec)
    assert probs[0][0] == str(spec) and "python" in probs[0][1]
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner.cli", "validate", str(spec)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr and str(spec) in r.stderr
    assert not marker.exists()
    # the same tag inside an override value is not executed either
    with pytest.raises(SpecError):
        load_spec(data=spec_dict(), overrides=[f"name=!!python/object/apply:os.system "
                                               f"['touch {marker}']"])
    assert not marker.exists()


def test_duplicate_keys_binary_files_and_syntax_errors(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: a\ntarget: {path: x}\ndrafter: {draft_vocab_size: 1}\n"
                 "drafter: {draft_vocab_size: 2}\n")
    msg = problems(path=p)[0][1]
    assert "duplicate key 'drafter'" in msg and "line 4" in msg
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe")
    assert "not a text file" in problems(path=p)[0][1]
    p = tmp_path / "syntax.yaml"
    p.write_text("name: a\ntarget: [1\n")
    assert "line 3" in problems(path=p)[0][1]


def test_not_a_mapping_and_missing_file(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    assert "mapping" in problems(path=p)[0][1]
    assert "cannot read" in problems(path=tmp_path / "nope.yaml")[0][1]


# -- overrides --------------------------------------------------------------------------------


def test_overrides_revalidate_the_whole_spec(tmp_path):
    p = tmp_path / "s.yaml"
    import yaml
    p.write_text(yaml.safe_dump(spec_dict()))
    assert load_spec(p, overrides=["stages.bench.configs.0.num_steps=5"]).stages.bench.configs[0] \
        .num_steps == 5
    # a field that is fine alone but breaks a cross-field rule
    msg = one("drafter.aux_layer_ids", _fail(p, ["target.num_hidden_layers=20"]))
    assert "20-layer" in msg
    assert "algorithm" in one("drafter.algorithm", _fail(p, ["drafter.algorithm=EAGLE"]))
    assert "Did you mean 'algorithm'" in one("drafter.algoritm", _fail(p, ["drafter.algoritm=x"]))
    assert _fail(p, ["drafter.draft_vocab_size=not-a-number"])[0][0] == "drafter.draft_vocab_size"
    assert _fail(p, ["no_equals_sign"])[0][0] == "no_equals_sign"
    s = load_spec(p, overrides=["drafter.aux_layer_ids=[2, 15, 27]"])
    assert s.aux_ids == [2, 15, 27]


def _fail(path, overrides):
    with pytest.raises(SpecError) as ei:
        load_spec(path, overrides=overrides)
    return ei.value.problems


def test_variants_are_validated():
    d = spec_dict(variants=[{"name": "v1", "overrides": {"drafter.aux_layer_ids": [1, 14, 29]}}])
    probs = problems(d)
    assert any("v1" in f and "aux_layer_ids" in f + m for f, m in probs), probs
    d = spec_dict(variants=[{"name": "v1", "overrides": {"results.path": "x.duckdb"}}])
    assert any("variants.v1.overrides.results.path" == f for f, _ in problems(d))


# -- target geometry vs the model's own config ------------------------------------------------


def _hf_dir(tmp_path, **over):
    cfg = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 1000,
           "max_position_embeddings": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 256}
    cfg.update(over)
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_target_geometry_read_from_hf_config(tmp_path):
    d = _hf_dir(tmp_path)
    data = {"name": "t", "target": {"path": str(d)},
            "drafter": {"aux_layer_ids": [1, 3, 6], "draft_vocab_size": 100}}
    s = load_spec(data=data)
    assert (s.num_layers, s.target.hidden_size, s.target.vocab_size) == (8, 64, 1000)
    assert s.feature_width == 192
    data["target"]["hidden_size"] = 128
    msg = one("target.hidden_size", problems(data))
    assert "declared 128" in msg and "64" in msg
    # the layer count read from config.json drives the aux id range check
    data["target"]["hidden_size"] = 64
    data["drafter"]["aux_layer_ids"] = [1, 3, 7]
    assert "0..6" in one("drafter.aux_layer_ids", problems(data))


def test_target_geometry_nested_text_config(tmp_path):
    d = tmp_path / "mm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {
        "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
        "max_position_embeddings": 262144}}))
    data = {"name": "t", "target": {"path": str(d), "num_hidden_layers": 60},
            "drafter": {"aux_layer_ids": [1, 29, 57], "draft_vocab_size": 32000}}
    assert "61" in one("target.num_hidden_layers", problems(data))


def test_target_unreadable_config_is_an_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 64)
    data = {"name": "t", "target": {"path": str(bad)}, "drafter": {"draft_vocab_size": 10}}
    assert "GGUF" in one("target.path", problems(data))
    d = tmp_path / "empty"
    d.mkdir()
    data["target"]["path"] = str(d)
    assert "config.json" in one("target.path", problems(data))


def test_target_geometry_unknown_without_config():
    d = spec_dict()
    del d["target"]["hidden_size"]
    msg = one("target.path", problems(d))  # a path that does not exist is named as such
    assert "no such file" in msg and "hidden_size" in msg and "declare" in msg.lower()
    assert "/nonexistent/model.gguf" in msg


def test_target_geometry_from_real_gguf_header(smollm2_path):
    data = {"name": "t", "target": {"path": str(smollm2_path)},
            "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096}}
    s = load_spec(data=data)
    assert (s.num_layers, s.target.hidden_size, s.target.vocab_size) == (30, 576, 49152)
    data["target"]["num_hidden_layers"] = 32
    msg = one("target.num_hidden_layers", problems(data))
    assert "declared 32" in msg and "30" in msg
    data["target"]["num_hidden_layers"] = 30
    data["target"]["vocab_size"] = 32000
    assert "49152" in one("target.vocab_size", problems(data))


# -- the example specs ------------------------------------------------------------------------


@pytest.mark.parametrize("path", SPECS, ids=[p.name for p in SPECS])
def test_every_example_spec_validates(path):
    s = load_spec(path)
    assert s.drafter.algorithm == "EAGLE3"
    assert s.drafter.draft_vocab_size is not None
    assert [x for x in STAGE_ORDER if getattr(s.stages, x) is not None]
    assert path.read_text().startswith("#"), "each example spec starts with a comment " \
                                             "giving the exact command"
    assert "runner " in path.read_text().split("\nname:")[0]


def test_drafter_v2_geometry_without_weights():
    s = load_spec(ROOT / "specs" / "drafter-v2.yaml")
    assert (s.num_layers, s.target.hidden_size, s.target.vocab_size) == (61, 7168, 163840)
    assert s.aux_ids == [1, 29, 57]
    assert s.feature_width == 21504
    assert s.drafter.draft_vocab_size == 32000
    assert s.executor.kind == "slurm" and s.executor.gpus_per_node == 8


# -- the spec reference (docs/spec-reference.md, linked from the README) -----------------------


def _all_models():
    """Every Pydantic model reachable from Spec (walked independently of the generator)."""
    import typing
    from pydantic import BaseModel
    from eagle3_runner.runner.spec.schema import Spec

    def inner(ann):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return [ann]
        return [m for a in typing.get_args(ann) for m in inner(a)]

    seen, todo = [], [Spec]
    while todo:
        m = todo.pop(0)
        if m in seen:
            continue
        seen.append(m)
        for info in m.model_fields.values():
            todo.extend(inner(info.annotation))
    return seen


def _generator():
    import importlib.util
    spec = importlib.util.spec_from_file_location("spec_reference",
                                                  ROOT / "scripts" / "spec_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spec_reference_is_up_to_date():
    doc = ROOT / "docs" / "spec-reference.md"
    assert doc.exists(), "run: python scripts/spec_reference.py"
    assert doc.read_text() == _generator().render(), \
        "docs/spec-reference.md is stale: run python scripts/spec_reference.py"


def test_spec_reference_lists_every_schema_field():
    text = (ROOT / "docs" / "spec-reference.md").read_text()
    sections = {}
    for block in text.split("\n## ")[1:]:
        title, _, body = block.partition("\n")
        sections[title.strip()] = body
    models = _all_models()
    assert len(models) >= 15
    for m in models:
        assert m.__name__ in sections, f"no section for {m.__name__}"
        for name, info in m.model_fields.items():
            assert f"| `{name}` |" in sections[m.__name__], f"{m.__name__}.{name} not listed"
            assert info.description, f"{m.__name__}.{name} has no description"


def test_readme_links_the_spec_reference():
    readme = ROOT / "README.md"
    if not readme.exists():
        pytest.skip("README.md not written yet")
    assert "spec-reference.md" in readme.read_text()


# -- hostile input (each once gave a traceback, a hang or a silently wrong spec) ---------------


def test_yaml_alias_bomb_and_recursive_alias_are_refused_fast(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines + ["name: *a9"]) + "\n")  # 9^10 strings once expanded
    assert "aliases" in one(str(bomb), problems(path=bomb))
    rec = tmp_path / "rec.yaml"
    rec.write_text("name: &a [*a]\n")
    assert "itself" in one(str(rec), problems(path=rec))
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "deep" in one(str(deep), problems(path=deep))
    # anchors as a person writes them still work
    ok = tmp_path / "ok.yaml"
    t = BASE["target"]
    ok.write_text(f"""name: t
target: {{path: x.gguf, num_hidden_layers: {t['num_hidden_layers']}, hidden_size: {t['hidden_size']},
         vocab_size: {t['vocab_size']}}}
drafter: {{aux_layer_ids: [1, 14, 26], draft_vocab_size: 4096}}
stages:
  bench: {{configs: [&c {{num_steps: 3}}]}}
variants:
  - {{name: a, overrides: {{stages.bench.configs: [*c, *c]}}}}
""")
    assert load_spec(ok).name == "t"


def test_empty_spec_and_names_that_are_paths(tmp_path):
    empty = tmp_path / "e.yaml"
    empty.write_text("")
    assert "empty" in one(str(empty), problems(path=empty))
    for bad in ("..", ".", "a/b", "a b", ".hidden"):
        assert "letters, digits" in one("name", problems(spec_dict(name=bad))), bad
    d = spec_dict(variants=[{"name": "..", "overrides": {}}])
    assert any(f.startswith("variants.0.name") for f, _ in problems(d))


def test_variant_names_unique_and_not_base():
    d = spec_dict(variants=[{"name": "a", "overrides": {}}, {"name": "a", "overrides": {}}])
    assert "'a'" in one("variants", problems(d))
    d = spec_dict(variants=[{"name": "base", "overrides": {}}])
    assert "reserved" in one("variants", problems(d))


def test_bad_override_paths_name_the_override():
    for item in ("=5", "stages..x=1", ".x=1"):
        assert "section.field=value" in one(item, problems(overrides=[item]))
    # list indices are 0, 1, ...: -1 would silently set the last id
    item = "drafter.aux_layer_ids.-1=9"
    probs = problems(overrides=["drafter.aux_layer_ids=[1,2,3]", item])
    assert "does not exist" in one("drafter.aux_layer_ids.-1", probs)
    bomb = "x=[&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1], " + ", ".join(
        f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)) + "]"
    assert "aliases" in one(bomb[:60], problems(overrides=[bomb]))


def test_jsonl_source_needs_a_path_at_validate_time():
    msg = one("data.path", problems(spec_dict(data={"source": "jsonl"})))
    assert "JSONL" in msg
    d = spec_dict(data={"source": "jsonl", "path": "x.jsonl"},
                  variants=[{"name": "v", "overrides": {"data.path": None}}])
    probs = problems(d)
    assert any(f == "variants.v" and m.startswith("data.path: required") for f, m in probs), probs


def test_huge_values_are_shown_short():
    probs = problems(spec_dict(name=["x" * 10_000]))
    assert len(one("name", probs)) < 400


@pytest.mark.parametrize("content,why", [
    (b"[1, 2]", "JSON object"), (b'{"text_config": 5}', "text_config"),
    (b"\xff\xfe{}", "not readable JSON"), (b'{"hidden_size": 5,', "not readable JSON")])
def test_target_config_json_garbage_is_a_field_error(tmp_path, content, why):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_bytes(content)
    data = {"name": "t", "target": {"path": str(d)}, "drafter": {"draft_vocab_size": 10}}
    assert why in one("target.path", problems(data))


def test_corrupt_gguf_header_is_a_field_error(tmp_path):
    import random
    rng = random.Random(0)
    for i in range(8):  # valid magic + version, then random bytes: absurd lengths and counts
        p = tmp_path / f"r{i}.gguf"
        p.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(rng.randrange(256) for _ in range(600)))
        data = {"name": "t", "target": {"path": str(p)}, "drafter": {"draft_vocab_size": 10}}
        assert "GGUF" in one("target.path", problems(data))


@pytest.mark.parametrize("executor", [{"nproc_per_node": 2}, {"kind": "cloud"}])
def test_executor_without_a_known_kind_names_the_fix(executor):
    """A spec without an executor block overridden with executor.nproc_per_node=2 (no kind), or
    an unknown kind: pydantic's 'Unable to extract tag' becomes a fix the user can type."""
    msg = one("executor.kind", problems(spec_dict(executor=executor)))
    assert "'local' or 'slurm'" in msg and "executor.kind=local" in msg


@pytest.mark.parametrize("bench,field", [
    ({"configs": []}, "stages.bench.configs"),
    ({"max_new_tokens": [0]}, "stages.bench.max_new_tokens.0"),
    ({"max_new_tokens": []}, "stages.bench.max_new_tokens"),
    ({"prompt_sets": []}, "stages.bench.prompt_sets"),
    ({"cuda_graph": []}, "stages.bench.cuda_graph"),
])
def test_bench_sweep_axes_are_never_empty_or_zero(bench, field):
    """An empty sweep axis or a 0-token answer used to validate and then fail in the bench (a
    raw ValueError) or finish with tau nan: refused at validation instead."""
    d = spec_dict()
    d["stages"] = {**d.get("stages", {}), "bench": bench}
    one(field, problems(d))


def test_sglang_curve_parallel_is_optional_and_at_least_1():
    """stages.bench.sglang.curve_parallel: null (waves of `parallel`) unless set; 0 is refused
    naming the field; the widest wave's ports are checked, naming curve_parallel when it is
    the wider one."""
    def sglang(**o):
        d = spec_dict()
        d["stages"] = {"bench": {"configs": [{"num_steps": 3}], "sglang": o}}
        return d
    assert load_spec(data=spec_dict()).stages.bench.sglang.curve_parallel is None
    o = load_spec(data=sglang(parallel=2, curve_parallel=4)).stages.bench.sglang
    assert (o.parallel, o.curve_parallel) == (2, 4)
    msg = one("stages.bench.sglang.curve_parallel", problems(sglang(curve_parallel=0)))
    assert "greater than or equal to 1" in msg
    msg = one("stages.bench.sglang.port", problems(sglang(port=55000, parallel=2,
                                                           curve_parallel=300)))
    assert "stages.bench.sglang.curve_parallel = 300" in msg and "lower curve_parallel" in msg
    msg = one("stages.bench.sglang.port", problems(sglang(port=55000, parallel=300,
                                                           curve_parallel=2)))
    assert "stages.bench.sglang.parallel = 300" in msg and "lower parallel" in msg


@pytest.mark.parametrize("field", ["parallel", "curve_parallel"])
def test_sglang_wave_no_port_fits_names_the_most_servers_not_a_negative_port(field):
    """A wave too wide for any port (port >= 1024, every HTTP port at most 55535) used to be told
    "Set port to at most -1944463": the fix names how many servers a wave may have instead."""
    d = spec_dict()
    d["stages"] = {"bench": {"configs": [{"num_steps": 3}],
                             "sglang": {"port": 30000, field: 1_000_000}}}
    msg = one("stages.bench.sglang.port", problems(d))
    assert f"stages.bench.sglang.{field} = 1000000" in msg, msg
    assert "at most -" not in msg and f"lower {field} to at most 27256" in msg, msg


def test_train_init_head_is_target_or_random():
    assert load_spec(data=spec_dict(stages={"extract": {}, "train": {}})) \
        .stages.train.init_head == "random"
    assert load_spec(data=spec_dict(stages={"extract": {}, "train": {"init_head": "target"}})) \
        .stages.train.init_head == "target"
    msg = one("stages.train.init_head",
              problems(spec_dict(stages={"extract": {}, "train": {"init_head": "zeros"}})))
    assert "target" in msg and "random" in msg, msg


def test_offline_train_needs_an_extract_stage():
    """features: offline (the default) reads extract's artifact: a spec without stages.extract
    fails at validation naming both fixes; online without extract, and offline with it, pass."""
    probs = problems(spec_dict(stages={"train": {}, "export": {}}))
    msg = next(m for f, m in probs if "stages.extract is not set" in m)
    assert "features: online" in msg and "stages.extract block" in msg
    load_spec(data=spec_dict(stages={"train": {"features": "online"}, "export": {}}))
    load_spec(data=spec_dict(stages={"extract": {}, "train": {}, "export": {}}))
