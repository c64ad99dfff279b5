"""Stage `train`: TTT (training-time test) training of the EAGLE-3 drafter.

Inputs: ctx.inputs["extract"] (jobs/features.py format). Outputs in ctx.out_dir:
  draft.safetensors   Eagle3Draft.state_dict(): fc.weight, midlayer.*, norm.weight,
                      lm_head.weight, d2t (int64 offsets), t2d (bool) -- float32
  draft_config.json   DraftConfig.as_dict() (load with DraftConfig(**json))
  train_metrics.json  summary, eval history, vocab stats
  vocab/vocab-<key>.pt  the cached draft-vocab mapping (jobs/vocab.py)
  ckpt.pt             the resumable checkpoint (removed when training completes)

Alignment (SpecForge OnlineEagle3Model / SGLang draft extend): a sample of T tokens gives
N = T-1 draft positions. At TTT step j, position i takes token i+1+j (and, at j = 0, the aux
feature at i; later, the draft's own pre-norm output of step j-1 at i), RoPE position i + j,
and predicts token i+2+j, whose soft target is softmax over the draft vocab of the target's
logits at position i+1+j = lm_head(norm(last_hidden[i+1+j])). A position is trained only when
token i+2+j is an assistant token AND the target's argmax there is inside the draft vocab.
Loss = sum_j decay^j * mean over trained positions of the soft cross-entropy.
Accuracy at step j = P(draft argmax (mapped through d2t) == target argmax) over assistant
positions (a target argmax outside the draft vocab counts as a miss, as in SpecForge).

Data parallel (ctx.world_size > 1, launched by runner/launch.py; DDP over NCCL/gloo): batch_size
stays the GLOBAL batch. Rank r takes samples r::world of each step's batch; the per-step token
counts are all-reduced before the loss, so each rank's loss is its share of the global token
mean and DDP's gradient average (x world) is exactly the single-rank gradient (up to float
summation order). Eval batches are spread round-robin and their sums all-reduced. Rank 0 alone
writes the vocab cache (first), checkpoints and outputs; every rank resumes from the same ckpt.pt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from jobs import dist as D
from jobs import vocab as V
from jobs.draft_model import DraftConfig, Eagle3Draft
from jobs.features import open_features
from runner.stage import StageContext, StageError, write_text_atomic

CKPT = "ckpt.pt"


# ---------------------------------------------------------------------------------------------
# data


def make_batch(samples: list[dict], K: int) -> dict[str, torch.Tensor]:
    """Right-padded TTT batch of B samples; N = max(T) - 1 positions, E = N + K - 1 rows so
    step j reads rows j..j+N-1 of the extended tensors.
    Returns aux [B, N, 3*Ht], ids [B, E] (ids[b, r] = token r+1), tgt_hidden [B, E, Ht]
    (last_hidden at r+1), pmask [B, E] bool (token r+2 is an assistant token), tokens (int)."""
    N = max(int(s["input_ids"].numel()) for s in samples) - 1
    if N < 1:
        raise ValueError("every sample in the batch has fewer than 2 tokens")
    B, E = len(samples), N + K - 1
    s0 = samples[0]
    aux = torch.zeros(B, N, s0["aux_hidden"].shape[-1], dtype=s0["aux_hidden"].dtype)
    ids = torch.zeros(B, E, dtype=torch.int64)
    tgt = torch.zeros(B, E, s0["last_hidden"].shape[-1], dtype=s0["last_hidden"].dtype)
    pm = torch.zeros(B, E, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = s["input_ids"].numel() - 1
        if n < 1:
            continue
        aux[b, :n] = s["aux_hidden"][:n]
        ids[b, :n] = s["input_ids"][1:].long()
        tgt[b, :n] = s["last_hidden"][1:]
        pm[b, :n - 1] = s["loss_mask"][2:].bool()
    return {"aux": aux, "ids": ids, "tgt_hidden": tgt, "pmask": pm,
            "tokens": sum(int(s["input_ids"].numel()) for s in samples)}


@torch.no_grad()
def target_dist(tgt_hidden, head: dict, used: torch.Tensor, t2d: torch.Tensor, eps: float,
                chunk_elems: int = 1 << 26):
    """The target's next-token distribution restricted to the draft vocab.
    tgt_hidden [B, E, Ht] (pre-norm last hidden); head: norm [Ht], lm_head [V, Ht]; used [Vd].
    Returns p [B, E, Vd] float32 (softmax over the draft columns), target_ids [B, E] int64
    (argmax over the FULL vocab), in_vocab [B, E] bool (t2d[target_ids]).
    Chunked over rows so the [rows, V] logits stay under chunk_elems floats."""
    B, E, Ht = tgt_hidden.shape
    x = tgt_hidden.reshape(B * E, Ht)
    W, w = head["lm_head"], head["norm"]
    rows = max(1, chunk_elems // W.shape[0])
    ps, ids = [], []
    for a in range(0, x.shape[0], rows):
        h = x[a:a + rows].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        logits = (h.to(W.dtype) @ W.T).float()  # [rows, V]
        ids.append(logits.argmax(-1))
        ps.append(torch.softmax(logits[:, used], dim=-1))
    target_ids = torch.cat(ids).view(B, E)
    return torch.cat(ps).view(B, E, -1), target_ids, t2d[target_ids]


def loss_counts(batch: dict, tgt: tuple, K: int) -> torch.Tensor:
    """Trained positions per TTT step: [K] int64 (assistant token AND target argmax in the draft
    vocab), the denominators of ttt_loss."""
    N, pm, in_vocab = batch["aux"].shape[1], batch["pmask"], tgt[2]
    return torch.stack([(pm[:, j:j + N] & in_vocab[:, j:j + N]).sum() for j in range(K)])


def ttt_loss(model: Eagle3Draft, batch: dict, tgt: tuple, K: int, decay: float,
             denom: torch.Tensor | None = None):
    """Unroll K draft steps (Eagle3Draft.ttt_step keeps the KV of earlier steps).
    denom [K] int64: the per-step token counts to divide by; None = this batch's own counts
    (loss_counts). Data parallel passes the counts summed over ranks, so the loss of each rank is
    its share of the global mean.
    Returns (loss scalar, stats {loss [K], correct [K], count [K]} float64 CPU tensors)."""
    aux, ids, pm = batch["aux"], batch["ids"], batch["pmask"]
    p, target_ids, in_vocab = tgt
    B, N, _ = aux.shape
    pos = torch.arange(N, device=aux.device)[None].expand(B, N)
    causal = torch.ones(N, N, dtype=torch.bool, device=aux.device).tril()[None, None]
    used = model.d2t + torch.arange(model.d2t.numel(), device=model.d2t.device)
    h, cache, total, st = model.project(aux), [], 0.0, []
    for j in range(K):
        h = model.ttt_step(ids[:, j:j + N], h, pos, cache, causal)  # [B, N, H]
        logits = model.logits(h).float()  # [B, N, Vd]
        sup = pm[:, j:j + N]  # predicted token is an assistant token
        m = sup & in_vocab[:, j:j + N]
        ce = torch.sum(-p[:, j:j + N] * F.log_softmax(logits, -1), dim=-1)  # [B, N]
        lj = (ce * m).sum() / (m.sum() if denom is None else denom[j]).clamp_min(1)
        total = total + decay ** j * lj
        with torch.no_grad():
            pred = used[logits.argmax(-1)]
            st.append(torch.stack([lj.detach(), ((pred == target_ids[:, j:j + N]) & sup).sum(),
                                   sup.sum()]).double())
    st = torch.stack(st, dim=1).cpu()  # one device sync per call, not 3 per step
    return total, {"loss": st[0], "correct": st[1], "count": st[2]}


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT loss as one module, so that DDP sees a forward call:
    forward(batch, tgt, denom) = ttt_loss(draft, ...)."""

    def __init__(self, draft: Eagle3Draft, K: int, decay: float):
        super().__init__()
        self.draft, self.K, self.decay = draft, K, decay

    def forward(self, batch: dict, tgt: tuple, denom: torch.Tensor | None = None):
        return ttt_loss(self.draft, batch, tgt, self.K, self.decay, denom)


def train_step(model, opt, samples: list[dict], head: dict, used, t2d, eps: float, p, device,
               autocast, ddp=None, world: int = 1, empty: bool = False) -> tuple[float, float, int]:
    """One optimizer step on `samples` (no LR-scheduler step): batch, target distribution, TTT
    loss, backward, grad clipping (p.grad_clip), AdamW. p: ttt_steps, step_decay, grad_clip.

    Data parallel: ddp = DDP(TTTObjective(model)), `samples` = this rank's slice of the global
    batch, world = ranks. The per-step counts are summed over ranks first and the backward loss
    is scaled by `world`, so DDP's gradient AVERAGE equals the gradient of the global loss.
    empty = this rank has no sample this step: `samples` is a stand-in whose mask is cleared (it
    adds exactly 0 but joins the all-reduce).
    Returns (global loss, grad norm before clipping, global sequence tokens)."""
    batch = _to(make_batch(samples, p.ttt_steps), device)
    if empty:
        batch["pmask"].zero_()
        batch["tokens"] = 0
    tgt = target_dist(batch["tgt_hidden"], head, used, t2d, eps)
    opt.zero_grad(set_to_none=True)
    if ddp is None:
        with autocast():
            loss, _ = ttt_loss(model, batch, tgt, p.ttt_steps, p.step_decay)
        loss.backward()
        ntok = batch["tokens"]
    else:
        denom = D.all_reduce_sum(loss_counts(batch, tgt, p.ttt_steps))
        with autocast():
            loss, _ = ddp(batch, tgt, denom)
        (loss * world).backward()
        red = D.all_reduce_sum(torch.stack([loss.detach().double(),
                                            torch.tensor(float(batch["tokens"]), device=device,
                                                         dtype=torch.float64)]))
        loss, ntok = red[0], int(red[1])
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), p.grad_clip)
    opt.step()
    return float(loss.detach()), float(gnorm), ntok


def make_autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on the CPU (float32)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


# ---------------------------------------------------------------------------------------------
# schedule, data order, checkpoints


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def batch_indices(step: int, n: int, bs: int, seed: int) -> list[int]:
    """Training-sample indices of optimizer step `step`: a fresh permutation per epoch, a pure
    function of (step, seed), so a resumed run sees exactly the uninterrupted run's batches."""
    spe = math.ceil(n / bs)
    epoch, b = divmod(step, spe)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[b * bs:(b + 1) * bs].tolist()


def _rng_state() -> dict:
    import numpy as np
    st = {"torch": torch.get_rng_state(), "python": random.getstate(),
          "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    import numpy as np
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# the stage


def run(ctx: StageContext) -> dict:
    """Stage entry point: train, write draft.safetensors / draft_config.json / train_metrics.json."""
    return train(ctx)


def _peak_mem_mib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_process_max_rss"


def _device(ctx) -> torch.device:
    want = ctx.spec.target.device
    if want == "cuda" and not torch.cuda.is_available():
        raise StageError("target.device = 'cuda', but no CUDA device is visible to the train job.")
    if want != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # the launcher set it per rank
    return torch.device("cpu")


def _split(n_total: int, p) -> tuple[list[int], list[int]]:
    """Held-out eval = the LAST eval_samples samples; train = the first num_samples of the rest."""
    n_avail = n_total - p.eval_samples
    if n_avail < 1:
        raise StageError(f"train.eval_samples = {p.eval_samples} leaves no training samples: the "
                         f"extract artifact holds {n_total}. Lower train.eval_samples or extract "
                         "more data (data.max_samples).")
    n = min(p.num_samples or n_avail, n_avail)
    return list(range(n)), list(range(n_avail, n_total))


def evaluate(model, feats, ids: list[int], head, used, t2d, eps, p, device, autocast,
             rank: int = 0, world: int = 1) -> dict:
    """Loss and per-step top-1 accuracy of the drafter on samples `ids` (no grad).
    Data parallel: batch k (of p.batch_size samples) runs on rank k % world and the sums are
    all-reduced, so every rank returns the single-rank numbers."""
    model.eval()
    tot = torch.zeros(3, p.ttt_steps, dtype=torch.float64)
    loss_sum, nb = 0.0, 0
    with torch.no_grad():
        for k, a in enumerate(range(0, len(ids), p.batch_size)):
            if k % world != rank:
                continue
            batch = _to(make_batch([feats.get(i) for i in ids[a:a + p.batch_size]],
                                   p.ttt_steps), device)
            tgt = target_dist(batch["tgt_hidden"], head, used, t2d, eps)
            with autocast():
                loss, st = ttt_loss(model, batch, tgt, p.ttt_steps, p.step_decay)
            loss_sum, nb = loss_sum + float(loss), nb + 1
            tot += torch.stack([st["loss"], st["correct"], st["count"]])
    if world > 1:
        red = D.all_reduce_sum(torch.cat([tot.flatten(), torch.tensor([loss_sum, nb],
                                          dtype=torch.float64)]).to(device)).cpu()
        tot, loss_sum, nb = red[:-2].view(3, -1), float(red[-2]), int(red[-1])
    model.train()
    return {"loss": loss_sum / max(nb, 1), "loss_step": (tot[0] / max(nb, 1)).tolist(),
            "acc_step": (tot[1] / tot[2].clamp_min(1)).tolist()}


def _completed(out: Path, fp: str) -> dict | None:
    """The summary of a finished run with this fingerprint in `out`, else None."""
    try:
        m = json.loads((out / "train_metrics.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if m.get("fingerprint") != fp or not (out / "draft.safetensors").exists() or (out / CKPT).exists():
        return None
    return {k: (v, m.get("summary_units", {}).get(k, "")) for k, v in m["summary"].items()}


def _to(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()}


def train(ctx: StageContext, stop_at: int | None = None) -> dict:
    """Train the drafter of ctx.spec on ctx.inputs["extract"]; resume from ctx.out_dir/ckpt.pt.

    stop_at (tests only): return None after that many optimizer steps, as if the job had been
    killed there (no checkpoint is written at that point).
    Data parallel when ctx.world_size > 1 (see the module docstring); every rank returns the
    same summary, rank 0 writes the files.
    Raises StageError for unusable inputs (no samples, no supervised tokens, hidden mismatch)."""
    from tqdm import tqdm
    p, spec, out = ctx.params, ctx.spec, Path(ctx.out_dir)
    rank, world = D.check(ctx)
    out.mkdir(parents=True, exist_ok=True)
    if "extract" not in ctx.inputs:
        raise StageError("stage train needs the extract stage's artifact (stages.extract).")
    feats = open_features(ctx.inputs["extract"], spec.aux_ids, spec.feature_width)
    tcfg = feats.target_config
    cfg = DraftConfig.from_spec(spec, tcfg)
    if cfg.hidden_size != cfg.target_hidden_size:
        raise StageError(f"drafter.hidden_size = {cfg.hidden_size} differs from the target's "
                         f"{cfg.target_hidden_size}: the drafter reuses the target's frozen "
                         "embedding, so this trainer needs equal sizes. Remove drafter.hidden_size.")
    train_ids, eval_ids = _split(len(feats), p)
    eps = float(tcfg.get("rms_norm_eps") or 1e-5)
    device = _device(ctx)

    # draft vocab (cached under a content hash that includes both sizes)
    key = V.cache_key(V.features_identity(feats.root), train_ids, cfg.draft_vocab_size,
                      cfg.vocab_size)
    d2t, t2d, vstats = D.rank0_first(rank, lambda: V.build_or_load(
        out / "vocab", key, lambda: ((s["input_ids"], s["loss_mask"]) for s in
                                     (feats.get(i, ("input_ids", "loss_mask")) for i in train_ids)),
        cfg.draft_vocab_size, cfg.vocab_size))
    if vstats["supervised_tokens"] == 0:
        raise StageError(f"{feats.root}: the loss mask of the {len(train_ids)} training samples "
                         "is all zero (no assistant tokens found), so there is nothing to train. "
                         "Check target.chat_template and the extract stage.")

    head = {k: v.to(device) for k, v in feats.head().items()}
    if head["lm_head"].shape[0] != cfg.vocab_size:
        raise StageError(f"{feats.root}/target_head.safetensors: lm_head has "
                         f"{head['lm_head'].shape[0]} rows, target_config vocab_size is "
                         f"{cfg.vocab_size}. Re-run extract.")
    torch.manual_seed(p.seed)
    random.seed(p.seed)
    model = Eagle3Draft(cfg, head["embed_tokens"].float())
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.to(device).train()
    used, t2d_dev = V.used_ids(d2t).to(device), t2d.to(device)
    ddp = None
    if world > 1:
        ddp = D.ddp(TTTObjective(model, p.ttt_steps, p.step_decay), device)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    spe = math.ceil(len(train_ids) / p.batch_size)
    total = max(1, math.ceil(p.epochs * spe))
    total = min(total, p.max_steps) if p.max_steps else total
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, p.warmup_steps, total))
    autocast = make_autocast(device)

    fp = hashlib.sha256(json.dumps({"train": p.model_dump(), "draft": cfg.as_dict(), "vocab": key,
                                    "device": device.type}, sort_keys=True,
                                   default=str).encode()).hexdigest()[:16]
    done = _completed(out, fp)
    D.barrier()  # every rank has looked before rank 0 may write anything below
    if done is not None:  # finished before, but the runner never finalized the artifact
        return done
    step, tokens, train_s, history = 0, 0, 0.0, []
    ck = out / CKPT
    if ck.exists():
        st = torch.load(ck, map_location="cpu", weights_only=False)
        if st.get("fingerprint") == fp:
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["opt"])
            sched.load_state_dict(st["sched"])
            _set_rng_state(st["rng"])
            step, tokens, train_s, history = st["step"], st["tokens"], st["train_s"], st["history"]
        else:
            print(f"train: ignoring {ck}: written for other settings (fingerprint mismatch)")

    eval_on, eval_split = (eval_ids, "eval") if eval_ids else (train_ids, "trainset")

    def do_eval(s: int) -> None:
        r = evaluate(model, feats, eval_on, head, used, t2d_dev, eps, p, device, autocast,
                     rank, world)
        history.append({"step": s, "split": eval_split, **r})
        ctx.metric(f"{eval_split}_loss", r["loss"], "nats", step=s)
        for j, (a, lj) in enumerate(zip(r["acc_step"], r["loss_step"])):
            ctx.metric(f"{eval_split}_acc_{j}", a, "fraction", step=s)
            ctx.metric(f"{eval_split}_loss_{j}", lj, "nats", step=s)

    def save(s: int) -> None:
        if rank == 0:  # the ranks hold identical weights and optimizer state (DDP)
            _atomic_save({"model": model.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "rng": _rng_state(), "step": s,
                          "tokens": tokens, "train_s": train_s, "history": history,
                          "fingerprint": fp, "spec": spec.model_dump(mode="json")}, ck)
        D.barrier()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=ctx.rank != 0)
    run_loss, run_n = 0.0, 0
    while step < total:
        if stop_at is not None and step >= stop_at:
            bar.close()
            return None  # type: ignore[return-value]
        t0 = time.perf_counter()
        idx = batch_indices(step, len(train_ids), p.batch_size, p.seed)
        mine = idx[rank::world]  # this rank's slice of the global batch
        samples = [feats.get(train_ids[i]) for i in (mine or idx[:1])]
        loss, gnorm, ntok = train_step(model, opt, samples, head, used, t2d_dev, eps, p, device,
                                       autocast, ddp, world, empty=not mine)
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_s += time.perf_counter() - t0
        tokens += ntok
        step += 1
        run_loss, run_n = run_loss + loss, run_n + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", gnorm=f"{gnorm:.2f}")
        if step % p.eval_every == 0 or step == total:
            ctx.metric("train_loss", run_loss / run_n, "nats", step=step)
            ctx.metric("lr", sched.get_last_lr()[0], "", step=step)
            run_loss, run_n = 0.0, 0
            do_eval(step)
        if step % p.checkpoint_every == 0 and step < total:
            save(step)
    bar.close()
    if not history or history[-1]["step"] != step:
        do_eval(step)

    peak, peak_kind = _peak_mem_mib(device)
    last = history[-1]
    summary = {"final_loss": (last["loss"], "nats"), "train_steps": (step, "steps"),
               "train_samples": (len(train_ids), "samples"),
               "tokens_per_s": (tokens / train_s if train_s else 0.0, "tok/s"),
               "peak_mem_mib": (peak, "MiB"),
               "draft_vocab_coverage": (vstats["coverage"], "fraction"),
               "draft_vocab_padded": (vstats["padded"], "tokens")}
    for j, a in enumerate(last["acc_step"]):
        summary[f"acc_{j}"] = (a, "fraction")
    if rank != 0:
        D.barrier()  # rank 0 writes the outputs
        return summary
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    from safetensors.torch import save_file
    tmp = out / f".tmp-draft-{os.getpid()}.safetensors"
    save_file(sd, str(tmp), metadata={"format": "eagle3-draft/1", "fingerprint": fp})
    os.replace(tmp, out / "draft.safetensors")
    write_text_atomic(out / "draft_config.json", json.dumps(cfg.as_dict(), indent=1))
    write_text_atomic(out / "train_metrics.json", json.dumps(
        {"summary": {k: v[0] for k, v in summary.items()},
         "summary_units": {k: v[1] for k, v in summary.items()}, "peak_mem_kind": peak_kind,
         "eval_split": eval_split, "history": history, "vocab": vstats, "device": device.type,
         "tokens_note": "tokens/s = sequence tokens per second of optimizer steps (each token "
                        "passes through all TTT steps); eval and checkpoint time excluded",
         "fingerprint": fp}, indent=1))
    ck.unlink(missing_ok=True)  # complete: the artifact is the drafter, not the optimizer state
    D.barrier()
    return summary
