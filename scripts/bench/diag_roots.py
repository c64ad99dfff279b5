#!/usr/bin/env python
"""Why engine first-draft acceptance is below held-out TTT step-0 accuracy: text or root choice?

  python scripts/bench/diag_roots.py --draft runs/smollm2-sharegpt/export/<id> [--prompts 8] [--new 256]
      [--steps 4] [--device auto|cpu|cuda] [--dtype float32|bfloat16] [--out diag.json]

For the first N MT-bench questions (SmolLM2 target, greedy embedded engine, eager, stop at EOS):
  (a) first-draft acceptance: rounds whose draft 1 was accepted / rounds (Stats.accepted > 0).
  (b) teacher-forced step-0 top-1 agreement at the round ROOTS, over the final generated text:
      features from the extraction code (jobs.extract.forward_features), step 0 from training's
      make_batch + target_dist + ttt_loss (K = 1). Root r = n-1 when the round's verify input is
      [t_n, d_1..d_K] at n..n+K; step 0 at r (token r+1 = t_n) predicts token r+2 (d_1). tests/test_engine_vs_train.py
      shows the engine's root logits equal these, so (a) == (b) in float32; in bf16 the two
      forwards round differently and a few argmaxes flip ("flips" = rounds where they disagree).
  (c) the same agreement over ALL generated positions (r = n0-1 .. T-3, n0 = prompt length).
Rounds start right after a rejection (or at the prompt's end), so positions inside an accepted run
are never roots: (b) < (c) means root selection costs acceptance; (c) well below the ShareGPT
held-out step-0 accuracy means the text (MT-bench vs ShareGPT) does.
Roots come from Stats.accepted alone (r_0 = n0-1, r_{i+1} = r_i + m_i + 1: the engine's
`n += m + 1`), so nothing in the engine is patched; only the drafter's `logits` is wrapped while
ttt_loss runs, to read its step-0 logits. No gradients anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from eagle3_runner.trainer import objective as TR  # noqa: E402
from eagle3_runner.models.draft_model import load_exported  # noqa: E402
from eagle3_runner.engine.speculative import Engine  # noqa: E402
from eagle3_runner.jobs.extract import forward_features  # noqa: E402
from eagle3_runner.models.llama import from_hf_model  # noqa: E402
from eagle3_runner.data.prompts import mtbench, render  # noqa: E402
from eagle3_runner.targets.load import (end_of_turn_ids, load_target, resolve_device,  # noqa: E402
                                        resolve_dtype)
from eagle3_runner.runner.assets import asset_path  # noqa: E402
from eagle3_runner.runner.files import atomic_write  # noqa: E402


@torch.no_grad()
def tf_step0(hf, drafter, seq: list[int], aux_ids, eps: float, device) -> torch.Tensor:
    """Training's step-0 prediction at every position of seq (T tokens), teacher-forced.
    Returns target ids [T-1] on the CPU: entry i is the drafter's argmax for token i+2."""
    (aux, last), = forward_features(hf, [seq], list(aux_ids))  # [T, 3Ht], [T, Ht] on the CPU
    sample = {"input_ids": torch.tensor(seq), "aux_hidden": aux, "last_hidden": last,
              "loss_mask": torch.ones(len(seq), dtype=torch.long)}
    batch = TR.to_device(TR.make_batch([sample], 1), device)  # aux [1, N, 3Ht], ids [1, N], N = T-1
    used = drafter.d2t + torch.arange(drafter.d2t.numel(), device=device)  # [Vd] target ids
    head = {"norm": hf.model.norm.weight, "lm_head": hf.lm_head.weight}
    tgt = TR.target_dist(batch["tgt_hidden"], head, used, drafter.t2d, eps)
    got, orig = [], drafter.logits

    def keep(out):  # out [1, N, H] -> logits [1, N, Vd], kept
        got.append(orig(out))
        return got[-1]

    drafter.logits = keep
    try:
        TR.ttt_loss(drafter, batch, tgt, 1, 1.0)
    finally:
        del drafter.logits  # back to the class method
    return used[got[0][0].argmax(-1)].cpu()  # [N]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 drafter dir (SGLang format)")
    ap.add_argument("--prompts", type=int, default=8, help="first N MT-bench questions")
    ap.add_argument("--new", type=int, default=256, help="max new tokens per prompt")
    ap.add_argument("--steps", type=int, default=4, help="num_steps K (chain length)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--out", default=None, help="write the per-prompt rows + summary as JSON")
    a = ap.parse_args(argv)
    from eagle3_runner.runner.inspect import inspect_draft  # the drafter checks of `runner inspect`, first
    errors = [f for f in inspect_draft(a.draft) if f.severity == "error"]
    if errors:
        sys.exit("diag_roots: --draft " + a.draft + " is not a usable drafter:\n" +
                 "\n".join(f"  {f.code}: {f.message}" for f in errors))
    dev = resolve_device(a.device)
    dt = resolve_dtype(a.dtype, dev)
    if dev == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    hf, tok, cfg = load_target(asset_path("smollm2"), device=dev, dtype=dt)
    dcfg = json.loads((Path(a.draft) / "config.json").read_text())
    aux_ids = tuple(sorted(dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    target = from_hf_model(hf, aux_ids)
    drafter = load_exported(a.draft, target.embed_tokens.weight, device=dev, dtype=dt)
    prompts = [(q["id"], render(tok, q["messages"])) for q in mtbench(a.prompts)]
    max_seq = -(-(max(len(p) for _, p in prompts) + a.new + 3 * a.steps + 8) // 256) * 256
    eng = Engine(target, drafter, num_steps=a.steps, max_seq=max_seq, cuda_graph=False)
    stop = end_of_turn_ids(asset_path("smollm2"), tok)
    eps = cfg.get("rms_norm_eps", 1e-5)
    rows = []
    for pid, ids in prompts:
        n0 = len(ids)
        out, st = eng.generate(torch.tensor([ids], device=dev), a.new, stop_ids=stop)
        full = torch.tensor(ids + out)  # [T]
        T = full.numel()
        roots = [n0 - 1]  # r_{i+1} = r_i + m_i + 1; the verified token r+2 always exists in full
        for m in st.accepted[:-1]:
            roots.append(roots[-1] + m + 1)
        roots = roots[:st.rounds]  # no round when the first token already stops
        tf = tf_step0(hf, drafter, full.tolist(), aux_ids, eps, dev)  # [T-1]
        ok = tf[:T - 2] == full[2:]  # [T-2]: ok[r] = step 0 at r predicts token r+2
        acc = [m > 0 for m in st.accepted]
        at_roots = [bool(ok[r]) for r in roots]
        gen = ok[n0 - 1:]  # every generated position a draft 1 could predict (gen tokens - 1)
        nonroot = torch.ones_like(gen)
        nonroot[[r - (n0 - 1) for r in roots]] = False
        rows.append(dict(id=pid, prompt_tokens=n0, new_tokens=len(out), rounds=st.rounds,
                         tau=st.tau, first_acc=sum(acc), tf_roots=sum(at_roots),
                         flips=sum(x != y for x, y in zip(acc, at_roots)),
                         tf_gen=int(gen.sum()), gen_positions=gen.numel(),
                         tf_nonroot=int(gen[nonroot].sum()), nonroot_positions=int(nonroot.sum())))
        r = rows[-1]
        print(f"{pid}: n0={n0} new={len(out)} tau={st.tau:.2f} first-draft {r['first_acc']}/"
              f"{r['rounds']}; tf at roots {r['tf_roots']}/{r['rounds']} (flips {r['flips']}); "
              f"tf all gen {r['tf_gen']}/{r['gen_positions']}; tf non-root "
              f"{r['tf_nonroot']}/{r['nonroot_positions']}", flush=True)
    s = {k: sum(r[k] for r in rows) for k in ("rounds", "first_acc", "tf_roots", "flips", "tf_gen",
                                               "gen_positions", "tf_nonroot", "nonroot_positions")}
    n, m = max(s["rounds"], 1), max(s["gen_positions"], 1)
    s.update(first_draft_acceptance=s["first_acc"] / n, tf_at_roots=s["tf_roots"] / n,
             tf_all_generated=s["tf_gen"] / m,
             tf_non_roots=s["tf_nonroot"] / max(s["nonroot_positions"], 1))
    print(f"first-draft acceptance {s['first_draft_acceptance']:.4f} ({s['rounds']} rounds); "
          f"teacher-forced at roots {s['tf_at_roots']:.4f}; teacher-forced over all generated "
          f"positions {s['tf_all_generated']:.4f} ({s['gen_positions']} positions)")
    if a.out:
        args = dict(vars(a), device=dev, dtype=str(dt).removeprefix("torch."))
        atomic_write(Path(a.out), json.dumps(dict(args=args, summary=s, prompts=rows),
                                                  indent=1))


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
