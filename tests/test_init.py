"""`runner init`: a Llama-3.1-8B-like and a Qwen3-8B-like folder (config.json + tokenizer files
built in the test, tests/chat_helpers.py) give commented specs that validate and plan; the family
defaults, the draft vocab rule, the disk estimate, and clear refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chat_helpers import make_target
from eagle3_runner.runner.cli import main
from eagle3_runner.runner.errors import InitError
from eagle3_runner.runner.drafts.server import auto_speculative_params
from eagle3_runner.runner.init import build, draft_vocab_size_for
from eagle3_runner.runner.plan import build_plan
from eagle3_runner.runner.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]


def chats(path: Path, n: int = 20) -> Path:
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
        for i in range(n)))
    return path


@pytest.mark.parametrize("family,want", [
    ("llama3.1-8b", {"aux": [1, 15, 28], "tmpl": "llama3", "vocab": 32000, "L": 32}),
    ("qwen3-8b", {"aux": [1, 17, 32], "tmpl": "qwen", "vocab": 32000, "L": 36}),
])
def test_init_writes_a_spec_that_validates_and_plans(tmp_path, monkeypatch, capsys, family, want):
    monkeypatch.chdir(tmp_path)
    target = make_target(tmp_path / family, family)
    data = chats(tmp_path / "chats.jsonl")
    assert main(["init", "--target", str(target), "--data", str(data), "--out", "s.yaml"]) == 0
    assert "wrote s.yaml" in capsys.readouterr().err
    text = (tmp_path / "s.yaml").read_text()
    assert "# " in text and "Offline features: (3 aux + 1 last) x 4096 x 2 bytes + 9 (id, " \
        "mask) = 32,777 B per token" in text  # runner/disk.py's figure, as plan prints it
    raw = yaml.safe_load(text)
    assert raw["name"] == "s"  # --out's stem: the spec's runs/ and results are its own
    assert raw["target"]["chat_template"] == want["tmpl"]
    assert raw["drafter"]["aux_layer_ids"] == want["aux"]
    from eagle3_runner.runner.init import CPU_MAX_SAMPLES
    from eagle3_runner.runner.placement import gpu_visible
    cap = {} if gpu_visible() else {"max_samples": CPU_MAX_SAMPLES}  # a CPU trains ~100 tok/s
    assert raw["data"] == {"source": "jsonl", "path": str(data), "max_length": 2048,
                           "holdout": 0, "max_bad_fraction": 0.01, **cap}
    # 20 short answers hold far fewer distinct assistant tokens than the vocabulary rule's
    # 32000: the head is sized to them, and the comment says so
    vd = raw["drafter"]["draft_vocab_size"]
    assert 10 < vd < 100 and f"= the {vd} distinct assistant tokens in the 20 conversations" in text
    assert raw["stages"]["bench"]["configs"] == [  # SGLang's auto choice, then a chain
        {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8},
        {"num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6}]
    assert raw["stages"]["train"]["features"] == "offline" and "extract" in raw["stages"]
    spec = load_spec(tmp_path / "s.yaml")
    assert spec.num_layers == want["L"]  # the rule's choice, capped by the data's tokens:
    assert draft_vocab_size_for(spec.target.vocab_size, 4096) == want["vocab"] > vd
    assert spec.feature_width == 3 * 4096
    assert raw["stages"]["bench"]["num_prompts"] == 8  # no GPU on the test machine
    sglang = raw["stages"]["bench"]["backend"] == "sglang"
    assert sglang or (family.startswith("llama") and "SGLang is not installed here" in text)
    if sglang and main(["validate", "s.yaml"]) == 1:  # SGLang missing: said before any compute
        assert "sglang is not importable" in capsys.readouterr().err
        (tmp_path / "s.yaml").write_text(text.replace("backend: sglang", "backend: embedded"))
        spec = load_spec(tmp_path / "s.yaml")
    plan = build_plan(spec)
    assert [p.stage for p in plan.stages] == ["extract", "train", "export", "bench"]
    # a tolerance is no part of a cache key: changing it reruns nothing
    looser = build_plan(load_spec(tmp_path / "s.yaml", ["data.max_bad_fraction=0.5"]))
    assert [p.key for p in looser.stages] == [p.key for p in plan.stages]
    assert main(["validate", "s.yaml"]) == 0
    assert main(["plan", "s.yaml"]) == 0
    out = capsys.readouterr()
    assert "disk: extract writes ~" in out.out and "x 32,777 B" in out.out  # plan's estimate
    # an existing output is kept unless --force
    assert main(["init", "--target", str(target), "--out", "s.yaml"]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert main(["init", "--target", str(target), "--out", "s.yaml", "--force"]) == 0


def test_init_reads_the_data_it_is_given(tmp_path, capsys):
    """The issue's first hour: a file with one malformed line of 31 and a few empty records.
    init names the malformed line and the records cleaned away, raises data.max_bad_fraction so
    that its own spec passes the first apply's check (3.23% > 1%), and sizes the draft vocab
    from the distinct assistant tokens it tokenized, saying so. A file mostly broken keeps 1%
    and gets a warning instead."""
    target = make_target(tmp_path / "llama", "llama3.1-8b")
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                      {"role": "assistant", "content": f"answer {i % 7}"}]})
             for i in range(30)]
    lines.insert(15, '{"messages": [{"role": "user", "content": "hi"},')
    lines += [json.dumps({"messages": [{"role": "user", "content": "no answer"}]})] * 2
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "s.yaml"
    assert main(["init", "--target", str(target), "--data", str(data), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "init: data: 33 records read, 30 conversations kept; unusable 1 (3.03%): malformed 1 " \
        "(first at chats.jsonl:16); cleaned away: no_assistant 2" in err
    text = out.read_text()
    raw = yaml.safe_load(text)
    assert raw["data"]["max_bad_fraction"] == 0.04 and "raised from 1%" in text
    assert raw["stages"]["train"]["eval_samples"] == 3  # a tenth of 30, not the default 8
    from eagle3_runner.data.conversations import check_bad_fraction, conversations_from_file
    _, rep = conversations_from_file(data)  # the stages' own check passes on this spec
    check_bad_fraction(rep, raw["data"]["max_bad_fraction"])
    vd = raw["drafter"]["draft_vocab_size"]
    assert f"{vd} distinct assistant tokens in the 30 conversations: draft vocab {vd}" in err
    from chat_helpers import load_tokenizer
    from eagle3_runner.data.chat import tokenize_dataset
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.runner.spec.load import load_spec as ls
    convs, _, _ = load_conversations(ls(out).data)
    samples, _ = tokenize_dataset(load_tokenizer(target), convs, "auto", 2048)
    assert vd == len({i for ids, m in samples for i, k in zip(ids, m) if k})  # exactly the stages'
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines[:5] + ["{oops"] * 3 + lines[5:6]) + "\n")
    text, facts = build(str(target), str(broken))
    assert facts["max_bad_fraction"] == 0.01 and "the first apply stops there" in text
    # and validate and plan on the spec it wrote say so too, as the stage will (issue 48)
    (tmp_path / "broken.yaml").write_text(text)
    capsys.readouterr()
    for cmd in ("validate", "plan"):
        assert main([cmd, str(tmp_path / "broken.yaml")]) == 1
        assert "error: data.max_bad_fraction = 0.01: 3 of 9 records" in capsys.readouterr().err


def test_deepseek_family_without_tokenizer(tmp_path, capsys):
    """A Kimi-K2 / DeepSeek-V3-like config: SGLang's 3/1/4 auto choice, aux [1, 29, 57], and no
    chat template found -> auto with a warning (the spec still validates)."""
    d = tmp_path / "Kimi-K2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
        "num_attention_heads": 64, "num_key_value_heads": 64, "intermediate_size": 18432,
        "max_position_embeddings": 262144}))
    assert main(["init", "--target", str(d), "--json"]) == 0
    out = capsys.readouterr()
    facts = json.loads(out.out)
    assert facts["bench"] == {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    assert facts["aux_layer_ids"] == [1, 29, 57] and facts["chat_template"] == "auto"
    assert facts["draft_vocab_size"] == 32000 and facts["estimate"]["bytes_per_token"] == 57353
    assert "no chat template found" in out.err
    raw = yaml.safe_load(facts["spec_text"])
    assert len(raw["stages"]["bench"]["configs"]) == 1
    load_spec(data=raw)


def test_two_specs_for_one_target_get_their_own_names():
    """Two init specs for one target both got '<target>-eagle3' and so shared runs/<name> and
    the run history (first-hour trial of 2026-12-04): the name comes from --out's stem, else
    from the target and the data."""
    from eagle3_runner.runner.init import spec_name
    t = Path("/m/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert spec_name(t) == "smollm2-135m-instruct.q4_1-eagle3"
    assert spec_name(Path("/m/Qwen3-8B"), Path("/d/my chats.jsonl.gz")) == "qwen3-8b-my-chats-eagle3"
    assert spec_name(t, Path("a.jsonl")) != spec_name(t, Path("b.jsonl"))
    assert spec_name(t, Path("a.jsonl"), Path("specs/support-bot.yaml")) == "support-bot"
    assert spec_name(t, None, Path("specs/...yaml")) == "smollm2-135m-instruct.q4_1-eagle3"


def test_draft_vocab_rule_and_families():
    assert draft_vocab_size_for(128256, 4096) == 32000  # Llama 3: SpecForge's 32000
    assert draft_vocab_size_for(151936, 896) == 16000  # Qwen2.5-0.5B: SpecForge's 16000
    assert draft_vocab_size_for(49152, 576) == 16000  # SmolLM2
    assert draft_vocab_size_for(32000, 4096) == 16000  # Llama 2 / Mistral-size vocabularies
    assert draft_vocab_size_for(8000, 512) == 8000  # never above the vocabulary
    chain = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
             "num_hidden_layers": 24}
    assert auto_speculative_params(chain) == (3, 1, 4)
    assert auto_speculative_params({"model_type": "deepseek2"}) == (3, 1, 4)  # a GGUF header
    # 0.5.6 server_args.py: GLM4-MoE is not in auto_choose_speculative_params's chain list
    assert auto_speculative_params({"architectures": ["Glm4MoeForCausalLM"]}) == (5, 4, 8)
    assert auto_speculative_params({"architectures": ["Qwen2ForCausalLM"]}) == (5, 4, 8)


def test_large_estimate_trains_online(tmp_path, monkeypatch):
    """Features above 200 GB (or the free space): the spec trains online, has no extract, keeps
    the offline lines as a comment, and validates and plans. On a machine with a GPU (without
    one init caps data.max_samples, and the estimate with it)."""
    monkeypatch.setattr("eagle3_runner.runner.init.gpu_visible", lambda: True)
    big = tmp_path / "big.jsonl"
    chats(big, 60_000)  # ~4 MiB of real records at the head (the estimate reads those) ...
    with open(big, "r+b") as f:  # ... then a sparse 64 GiB: ~10^9 records x 32 KiB
        f.truncate(2**36)
    text, facts = build(str(make_target(tmp_path / "l", "llama3.1-8b")), str(big))
    assert facts["estimate"]["bytes"] > 2**40 and facts["features"] == "online"
    raw = yaml.safe_load(text)
    assert raw["stages"]["train"]["features"] == "online" and "extract" not in raw["stages"]
    assert "#   extract:" in text and "train.features: offline" in text
    plan = build_plan(load_spec(data=raw))
    assert [p.stage for p in plan.stages] == ["train", "export", "bench"]
    assert plan.disk["online"] and not plan.disk["extract"]


def test_init_refuses_unreadable_targets(tmp_path):
    with pytest.raises(InitError, match="does not exist"):
        build(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InitError, match="without config.json or a .gguf"):
        build(str(tmp_path / "empty"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(InitError, match="not readable JSON"):
        build(str(bad))
    (bad / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    with pytest.raises(InitError, match="no usable num_hidden_layers, vocab_size"):
        build(str(bad))
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(InitError, match="GGUF"):
        build(str(g))
    with pytest.raises(InitError, match="--data .*does not exist"):
        build(str(make_target(tmp_path / "t", "qwen3-8b")), str(tmp_path / "no.jsonl"))
    for name, body in (("empty.jsonl", b""), ("bad.jsonl", b"not json\n"),
                       ("bad.jsonl.gz", b"\x1f\x8b\x08 corrupt")):
        (tmp_path / name).write_bytes(body)  # unreadable data: an error, not a spec comment
        with pytest.raises(InitError, match="--data "):
            build(str(tmp_path / "t"), str(tmp_path / name))


def test_init_refuses_a_bad_name_or_out_before_any_work(tmp_path):
    """--name with a space, --out a folder or in a place nobody can write: a clear error naming
    the option (not 'a bug in runner init', not a traceback)."""
    target = str(make_target(tmp_path / "q", "qwen3-8b"))
    cases = ((["--name", "my model"], "--name 'my model': a spec name is letters"),
             (["--out", str(tmp_path)], "is a folder; give the spec's file name"),
             (["--out", "/proc/no/spec.yaml"], "cannot write it"))
    for extra, want in cases:
        r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "init", "--target",
                            target, *extra], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and want in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "bug in runner init" not in r.stderr


def test_init_on_the_smollm2_gguf(smollm2_path):
    text, facts = build(str(smollm2_path))
    assert facts["chat_template"] == "chatml" and facts["aux_layer_ids"] == [1, 14, 26]
    assert facts["draft_vocab_size"] == 16000 and "tokenizer.chat_template" in text
    load_spec(data=yaml.safe_load(text))


def test_init_help_and_no_torch(tmp_path):
    target = make_target(tmp_path / "q", "qwen3-8b")
    code = ("import sys, runner.cli as c\n"
            f"assert c.main(['init', '--target', {str(target)!r}]) == 0\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'jinja2') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stderr and yaml.safe_load(r.stdout)["name"] == "q-eagle3"
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "init", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    assert "examples:" in r.stdout and "--data" in r.stdout
