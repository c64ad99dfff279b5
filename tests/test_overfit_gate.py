"""The overfit gate (issue 4 item 6): one test that catches capture-layer, vocab-mapping and
export bugs together, on the real SmolLM2.

Two short questions (in no bench set: the contamination guard drops bench prompts from
training data); the target's own greedy answers to them become the training conversations
(so the target's argmax at every assistant position is the next token of the sample, as after a
`regenerate` stage). The real stages run in order: extract -> train (until the drafter predicts
them) -> export (which runs `runner inspect` itself) -> inspect clean against the GGUF -> the
bench engine on those same prompts. A drafter that memorised the samples must reach an accept
length (tau, bonus token included) near K+1 on them; a wrong capture layer, a d2t in absolute
ids, a dropped tensor name or a misaligned TTT target would all pull tau towards 1.
"""

import json
from pathlib import Path

import pytest
import torch

from eagle3_runner.runner.assets import ASSETS
from eagle3_runner.runner.stage import StageContext

pytestmark = pytest.mark.slow

K = 3  # TTT steps = engine num_steps; the ideal tau is K + 1
MAX_NEW = 40
N_PROMPTS = 2


def _ctx(spec, stage, inputs, out, db):
    return StageContext(spec=spec, stage=stage, variant="base", run_id="gate", inputs=inputs,
                        out_dir=Path(out), db_path=Path(db))


def _prompts() -> list[str]:
    """Two short questions (short = fast on 2 CPU cores), in no bench set."""
    return ["Name three colours of the rainbow.", "What is the capital city of France?"][:N_PROMPTS]


def test_overfit_gate(tmp_path):
    for a in ("smollm2", "mtbench", "humaneval"):
        if not ASSETS[a].path().exists():
            pytest.skip(f"asset {a} missing: run `runner fetch all` first")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    from eagle3_runner.jobs import export as export_stage
    from eagle3_runner.jobs import extract as extract_stage
    from eagle3_runner.jobs import train as train_stage
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.engine.speculative import Engine
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.targets.load import end_of_turn_ids, load_target
    from eagle3_runner.runner.inspect import inspect_draft
    from eagle3_runner.runner.spec.load import load_spec

    gguf = ASSETS["smollm2"].path()
    convs_path = tmp_path / "convs.jsonl"
    data = {"name": "gate",
            "target": {"path": str(gguf), "device": "cpu", "dtype": "float32",
                       "chat_template": "chatml"},
            "drafter": {"draft_vocab_size": 256},
            "data": {"source": "jsonl", "path": str(convs_path), "max_length": 256},
            "stages": {"extract": {"batch_tokens": 1024},
                       "train": {"ttt_steps": K, "batch_size": N_PROMPTS, "lr": 5e-3,
                                 "warmup_steps": 5, "epochs": 1000, "max_steps": 60,
                                 "eval_every": 40, "eval_samples": 0, "checkpoint_every": 1000,
                                 "grad_clip": 1.0},
                       "export": {}}}
    spec = load_spec(data=data)
    hf, tok, _ = load_target(spec)
    target = from_hf_model(hf, aux_ids=spec.aux_ids)
    stop = end_of_turn_ids(spec, tok)

    # the target's own greedy answers (what a regenerate stage produces)
    prompts, answers, base_out = [], [], []
    base = Engine(target, None, num_steps=K, max_seq=512)
    for q in _prompts():
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out, _ = base.generate_baseline(ids, MAX_NEW, stop_ids=stop)
        prompts.append(ids)
        base_out.append(out)
        answers.append(tok.decode([t for t in out if t not in stop]))
    convs_path.write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": q}, {"from": "gpt", "value": a}]}) + "\n"
        for q, a in zip(_prompts(), answers)))

    db = tmp_path / "r.duckdb"
    x_dir, t_dir, e_dir = tmp_path / "extract", tmp_path / "train", tmp_path / "export"
    extract_stage.run(_ctx(spec, "extract", {}, x_dir, db))
    summary = train_stage.run(_ctx(spec, "train", {"extract": x_dir}, t_dir, db))
    assert summary[f"acc_{K - 1}"][0] > 0.9, summary  # the drafter predicts the samples
    export_stage.run(_ctx(spec, "export", {"extract": x_dir, "train": t_dir}, e_dir, db))

    findings = inspect_draft(e_dir, target=gguf)
    assert not [f for f in findings if f.severity == "error"], findings
    assert not findings, findings  # clean: not even warnings

    drafter = load_exported(e_dir, hf.get_input_embeddings().weight.detach())
    eng = Engine(target, drafter, num_steps=K, max_seq=512)
    rounds = accepted = 0
    for ids, ref in zip(prompts, base_out):
        out, st = eng.generate(ids, MAX_NEW, stop_ids=stop)
        assert out == ref  # greedy speculative decoding is lossless
        rounds += st.rounds
        accepted += sum(st.accepted)
    tau = (accepted + rounds) / rounds
    print(f"overfit gate: tau = {tau:.2f} over {rounds} verify passes (ideal {K + 1})")
    assert tau >= K + 1 - 0.5, f"accept length {tau:.2f}, expected near {K + 1}"

    # negative control: the seed deployment's bug (d2t holding absolute ids) must be caught by
    # inspect AND collapse tau in the engine
    import shutil
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(e_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["d2t"] = sd["d2t"] + torch.arange(sd["d2t"].numel())
    save_file(sd, str(bad / "model.safetensors"))
    assert [f for f in inspect_draft(bad, target=gguf) if f.severity == "error"]
    eng = Engine(target, load_exported(bad, hf.get_input_embeddings().weight.detach()),
                 num_steps=K, max_seq=512)
    _, st = eng.generate(prompts[0], MAX_NEW, stop_ids=stop)
    assert st.tau < 2.0, f"absolute-id d2t still gave tau {st.tau:.2f}"
