"""The simulated greedy chains (trainer/acceptance.py) against the embedded engine's own rounds,
and the train stage's snapshots and tau selection (CPU)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3_runner.trainer import acceptance as A
from eagle3_runner.trainer.checkpoint import snapshot_path
from eagle3_runner.trainer.recipe import train
from eagle3_runner.runner.errors import SpecError
from train_helpers import tiny_extract, train_ctx, train_spec

torch.set_num_threads(2)


def test_chain_lengths_count_the_leading_hits():
    hit = torch.tensor([[[1, 1, 0, 1]], [[1, 0, 1, 1]], [[0, 1, 1, 1]]], dtype=torch.bool)
    assert A.chain_lengths(hit).tolist() == [[2, 1, 0, 3]]


def test_rounds_walk_accepts_then_jumps_past_the_bonus_token():
    # one turn over columns 1..9 (column 1: the prefill's token; rounds start at column 2)
    sup0 = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=bool)
    L = np.array([0, 9, 2, 9, 9, 0, 3, 9, 1, 9, 9, 9])
    # column 2 accepts 2 -> next round at 5 (accepts 0) -> 6 accepts 3 (of 3) -> 10: turn over
    assert A.rounds(L, sup0, 3) == [2, 0, 3]
    # with 2 steps: 2 accepts 2 -> 5 accepts 0 -> 6 accepts 2 -> 9 accepts 2 -> 12: done
    assert A.rounds(L, sup0, 2) == [2, 0, 2, 2]
    # a second turn after an unsupervised gap starts over (its first column is the prefill's)
    sup2 = np.array([0, 1, 1, 0, 0, 1, 1, 1], dtype=bool)
    assert A.rounds(np.full(8, 1), sup2, 1) == [1, 1]


def test_summarize_is_the_bench_definition():
    s = A.summarize(np.array([2, 1, 1]))  # rounds accepting 0, 0, 1, 2 drafts
    assert s["tau"] == pytest.approx(1 + 3 / 4) and s["rounds"] == 4
    assert s["accept_per_pos"] == pytest.approx([0.5, 0.25])
    assert A.summarize(np.zeros(3))["rounds"] == 0


def test_simulation_equals_the_engines_greedy_rounds(tmp_path):
    """Greedy chain decoding through the embedded engine (engine/speculative.py) accepts per
    round exactly what one teacher-forced TTT pass over the engine's own output text says
    (trainer/acceptance.py simulate): the simulated bench is the measured one (float32)."""
    from engine_helpers import export_drafter, tiny_hf_llama
    from eagle3_runner.engine.speculative import Engine
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.models.llama import from_hf_model
    V = 6  # a small vocabulary: a random drafter is right now and then, so the test can tell
    hf = tiny_hf_llama(vocab=V, hidden=64, layers=4)
    aux_ids, n, new, P = [0, 1, 2], 3, 80, 10
    d = export_drafter(tmp_path / "d", hf.config, aux_ids)
    target = from_hf_model(hf, aux_ids)
    draft = load_exported(d, target.embed_tokens.weight)
    eng = Engine(target, draft, num_steps=n, max_seq=256)
    prompt = torch.randint(0, V, (1, P), generator=torch.Generator().manual_seed(3))
    toks, st = eng.generate(prompt, new)
    assert sum(st.accepted) > 0 and 0 in st.accepted  # right and wrong at times: it can tell
    hists = A.simulate(draft, hf, [(prompt[0].tolist() + toks, P)], aux_ids, [n],
                       hf.config.rms_norm_eps)
    sim = A.rounds(A.chain_lengths(_hits(draft, hf, prompt[0].tolist() + toks, P, n, aux_ids))[0]
                   .numpy(), _sup0(len(toks) + P, P, n), n)
    # every round but the last (the engine cuts it at max_new tokens)
    assert sim[:len(st.accepted) - 1] == st.accepted[:-1]
    assert hists[n].sum() == len(sim)


def _sup0(T, start, K):
    mask = torch.zeros(T, dtype=torch.bool)
    mask[start:] = True
    s = torch.zeros(T - 1 + K - 1, dtype=torch.bool)
    s[:T - 2] = mask[2:]
    return s[:T - 1].numpy()


def _hits(draft, hf, ids, start, K, aux_ids):
    from eagle3_runner.targets.capture import capture, target_head
    from eagle3_runner.trainer.objective import make_batch, target_dist, ttt_loss
    aux, last = capture(hf, [ids], aux_ids)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[start:] = 1
    b = make_batch([{"input_ids": torch.tensor(ids), "loss_mask": mask, "aux_hidden": aux[0],
                     "last_hidden": last[0]}], K)
    used = draft.d2t + torch.arange(draft.d2t.numel())
    tgt = target_dist(b["tgt_hidden"], target_head(hf), used, draft.t2d, hf.config.rms_norm_eps)
    with torch.no_grad():
        return ttt_loss(draft, b, tgt, K, 1.0)[1]["hit"]


@pytest.fixture(scope="module")
def extract_dir(tmp_path_factory):
    return tiny_extract(tmp_path_factory.mktemp("extract") / "x", n_samples=10)


def test_snapshots_kept_and_select_tau_outputs_the_best_evaluation(extract_dir, tmp_path):
    spec = train_spec(max_steps=6, eval_every=2, eval_samples=3, snapshots=True, select="tau",
                      select_num_steps=2, lr=0.05)
    ctx = train_ctx(spec, extract_dir, tmp_path / "out", tmp_path / "r.duckdb")
    summary = train(ctx)
    out = tmp_path / "out"
    m = json.loads((out / "train_metrics.json").read_text())
    steps = [h["step"] for h in m["history"]]
    assert steps == [2, 4, 6] and all(snapshot_path(out, s).exists() for s in steps)
    taus = [h["chain"]["2"]["tau"] for h in m["history"]]
    best = max(zip(taus, steps))[1]
    assert m["selected"] == {"step": best, "by": "tau", "num_steps": 2}
    assert summary["train_steps"][0] == best and summary["steps_run"][0] == 6
    assert summary["chain_tau_2"][0] == pytest.approx(max(taus))
    got = load_file(str(out / "draft.safetensors"))
    kept = load_file(str(snapshot_path(out, best)))
    assert all(torch.equal(got[k], kept[k]) for k in got)
    assert [h["samples"] for h in m["history"]] == [min(7, 2 * s) for s in steps]  # bs 2, 7 train
    cols, rows = ctx.store.query("SELECT DISTINCT name FROM metrics WHERE name LIKE "
                                 "'eval_chain_tau_%' ORDER BY name")
    assert [r[0] for r in rows] == [f"eval_chain_tau_{n}" for n in (1, 2, 3)]


def test_select_tau_needs_snapshots_and_held_out_samples():
    with pytest.raises(SpecError, match="snapshots: true"):
        train_spec(select="tau", eval_samples=3)
    with pytest.raises(SpecError, match="eval_samples"):
        train_spec(select="tau", snapshots=True, eval_samples=0)
    with pytest.raises(SpecError, match="select_num_steps = 9 exceeds ttt_steps"):
        train_spec(select="tau", snapshots=True, eval_samples=3, select_num_steps=9)
    train_spec(ttt_steps=2)  # select: last reads no chain length: the default 3 is no error


def test_the_curve_needs_kept_drafters_a_chain_first_and_the_export():
    """stages.bench.curve: each way to misread it is one error naming the fix."""
    from eagle3_runner.runner.spec.load import load_spec

    def spec(train: dict, bench: dict):
        return load_spec(data={
            "name": "c", "target": {"path": "/nonexistent/t", "num_hidden_layers": 4,
                                    "hidden_size": 32, "vocab_size": 96,
                                    "max_position_embeddings": 512, "device": "cpu"},
            "drafter": {"draft_vocab_size": 40, "aux_layer_ids": [0, 1, 2]},
            "stages": {"extract": {}, "train": train, "export": {},
                       "bench": {"configs": [{"num_steps": 3}], "curve": 2, **bench}}},
            check_target=False)
    spec({"snapshots": True}, {})
    with pytest.raises(SpecError, match="set stages.train.snapshots: true, or curve: 0"):
        spec({}, {})
    with pytest.raises(SpecError, match="remove stages.bench.drafter, or set curve: 0"):
        spec({"snapshots": True}, {"drafter": "/nonexistent/d"})
    with pytest.raises(SpecError, match="put a chain first"):
        spec({"snapshots": True}, {"configs": [{"num_steps": 3, "eagle_topk": 2,
                                                "num_draft_tokens": 4}]})
