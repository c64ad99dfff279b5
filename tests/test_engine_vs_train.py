"""The engine drafts exactly what training's TTT predicts under teacher forcing.

The embedded engine (engine/speculative.py, engine/steps.py) and the trainer (jobs/train.py
make_batch + ttt_loss over Eagle3Draft.ttt_step) implement the same recurrence two ways: a static
KV cache with rollback vs a teacher-forced unroll over a whole sequence. Here every round's
step-0 root logits (position r = the token before the one the round verifies first) must equal
the TTT step-0 logits at r over the final sequence, and the chain's step-j logits must equal TTT
step j at r over the sequence whose tokens r+2..r+K are the engine's own drafts (TTT step j at
position i feeds token i+1+j, RoPE i+j, step-0 keys <= i plus steps 1..j's keys at i).
An off-by-one in the token shift, the root row, the chain's RoPE positions/slots, or stale draft
KV after a rollback changes these logits. Drafts are forced by an oracle with errors (draft_fn)
so that every accept length, hence every rollback, happens; the drafter still runs every round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import export_drafter, tiny_hf_llama  # noqa: E402

import eagle3_runner.engine.speculative as E  # noqa: E402
import eagle3_runner.engine.steps as ES  # noqa: E402
from eagle3_runner.trainer import objective as TR  # noqa: E402
from eagle3_runner.models.draft_model import load_exported  # noqa: E402
from eagle3_runner.models.llama import from_hf_model  # noqa: E402

AUX = (0, 1, 2)
VOCAB = 64


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))


def _record(monkeypatch, drafter) -> list:
    """Instrument (no engine edits) the greedy engine's drafter calls. Returns a list that fills
    with ("root", position, logits [Vd]) per step-0 root and ("chain", None, logits [Vd]) per
    chain step, in call order. Patch BEFORE building the Engine (its step table binds names)."""
    events, inside = [], [False]
    orig_extend, orig_logits = ES.draft_extend, drafter.logits

    def extend(d, kc, vc, aux, nxt, pos, sel, *rest):
        inside[0] = True
        try:
            root, rlog, rid = orig_extend(d, kc, vc, aux, nxt, pos, sel, *rest)
        finally:
            inside[0] = False
        events.append(("root", int(pos[int(sel)]), rlog[0].clone()))
        return root, rlog, rid

    def logits(out):
        lg = orig_logits(out)
        if not inside[0]:
            events.append(("chain", None, lg[0, -1].clone()))
        return lg

    monkeypatch.setattr(ES, "draft_extend", extend)  # used by draft_round_greedy
    monkeypatch.setattr(E, "draft_extend", extend)  # the prompt's step 0, Engine's step table
    monkeypatch.setattr(drafter, "logits", logits)
    return events


def _rounds(events: list, K: int, n: int) -> list[dict]:
    """The first n rounds (verified ones; the last root may be drafted but never verified), each
    {"root": position, "logits": [K tensors [Vd]]} (step 0, then chain steps 1..K-1)."""
    out = []
    for kind, p, lg in events:
        if kind == "root":
            out.append({"root": p, "logits": [lg]})
        else:
            out[-1]["logits"].append(lg)
    out = out[:n]
    assert len(out) == n and all(len(r["logits"]) == K for r in out)
    return out


def _ttt_logits(hf, drafter, seq: torch.Tensor, K: int) -> torch.Tensor:
    """Teacher-forced TTT logits the way training computes them: target features (HF
    hidden_states[k+1] per aux id, pre-norm last hidden) -> make_batch -> ttt_loss.
    seq [T] -> [K, T-1, Vd] (step j at position i predicts token i+2+j)."""
    got = {}
    h = hf.model.norm.register_forward_pre_hook(lambda m, a: got.__setitem__("last", a[0]))
    with torch.no_grad():
        o = hf(seq[None], output_hidden_states=True)
    h.remove()
    sample = {"input_ids": seq, "last_hidden": got["last"][0],
              "aux_hidden": torch.cat([o.hidden_states[k + 1] for k in AUX], -1)[0],
              "loss_mask": torch.ones(seq.numel(), dtype=torch.long)}
    batch = TR.make_batch([sample], K)
    used = drafter.d2t + torch.arange(drafter.d2t.numel())
    head = {"norm": hf.model.norm.weight, "lm_head": hf.lm_head.weight}
    tgt = TR.target_dist(batch["tgt_hidden"], head, used, drafter.t2d, hf.config.rms_norm_eps)
    captured, orig = [], type(drafter).logits

    def logits(out):
        lg = orig(drafter, out)
        captured.append(lg.detach())
        return lg

    prev = drafter.__dict__.pop("logits", None)  # a recorder installed by _record
    drafter.logits = logits
    try:
        with torch.no_grad():
            TR.ttt_loss(drafter, batch, tgt, K, 0.8)
    finally:
        del drafter.logits
        if prev is not None:
            drafter.logits = prev
    return torch.stack([c[0] for c in captured]).float()


def _norms_off_one(m):
    """Random RMSNorm weights (a ones-init norm hides a norm that is skipped or applied twice)."""
    for n, p in m.named_parameters():
        if p.dim() == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=torch.Generator().manual_seed(len(n))))


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}],
                         ids=["eagle3", "eagle31"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy_graphs", "stepwise"])
def test_engine_drafts_equal_teacher_forced_ttt(tmp_path, monkeypatch, sampling, options, K=3):
    """sampling=False: the greedy loop (draft_round_greedy, the drafter's own drafts feed its
    chain). sampling=True: the step-by-step loop (draft_extend + draft_step) at temperature 0;
    with draft_fn it feeds the FORCED drafts to its chain steps. eagle31: the drafter has
    fc_norm and norm_output (exported, loaded back: the config keys and fc_norm.{i}.weight)."""
    hf = tiny_hf_llama(vocab=VOCAB, seed=4)
    target = from_hf_model(hf, AUX)
    # a draft vocab of 48 of the 64 target ids: non-trivial d2t offsets (target = i + d2t[i])
    used = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:48].sort().values
    drafter = load_exported(export_drafter(tmp_path / "d", hf.config, AUX, draft_vocab=48,
                                           d2t=used - torch.arange(48), seed=5,
                                           edit=_norms_off_one if options else None, **options),
                            target.embed_tokens.weight)
    assert (drafter.config.fc_norm, drafter.config.norm_output) == (bool(options),) * 2
    events = _record(monkeypatch, drafter)
    eng = E.Engine(target, drafter, num_steps=K, max_seq=256, sampling=sampling)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    base, _ = eng.generate_baseline(ids, 40)
    forced = []

    def oracle(out, k):  # the true continuation with a varying corrupted position (or none)
        n = len(out)
        d = [base[n + j] if n + j < len(base) else 0 for j in range(k)]
        bad = (len(forced) + 1) % (k + 2)
        if bad < k:
            d[bad] = (d[bad] + 1) % VOCAB
        forced.append(d)
        return d

    events.clear()
    out, st = eng.generate(ids, 40, draft_fn=oracle)
    assert out == base
    assert {0, K} <= set(st.accepted), st.accepted  # rollbacks of every kind happened
    rounds = _rounds(events, K, st.rounds)
    n0 = ids.shape[1]
    assert rounds[0]["root"] == n0 - 1  # the first root: the last prompt position
    full = torch.cat([ids[0], torch.tensor(out)])

    # step 0: every round's root logits = TTT step 0 over the final sequence at that position
    tf = _ttt_logits(hf, drafter, full, K)
    roots = [r["root"] for r in rounds]
    assert roots == sorted(set(roots))
    eng0 = torch.stack([r["logits"][0] for r in rounds])
    torch.testing.assert_close(eng0, tf[0, roots], atol=1e-4, rtol=1e-4)

    # chain steps 1..K-1: TTT over the prefix + the engine's own drafts as teacher tokens
    assert torch.equal(drafter.d2t + torch.arange(48), used)
    for i, rd in enumerate(rounds):
        r = rd["root"]
        drafts = forced[i] if sampling else [int(used[lg.argmax()]) for lg in rd["logits"]]
        seq = torch.cat([full[:r + 2], torch.tensor(drafts[:K - 1])])
        tfc = _ttt_logits(hf, drafter, seq, K)
        for j in range(K):
            torch.testing.assert_close(rd["logits"][j], tfc[j, r], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"root {r}, step {j}: {m}")
