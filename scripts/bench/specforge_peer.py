#!/usr/bin/env python
"""The peer run of issues 36 and 44: SpecForge 0.2.0 trains ITS OWN EAGLE-3 drafter with its own
training code and defaults on exactly the samples and features our train stage uses, exports it to
SGLang format with its own exporter, and `runner inspect` checks it, so that the bench stage can
bench it next to ours (a spec variant with stages.bench.drafter = this script's output).

    python scripts/bench/specforge_peer.py specs/smollm2-recipe-gpu.yaml --variant specforge \\
        --out runs/peer --max-minutes 7.5
    runner apply specs/smollm2-recipe-gpu.yaml --variant specforge  # benches it (same prompts)
    python scripts/bench/specforge_peer.py --check-imports   # every SpecForge module it uses

What is the same as our train stage (trainer/recipe.py `setup`, called here): the samples (the
spec variant's stages.train.num_samples / eval_samples split of the same data: the extract
artifact's features, or with features: online the target run on them, captured outside the
timed steps), their max_length truncation, the epochs, the TTT steps (stages.train.ttt_steps,
SpecForge's default 7 too) and the draft vocab (our d2t/t2d, loaded with SpecForge's
`load_vocab_mapping`), the aux layers and the drafter's geometry (its config is our
DraftConfig.to_sglang(), plain EAGLE-3: fc_norm / norm_output off whatever the variant says).
What is SpecForge's own (0.2.0 wheel; docs/training-options.md, "The SpecForge peer"):
its draft model (AutoDraftModel.from_config: LlamaForCausalLMEagle3 with its initialisation,
attention_backend flex_attention, bf16 weights, frozen embedding = the target's), its TTT loop and
loss (OnlineEagle3Model, forward KL through its Triton LogSoftmaxLoss, divided by B x T), its
offline step (Eagle3TrainStrategy.forward_loss over TrainBatch with target_repr hidden_state: its
TargetHead shift, loss_mask[:, -1] = 0 as its preprocessing does, losses weighted 0.8^i), its
optimizer (BF16Optimizer: AdamW lr 1e-4 over fp32 masters, weight decay 0, grad clip 0.5, cosine
after a 1.5% linear warmup, total = samples x epochs / batch), batch size 1 and seed 42 (the
sample order: a permutation per epoch from seed 42 + epoch), and its exporter
(export_to_sglang). One difference we cannot avoid: our features store the target's PRE-norm last
hidden state, SpecForge's the post-norm one, so the frozen TargetHead here applies the target's
final RMSNorm before lm_head (the same target logits SpecForge would compute).

Outputs in --out: peer.json (the numbers: SpecForge's steps, samples, tokens, seconds of
optimizer steps and tokens/s; ours from the train artifact's train_metrics.json and the ratio;
same_inputs: whether the samples are the ones our train stage of the same train key trained on,
by its draft-vocab key, which hashes every sample's tokens and loss mask and which samples;
held-out accuracy per TTT step of both, by our evaluation; the export and inspect results),
peer.md (the table), peer.log (everything printed); the SGLang draft directory at the variant's
stages.bench.drafter (or --export-to), with a provenance.json naming SpecForge and the samples
trained on. Every step writes its part of peer.json as it finishes, so a failed or timed-out run
still says what it did. Needs CUDA (SpecForge's loss is a Triton kernel): on the CPU it refuses.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

# Every SpecForge module this script imports (tests/test_specforge_peer.py keeps the list equal to
# the imports below): `--check-imports` imports them all, so a device call proves in seconds what
# the run needs. On the device image (torch 2.11, transformers 5.17, triton 3.6, Python 3.12) they
# need nothing but the specforge wheel itself: their own imports are torch, transformers, triton,
# safetensors, huggingface_hub and typing_extensions (flash_attn optional: it falls back to
# flex_attention with a warning); the wheel's declared pydantic, datasets, sglang, yunchang,
# wandb and openai-harmony are imported only by its CLI, data, config, sequence-parallel and
# tracker code, which this script never reaches.
SPECFORGE_MODULES = (
    "specforge.algorithms.eagle3.model",    # OnlineEagle3Model (its TTT loop, Triton loss)
    "specforge.export.to_sglang",           # export_to_sglang
    "specforge.modeling.auto",              # AutoDraftModel, AutoDraftModelConfig
    "specforge.modeling.target.target_head",  # TargetHead.preprocess
    "specforge.optimizer",                  # BF16Optimizer
    "specforge.runtime.contracts",          # TrainBatch
    "specforge.training.strategies.base",   # Eagle3TrainStrategy
)
PEER_SEED = 42  # SpecForge 0.2.0 TrainingConfig.seed
PEER_LR, PEER_CLIP, PEER_WARMUP, PEER_DECAY = 1e-4, 0.5, 0.015, 0.8  # its defaults
LOG_EVERY = 200  # steps between progress lines


class Report:
    """peer.json, rewritten after every step of the script (a failure keeps what was done)."""

    def __init__(self, out: Path):
        self.path, self.data = out / "peer.json", {}

    def set(self, **kw) -> None:
        self.data.update(kw)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def peer_context(spec_path: str, variant: str, overrides: list[str], out: Path):
    """(the variant's spec, a train-stage StageContext on its inputs, our train artifact dir or
    None). The inputs come from the plan: the extract artifact (offline) or the regenerate
    artifact (online, when the spec regenerates). Raises RunnerError when an input is missing."""
    from eagle3_runner.runner.errors import PlanError
    from eagle3_runner.runner.plan import build_plan, source_entry
    from eagle3_runner.runner.spec.load import load_spec, variant_spec
    from eagle3_runner.runner.stage import StageContext, read_manifest
    spec = load_spec(spec_path, overrides)
    plan = build_plan(spec, only=("train",), variants=(variant,))
    by = {(p.variant, p.stage): p for p in plan.stages}
    if (variant, "train") not in by:
        raise PlanError(f"variant {variant!r} has no train stage")
    train = source_entry(plan, by[variant, "train"])
    inputs = {}
    for v, n in train.needs:
        art = Path(source_entry(plan, by[v, n]).artifact)
        if read_manifest(art) is None:
            raise PlanError(f"the train stage of {variant!r} needs the {n} artifact, which is "
                            f"not complete ({art}): run `runner apply {spec_path} --variant "
                            f"{variant} --only {n}` first")
        inputs[n] = art
    vspec = spec if variant == "base" else variant_spec(spec, variant)
    ctx = StageContext(spec=vspec, stage="train", variant=variant, run_id="specforge-peer",
                       inputs=inputs, out_dir=out / "setup", db_path=out / "setup.duckdb")
    ours = Path(train.artifact) if read_manifest(Path(train.artifact)) is not None else None
    return vspec, ctx, ours


class TargetHead:
    """SpecForge's frozen TargetHead on our features (module docstring): its `preprocess` (the
    shift) as is, its projection = lm_head(rmsnorm(h)) since our last hidden is pre-norm."""

    def __init__(self, head: dict, eps: float, device, dtype):
        import torch
        self.norm = head["norm"].to(device, torch.float32)
        self.W = head["lm_head"].to(device, dtype)
        self.eps = eps

    def preprocess(self, input_ids, target, loss_mask):
        from specforge.modeling.target.target_head import TargetHead as SF
        return SF.preprocess(self, input_ids, target, loss_mask)

    def __call__(self, h):
        import torch
        with torch.no_grad():
            x = h.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
            return x.to(self.W.dtype) @ self.W.T


def build_specforge(run, out: Path, device, dtype, backend: str, total_steps: int):
    """SpecForge's drafter (its build_eagle3_draft: AutoDraftModel.from_config, the vocab mapping,
    the target's embedding frozen), OnlineEagle3Model, Eagle3TrainStrategy and BF16Optimizer.
    Returns (draft, strategy, optimizer, draft_config_path)."""
    import torch
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.optimizer import BF16Optimizer
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from eagle3_runner.models.draft_model import DraftConfig
    plain = DraftConfig(**{**run.cfg.as_dict(), "fc_norm": False, "norm_output": False})
    cfg_path = out / "draft_config.json"
    cfg_path.write_text(json.dumps(plain.to_sglang(), indent=1))
    torch.manual_seed(PEER_SEED)
    draft = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(cfg_path)),
                                       attention_backend=backend, torch_dtype=dtype)
    m = run.learner.model
    vocab = out / "vocab_mapping.pt"
    torch.save({"d2t": m.d2t.cpu(), "t2d": m.t2d.cpu()}, vocab)
    draft.load_vocab_mapping(str(vocab))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(m.embed_tokens)
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=dtype)
    model = OnlineEagle3Model(draft, length=run.ctx.params.ttt_steps, attention_backend=backend)
    head = TargetHead(run.learner.head, run.learner.eps, device, dtype)
    strategy = Eagle3TrainStrategy(model, target_head=head, ploss_decay=PEER_DECAY)
    opt = BF16Optimizer(model, lr=PEER_LR, max_grad_norm=PEER_CLIP, total_steps=total_steps,
                        warmup_ratio=PEER_WARMUP, lr_scheduler="cosine")
    return draft, strategy, opt, cfg_path


def check_imports(log) -> int:
    """Import every module of SPECFORGE_MODULES (and flex_attention, SpecForge's default attention
    backend); log each with its version or error. Returns 0 when all import, else 1."""
    import importlib
    bad = 0
    for name in SPECFORGE_MODULES + ("torch.nn.attention.flex_attention",):
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
            log(f"import {name}: ok ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 - every failure is reported
            bad += 1
            log(f"import {name}: FAILED ({type(e).__name__}: {e})")
    log(f"versions: {_versions()}")
    return 1 if bad else 0


def same_inputs(run, ours: dict | None) -> dict:
    """Whether SpecForge trains on what our train stage trained on: the draft vocab's cache key
    (trainer/vocab.py cache_key: the identity of every sample's token ids and loss masks, which
    samples, both vocab sizes), recorded by our stage in train_metrics.json, against this run's;
    and the sample counts. Missing ours: equal None."""
    if not ours:
        return {"equal": None, "why": "no train artifact of ours for this variant's train key"}
    key, theirs = (ours.get("vocab") or {}).get("key"), run.vstats.get("key")
    n_ours, n = (ours.get("summary") or {}).get("train_samples"), len(run.train_ids)
    out = {"vocab_key": theirs, "vocab_key_ours": key, "train_samples": n,
           "train_samples_ours": n_ours}
    out["equal"] = key is not None and key == theirs and n_ours == n
    return out


def order(train_ids: list[int], epochs: float, batch: int) -> list[list[int]]:
    """The sample ids of each optimizer step: a permutation per epoch from seed 42 + epoch (a
    fractional last epoch takes its first part), cut into batches; total = SpecForge's
    resolve_total_steps (num_samples // batch x epochs)."""
    import torch
    n = len(train_ids)
    total = int(n // batch * epochs)
    steps, e = [], 0
    while len(steps) < total:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(PEER_SEED + e)).tolist()
        steps += [[train_ids[i] for i in perm[a:a + batch]] for a in range(0, n - batch + 1, batch)]
        e += 1
    return steps[:total]


def train_batch(samples: list[dict], device, dtype):
    """SpecForge's TrainBatch of our samples: right-padded (its collator), attention_mask over
    the real tokens, loss_mask with the last position cleared (its preprocessing)."""
    import torch
    from specforge.runtime.contracts import TrainBatch
    T = max(int(s["input_ids"].numel()) for s in samples)

    def pad(x):  # right-pad dim 0 to T with zeros
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, T - x.shape[0]))
    ids = torch.stack([pad(s["input_ids"].long()) for s in samples])
    att = torch.stack([pad(torch.ones(s["input_ids"].numel(), dtype=torch.long))
                       for s in samples])
    lm = torch.stack([pad(s["loss_mask"].long()) for s in samples])
    lm[:, -1] = 0
    aux = torch.stack([pad(s["aux_hidden"]) for s in samples])
    last = torch.stack([pad(s["last_hidden"]) for s in samples])
    t = {"input_ids": ids, "attention_mask": att, "loss_mask": lm,
         "hidden_state": aux, "target": last}
    t = {k: v.to(device, dtype=dtype if v.is_floating_point() else None) for k, v in t.items()}
    return TrainBatch(sample_ids=[str(i) for i in range(len(samples))], strategy="eagle3",
                      tensors=t, metadata={"target_repr": "hidden_state"})


def train_specforge(run, strategy, opt, steps: list[list[int]], device, dtype,
                    max_minutes: float | None, log) -> dict:
    """The optimizer steps. Features are fetched 64 samples at a time (online: the target's
    capture) OUTSIDE the timed region; the timed region is SpecForge's forward_loss, backward and
    BF16Optimizer.step, synchronised at its ends. Returns the training summary."""
    import torch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_s, tokens, losses, done, cut = 0.0, 0, [], 0, False
    group = 64
    for a in range(0, len(steps), group):
        chunk = steps[a:a + group]
        flat = [i for s in chunk for i in s]
        feats = dict(zip(flat, run.source.batch(flat)))
        sync()
        t0 = time.perf_counter()
        for ids in chunk:
            out = strategy.forward_loss(train_batch([feats[i] for i in ids], device, dtype))
            out.loss.backward()
            opt.step()
            tokens += sum(int(feats[i]["input_ids"].numel()) for i in ids)
            done += 1
            if done % LOG_EVERY == 0 or done == len(steps):
                losses.append({"step": done, "loss": float(out.loss.detach()),
                               "acc": [float(x) for x in out.metrics["acces"]]})
        sync()
        step_s += time.perf_counter() - t0
        if losses and losses[-1]["step"] > a:
            log(f"specforge: step {done}/{len(steps)}, loss {losses[-1]['loss']:.3f}, acc_0 "
                f"{losses[-1]['acc'][0]:.3f}, {tokens / step_s:,.0f} tok/s")
        if max_minutes and step_s > 60 * max_minutes and done < len(steps):
            cut = True
            log(f"specforge: --max-minutes {max_minutes} spent after {done} of {len(steps)} "
                "steps: stopped (the cosine schedule did not finish)")
            break
    samples = len({i for s in steps[:done] for i in s})
    return {"steps": done, "planned_steps": len(steps), "cut": cut, "train_samples": samples,
            "tokens": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s if step_s else 0.0,
            "history": losses}


def held_out(run, draft) -> dict | None:
    """Our evaluation (trainer/evaluation.py evaluate: loss and top-1 accuracy per TTT step on the
    held-out samples) of SpecForge's weights, loaded into our drafter (the same tensor names)."""
    from eagle3_runner.trainer.evaluation import evaluate
    if not run.eval_ids:
        return None
    sd = {k: v for k, v in draft.state_dict().items() if "embed" not in k}
    m = run.learner.model
    missing, unexpected = m.load_state_dict({k: v.to(m.fc.weight.dtype) for k, v in sd.items()},
                                            strict=False)
    if unexpected or missing:
        raise RuntimeError(f"SpecForge's tensors vs ours: missing {missing}, unexpected "
                           f"{unexpected}")
    return evaluate(run.learner, run.source, run.eval_ids)


def export(draft, cfg_path: Path, dest: Path, out: Path, provenance: dict) -> str:
    """SpecForge's export_to_sglang of the trained weights (a training_state.pt as its
    checkpoint filter writes it: no embedding), then provenance.json. Returns "specforge" or,
    when its exporter fails on this machine, "ours: <why>" after writing the same tensors with
    jobs/export.py's writer (the names are identical; the exporter's failure is recorded)."""
    import torch
    from specforge.export.to_sglang import export_to_sglang
    sd = {k: v.detach().cpu() for k, v in draft.state_dict().items() if "embed" not in k.lower()}
    ckpt = out / "specforge-checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save({"strategy": "eagle3", "draft_state_dict": sd}, ckpt / "training_state.pt")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        export_to_sglang(str(ckpt / "training_state.pt"), str(cfg_path), str(dest))
        how = "specforge"
    except Exception as e:  # noqa: BLE001 - recorded; the bench still gets the same weights
        from safetensors.torch import save_file
        from eagle3_runner.jobs.export import sglang_tensors
        cfg = json.loads(cfg_path.read_text())
        save_file(sglang_tensors(sd, cfg), str(dest / "model.safetensors"),
                  metadata={"format": "pt"})
        (dest / "config.json").write_text(json.dumps(cfg, indent=1))
        how = f"ours: specforge's exporter failed ({type(e).__name__}: {e})"
    cfg = json.loads((dest / "config.json").read_text())
    want = json.loads(cfg_path.read_text())["eagle_config"]
    if cfg.get("eagle_config") != want:  # the aux ids must be where SGLang reads them
        cfg["eagle_config"] = want
        (dest / "config.json").write_text(json.dumps(cfg, indent=1))
        how += "; eagle_config written back"
    (dest / "provenance.json").write_text(json.dumps(provenance, indent=1, default=str))
    return how


def markdown(r: dict) -> str:
    sf, ours = r.get("specforge", {}), r.get("ours") or {}
    rows = [("samples", sf.get("train_samples"), ours.get("train_samples")),
            ("optimizer steps", sf.get("steps"), ours.get("train_steps")),
            ("tokens/s (optimizer steps)", sf.get("tokens_per_s"), ours.get("tokens_per_s"))]
    ev_sf, ev_o = r.get("held_out_specforge") or {}, r.get("held_out_ours") or {}
    for j, a in enumerate(ev_sf.get("acc_step", [])):
        b = ev_o.get("acc_step", [None] * (j + 1))
        rows.append((f"held-out acc_{j}", a, b[j] if j < len(b) else None))

    def f(v):
        return f"{v:,.3f}" if isinstance(v, float) else ("" if v is None else str(v))
    md = [f"# SpecForge 0.2.0 peer: {r.get('spec')} --variant {r.get('variant')}", "",
          "| | SpecForge 0.2.0 | ours |", "|---|---|---|"]
    md += [f"| {k} | {f(a)} | {f(b)} |" for k, a, b in rows]
    if r.get("tokens_per_s_ratio"):
        md += ["", f"ours / SpecForge tokens/s: {r['tokens_per_s_ratio']:.2f}x"]
    same = r.get("same_inputs") or {}
    md += ["", f"same samples as ours (draft-vocab key and count): {same.get('equal')}",
           f"export: {r.get('export')}; inspect errors: {r.get('inspect_errors')}",
           f"bench: `runner apply {r.get('spec')} --variant {r.get('variant')}` (its "
           f"stages.bench.drafter = {r.get('drafter')})"]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", nargs="?")
    ap.add_argument("--variant", default="base",
                    help="the spec variant whose train inputs and bench drafter path to use")
    ap.add_argument("-o", dest="overrides", action="append", default=[],
                    help="a spec override, as runner apply's -o (repeatable)")
    ap.add_argument("--out", help="folder for peer.json, peer.md, peer.log (required)")
    ap.add_argument("--export-to", help="the SGLang draft directory to write (default: the "
                    "variant's stages.bench.drafter, else OUT/drafter)")
    ap.add_argument("--batch-size", type=int, default=1, help="SpecForge's default: 1")
    ap.add_argument("--attention-backend", default="flex_attention",
                    help="SpecForge's default flex_attention (or sdpa)")
    ap.add_argument("--max-minutes", type=float, help="stop the optimizer steps after this long")
    ap.add_argument("--check-imports", action="store_true", help="import every SpecForge module "
                    "the run uses, print versions, exit 0 (all import) or 1")
    a = ap.parse_args(argv)
    if a.check_imports:
        return check_imports(lambda m: print(m, flush=True))
    if not a.spec or not a.out:
        ap.error("spec and --out are required (or --check-imports)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "peer.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    import torch
    if not torch.cuda.is_available():
        log("specforge_peer: needs CUDA: SpecForge 0.2.0's loss (LogSoftmaxLoss) is a Triton "
            "kernel and its trainer targets GPUs. Run it on the H200 (scripts/gpu/recipe.sh peer).")
        return 2
    rep = Report(out)
    rep.set(spec=a.spec, variant=a.variant, overrides=a.overrides, argv=sys.argv,
            machine=platform.node(), gpu=torch.cuda.get_device_name(0),
            versions=_versions(), batch_size=a.batch_size, attention_backend=a.attention_backend,
            started=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        from eagle3_runner.trainer.recipe import setup
        vspec, ctx, ours_dir = peer_context(a.spec, a.variant, a.overrides, out)
        t0 = time.perf_counter()
        run = setup(ctx, impl=None)
        p = ctx.params
        dest = Path(a.export_to or (vspec.stages.bench.drafter if vspec.stages.bench and
                                    vspec.stages.bench.drafter else out / "drafter"))
        from eagle3_runner.runner.files import expand_path
        dest = expand_path(str(dest))
        ours = _ours(ours_dir)
        rep.set(setup_s=time.perf_counter() - t0, train_samples=len(run.train_ids),
                eval_samples=len(run.eval_ids), epochs=p.epochs, ttt_steps=p.ttt_steps,
                draft_vocab_size=run.cfg.draft_vocab_size, max_length=vspec.data.max_length,
                features=p.features, ours=ours and ours["summary"], drafter=str(dest),
                held_out_ours=ours and ours["last_eval"], same_inputs=same_inputs(run, ours))
        if rep.data["same_inputs"]["equal"] is False:
            log(f"specforge_peer: NOT the samples our train stage trained on: "
                f"{rep.data['same_inputs']}")
        device = run.learner.device
        dtype = torch.bfloat16
        steps = order(run.train_ids, p.epochs, a.batch_size)
        draft, strategy, opt, cfg_path = build_specforge(run, out, device, dtype,
                                                         a.attention_backend, len(steps))
        log(f"specforge: {len(steps)} steps over {len(run.train_ids)} samples x {p.epochs} "
            f"epochs, batch {a.batch_size}, K {p.ttt_steps}, draft vocab "
            f"{run.cfg.draft_vocab_size}, {a.attention_backend}")
        sf = train_specforge(run, strategy, opt, steps, device, dtype, a.max_minutes, log)
        ratio = (ours["summary"]["tokens_per_s"] / sf["tokens_per_s"]
                 if ours and sf["tokens_per_s"] else None)
        rep.set(specforge=sf, tokens_per_s_ratio=ratio)
        try:
            rep.set(held_out_specforge=held_out(run, draft))
        except Exception as e:  # noqa: BLE001 - the evaluation is extra; keep going
            rep.set(held_out_specforge=f"failed: {type(e).__name__}: {e}")
        prov = {"trainer": "specforge 0.2.0 (scripts/bench/specforge_peer.py)",
                "spec": vspec.model_dump(mode="json"), "variant": a.variant,
                "features": {"aux_layer_ids": list(vspec.aux_ids),
                             "hf_hidden_indices": [k + 1 for k in vspec.aux_ids]},
                "train_metrics": {"summary": {k: sf[k] for k in (
                    "train_samples", "steps", "tokens", "tokens_per_s", "cut")}}}
        rep.set(export=export(draft, cfg_path, dest, out, prov))
        from eagle3_runner.runner.inspect import inspect_draft
        f = inspect_draft(dest, target=expand_path(vspec.target.path),
                          sglang_version=vspec.drafter.sglang_version)
        rep.set(inspect=[{"severity": x.severity, "code": x.code, "message": x.message}
                         for x in f],
                inspect_errors=[x.code for x in f if x.severity == "error"])
        log(markdown(rep.data))
    except Exception as e:  # noqa: BLE001 - every failure is recorded, with its traceback
        rep.set(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        log(traceback.format_exc())
        return 1
    finally:
        (out / "peer.md").write_text(markdown(rep.data))
        logf.close()
    return 0 if not rep.data.get("inspect_errors") else 1


def _ours(train_dir: Path | None) -> dict | None:
    """Our train artifact's summary and last held-out evaluation (train_metrics.json)."""
    if train_dir is None:
        return None
    try:
        m = json.loads((train_dir / "train_metrics.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    last = next((h for h in reversed(m.get("history", [])) if h.get("split") == "eval"), None)
    return {"summary": m.get("summary", {}), "last_eval": last, "vocab": m.get("vocab", {})}


def _versions() -> dict:
    from importlib import metadata
    out = {}
    for name in ("torch", "transformers", "triton", "specforge"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
