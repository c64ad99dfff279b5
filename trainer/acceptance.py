"""What greedy chain decoding would accept, from one teacher-forced TTT pass over the target's own
text: the simulated bench (no decoding, exact for chains up to bf16 noise).

Why it is exact. At temperature 0 a chain round at draft position c (the drafter's step 0 reads
the target's features at c and the bonus token c+1) accepts draft step j iff steps 0..j all
equal the target's argmax. Given that the earlier steps were right, serving feeds step j exactly
what TTT step j is fed (the drafter's own recycled hidden, the true token, RoPE position c + j,
attention over the target-feature keys <= c and the chain's own keys; SGLang 0.5.14
eagle_worker.py draft / draft_extend, engine/speculative.py), so a TTT hit at (step j, column c)
is an accepted token. On the target's own greedy text the rounds then follow from the hits:
accept a = min(leading hits, num_steps) tokens, bonus one, next round at c + a + 1. Per-position
acceptance and tau (bonus included) are the engine's definitions (runner/bench_rows.py).

Used by the train stage (held-out conversations the target regenerated greedily: tau on held-out
prompts, which picks the snapshot to export, stages.train.select) and by the bench (its own plain
decode's text: what the drafter predicts there against what the engines measured, and the
learning curve over the train stage's snapshots). On text the target did not write itself (raw
ShareGPT answers) the simulation is not what serving does: the chain's later tokens differ.

Columns: a TTT batch row's column c predicts token c+2 at step 0 (trainer/objective.py
alignment); sup[0, c] says that token is an assistant token. A turn's first assistant token is
the target's own (prefill), so its first round is one column after the first supervised one.
"""

from __future__ import annotations

import numpy as np
import torch


def chain_lengths(hit: torch.Tensor) -> torch.Tensor:
    """hit [K, R, T] bool (step j's draft equals the target's argmax at column c, and that token
    is an assistant token) -> [R, T] int64: the leading run of hits over steps 0..K-1."""
    return hit.long().cumprod(0).sum(0)


def rounds(L: np.ndarray, sup0: np.ndarray, num_steps: int) -> list[int]:
    """The chain rounds of greedy decoding over one row of columns: the draft tokens each round
    accepts, in order. L [T] int (chain_lengths of the row), sup0 [T] bool (step 0's token is an
    assistant token). Every run of supervised columns is one assistant turn (packed samples end
    with an unsupervised column, so a turn never runs into the next sample)."""
    out, T, c = [], len(L), 0
    while c < T:
        if not sup0[c]:
            c += 1
            continue
        c += 1  # the turn's first token comes from the target's prefill, not a draft
        while c < T and sup0[c]:
            a = min(int(L[c]), num_steps)
            out.append(a)
            c += a + 1
    return out


def chain_histograms(hit: torch.Tensor, sup0: torch.Tensor, steps: list[int]) -> dict[int, np.ndarray]:
    """{num_steps: [num_steps + 1] int64 counts of rounds accepting 0..num_steps drafts, over
    every row} for every chain length in `steps` (each <= K). hit [K, R, T] bool, sup0 [R, T]
    bool, on any device (one host copy)."""
    L = chain_lengths(hit).cpu().numpy()
    s0 = sup0.cpu().numpy()
    return {n: np.bincount([a for r in range(L.shape[0]) for a in rounds(L[r], s0[r], n)],
                           minlength=n + 1).astype(np.int64) for n in steps}


def summarize(hist) -> dict:
    """A rounds histogram [n + 1] (counts of a = 0..n accepted drafts) -> {"tau": 1 + mean a
    (bonus token included, the bench's tau), "accept_per_pos": [P(a > i) for i < n] (the bench's
    acceptance per draft position), "rounds": int}. tau is NaN when there is no round."""
    h = np.asarray(hist, dtype=np.float64)
    n, total = len(h) - 1, float(h.sum())
    if total == 0:
        return {"tau": float("nan"), "accept_per_pos": [0.0] * n, "rounds": 0}
    a = np.arange(n + 1)
    return {"tau": 1.0 + float((h * a).sum() / total),
            "accept_per_pos": [float(h[i + 1:].sum() / total) for i in range(n)],
            "rounds": int(total)}


def simulate(draft, model, texts: list[tuple[list[int], int]], aux_ids: list[int],
             steps: list[int], eps: float, batch: int = 8) -> dict[int, np.ndarray]:
    """The simulated greedy chains of drafter `draft` (models/draft_model.py Eagle3Draft, e.g.
    load_exported) over `texts` the target `model` (a transformers causal LM) wrote:
    [(token ids, index of the first generated token)], e.g. a bench prompt and its plain greedy
    decode. Features from the target's own forward (targets/capture.py capture), then one
    teacher-forced TTT pass of max(steps) steps (trainer/objective.py, the reference
    objective, in the drafter's dtype). Returns chain_histograms' {num_steps: rounds counts}.
    eps: the target's rms_norm_eps. No grad; `batch` texts per forward."""
    from eagle3_runner.targets.capture import capture, target_head
    from eagle3_runner.trainer.objective import make_batch, target_dist, to_device, ttt_loss
    K, dev = max(steps), draft.d2t.device
    head = {k: v.to(dev) for k, v in target_head(model).items()}
    used = draft.d2t + torch.arange(draft.d2t.numel(), device=dev)
    hists = {n: np.zeros(n + 1, dtype=np.int64) for n in steps}
    with torch.no_grad():
        for a in range(0, len(texts), batch):
            part = texts[a:a + batch]
            aux, last = capture(model, [ids for ids, _ in part], list(aux_ids), device=dev)
            samples = []
            for i, (ids, start) in enumerate(part):
                mask = torch.zeros(len(ids), dtype=torch.uint8)
                mask[start:] = 1
                samples.append({"input_ids": torch.tensor(ids), "loss_mask": mask,
                                "aux_hidden": aux[i, :len(ids)].clone(),
                                "last_hidden": last[i, :len(ids)].clone()})
            b = to_device(make_batch(samples, K), dev)
            b["aux"] = b["aux"].to(draft.fc.weight.dtype)
            tgt = target_dist(b["tgt_hidden"], head, used, draft.t2d, eps)
            _, st = ttt_loss(draft, b, tgt, K, 1.0)
            for n, h in chain_histograms(st["hit"], st["sup0"], steps).items():
                hists[n] += h
    return hists


def bench_simulations(p, hf, target, drafter, device, sets: dict, ours: dict,
                      snapshots: list[dict]) -> tuple[dict, list[dict]]:
    """The bench stage's simulations (jobs/bench.py; p: stages.bench) over its plain greedy decode (the first cuda_graph
    setting's `ours`): {(prompt_set, max_new, num_steps): summarize} of the exported drafter
    for every chain configuration, and the learning curve's embedded rows (each snapshot at
    configs[0]). Greedy only (temperature 0: sampled text is not what greedy serving sees)."""
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.runner.bench_curve import curve_row
    from eagle3_runner.runner.bench_rows import config_fields
    if p.temperature != 0:
        return {}, []
    eps = float(getattr(hf.config, "rms_norm_eps", 1e-5))
    aux, cg, c0 = list(target.aux_ids), p.cuda_graph[0], p.configs[0]
    steps = sorted({c.num_steps for c in p.configs if c.eagle_topk == 1})
    sims, curve = {}, []
    for set_name, prompts in sets.items():
        for mx in p.max_new_tokens:
            texts = [(ids[0].tolist() + ours[cg, set_name, mx, pid], ids.shape[1])
                     for pid, ids in prompts]
            if steps:
                for n, h in simulate(drafter, hf, texts, aux, steps, eps).items():
                    sims[set_name, mx, n] = summarize(h)
            for snap in snapshots:
                d = load_exported(snap["dir"], target.embed_tokens.weight, device=device,
                                  dtype=drafter.fc.weight.dtype)
                h = simulate(d, hf, texts, aux, [c0.num_steps], eps)[c0.num_steps]
                sm = summarize(h)
                cfg = config_fields(c0, cg, mx, p.temperature, "embedded", set_name,
                                    snap.get("samples"))
                curve.append(curve_row(cfg, snap, "embedded", "simulated", sm["tau"],
                                       sm["accept_per_pos"], sm["rounds"], len(texts)))
    return sims, curve
