"""Tiny extract artifacts (real format, written by jobs/extract.py's own functions on a tiny random
HF Llama) and train-stage contexts, for the train/vocab/overfit tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tiny_extract(root: Path, n_samples=6, lengths=(12, 30), vocab=96, hidden=32, layers=4,
                 aux_ids=(0, 1, 2), seed=0, shard_samples=4, token_range=None,
                 head_scale=8.0, edit=None) -> Path:
    """Write an extract artifact for random conversations-like samples: the first third of each
    sample is prompt (loss_mask 0), the rest assistant (1). head_scale sharpens the target's
    next-token distribution (a random tiny target is otherwise nearly uniform); edit(model), when
    given, may change the target's weights before extraction. Returns root."""
    from engine_helpers import tiny_hf_llama
    from eagle3_runner.jobs.extract import extract_samples, write_target_parts
    from eagle3_runner.targets.features import FORMAT, MANIFEST
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_llama(vocab=vocab, hidden=hidden, layers=layers, heads=4, kv=2, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        if edit is not None:
            edit(model)
    g = torch.Generator().manual_seed(seed)
    lo, hi = token_range or (3, vocab)
    samples = []
    for _ in range(n_samples):
        T = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        ids = torch.randint(lo, hi, (T,), generator=g).tolist()
        mask = [0] * (T // 3) + [1] * (T - T // 3)
        samples.append((ids, mask))
    res = extract_samples(model, samples, list(aux_ids), root, shard_samples, 256, 0,
                          progress=False)
    cfg = model.config.to_dict()
    write_target_parts(model, cfg, root)
    manifest = {"format": FORMAT, "aux_layer_ids": list(aux_ids),
                "hf_hidden_indices": [k + 1 for k in aux_ids], "hidden_size": hidden,
                "feature_width": len(aux_ids) * hidden, "dtype": "float32",
                "num_samples": n_samples, "shards": res["shards"]}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    seal_artifact(root, "extract")
    return root


def seal_artifact(root: Path, stage: str) -> None:
    """Write artifact.json (what runner/stage.py finalize writes), so that run_stage accepts
    `root` as a completed input artifact (it verifies every file against it)."""
    from eagle3_runner.runner.files import sha256_file
    from eagle3_runner.runner.stage import MANIFEST as ARTIFACT
    files = sorted(p for p in Path(root).rglob("*") if p.is_file() and p.name != ARTIFACT)
    rel = {str(p.relative_to(root)): p for p in files}
    (Path(root) / ARTIFACT).write_text(json.dumps({
        "stage": stage, "files": {k: sha256_file(p) for k, p in rel.items()},
        "sizes": {k: p.stat().st_size for k, p in rel.items()}}))


def train_spec(vocab=96, hidden=32, layers=4, aux_ids=(0, 1, 2), draft_vocab=40, device="cpu",
               **train):
    """A validated Spec for a tiny target (geometry declared; no model file needed); device: its
    target.device, where the train stage runs."""
    from eagle3_runner.runner.spec.load import load_spec
    t = {"ttt_steps": 3, "batch_size": 2, "lr": 3e-3, "warmup_steps": 2, "eval_every": 2,
         "eval_samples": 2, "checkpoint_every": 2, "seed": 0, "epochs": 2.0}
    t.update(train)
    data = {"name": "tiny",
            "target": {"path": "/nonexistent/tiny", "num_hidden_layers": layers,
                       "hidden_size": hidden, "vocab_size": vocab, "max_position_embeddings": 512,
                       "device": device},
            "drafter": {"draft_vocab_size": draft_vocab, "aux_layer_ids": list(aux_ids)},
            "stages": {"extract": {}, "train": t}}
    return load_spec(data=data, check_target=False)


def train_ctx(spec, extract_dir: Path, out_dir: Path, db: Path):
    from eagle3_runner.runner.stage import StageContext
    return StageContext(spec=spec, stage="train", variant="base", run_id="test",
                        inputs={"extract": Path(extract_dir)}, out_dir=Path(out_dir),
                        db_path=Path(db))
