#!/usr/bin/env python
"""Capture throughput of a target split by target.device_map against the same target on one
GPU, in the same call (issue 24), and whether the features are identical.

    python scripts/bench/bench_split.py --out runs/bench-split                 # on a CUDA machine
    python scripts/bench/bench_split.py --device cpu --layers 4 --hidden 64 --batches 2 --out /tmp/b

The target is a random Llama of SmolLM2-135M's geometry (or --layers/--hidden), saved as an HF
folder in bf16 (CUDA) / float32 (CPU), so no download is needed. Modes, each loaded through
targets/load.py load_target (split_plan for the split ones) and run through targets/capture.py
capture on the same batches:
- one:   the whole target on cuda:0 (the reference);
- auto:  target.device_map auto over GPU group [0] (everything fits: accelerate's dispatch
         hooks with the max_memory the stage computes, on one GPU);
- cpu:   layers 0..L/2-1 on cuda:0, the rest in CPU memory (--map overrides), streamed to
         cuda:0 per forward by accelerate: what "GPU and CPU memory" costs.
tokens/s = real tokens / seconds, median over --rounds rounds of --batches batches of --batch
samples x --seq tokens (random ids), after one warm-up batch, CUDA synchronised. `equal` says
whether aux and last equal the `one` mode's bit for bit on the first batch. Writes
bench_split.json and bench_split.md into --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)


def stub_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` ids in `folder`: the loader loads one with the model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(vocab)}, unk_token="t0"))).save_pretrained(folder)


def random_llama(folder: Path, dtype, seed: int = 0, **geometry) -> Path:
    """A random LlamaForCausalLM (SmolLM2's geometry unless overridden) saved in `folder` with a
    stub tokenizer. Returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2, **geometry})).to(dtype)
    model.save_pretrained(folder)
    stub_tokenizer(folder, model.config.vocab_size)
    return folder


def parse_map(text: str) -> dict:
    """"0-14:0,15-29:cpu" -> {"0-14": 0, "15-29": "cpu"}."""
    out = {}
    for part in text.split(","):
        k, v = part.split(":")
        out[k.strip()] = int(v) if v.strip().isdigit() else v.strip()
    return out


def load(folder: Path, device: str, dtype: str, device_map=None):
    from eagle3_runner.targets.load import load_target
    from eagle3_runner.targets.split import split_plan
    from eagle3_runner.runner.spec.sections import Target
    t = Target(path=str(folder), device=device, dtype=dtype, device_map=device_map)
    gpus = [0] if device == "cuda" else []
    return load_target(t, split=split_plan(t, gpus) if device_map else None)[0]


def timed(model, batches, aux_ids, sync) -> float:
    from eagle3_runner.targets.capture import capture
    sync()
    t0 = time.perf_counter()
    for b in batches:
        capture(model, b, aux_ids)
    sync()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    ap.add_argument("--hidden", type=int, default=SMOLLM2["hidden_size"])
    ap.add_argument("--map", help="explicit layer map of the cpu mode, e.g. 0-14:0,15-29:cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_split: --device cuda but CUDA is not available")
    dtype = "bfloat16" if cuda else "float32"
    L, half = a.layers, a.layers // 2
    geometry = {"num_hidden_layers": L, "hidden_size": a.hidden}
    if a.hidden != SMOLLM2["hidden_size"]:
        geometry.update(num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
                        intermediate_size=2 * a.hidden, vocab_size=512)
    cpu_map = parse_map(a.map) if a.map else \
        {f"0-{half - 1}": 0 if cuda else "cpu", f"{half}-{L - 1}": "cpu" if cuda else "disk"}
    aux_ids = [1, L // 2 - 1, L - 4] if L >= 6 else [0, 1, 2]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        folder = random_llama(Path(tmp), getattr(torch, dtype), **geometry)
        models = {"one": load(folder, a.device, dtype), "auto": load(folder, a.device, dtype,
                                                                     "auto"),
                  "cpu": load(folder, a.device, dtype, cpu_map)}
        V = models["one"].config.vocab_size
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, V, (a.batch, a.seq), generator=g).tolist()
                   for _ in range(a.batches)]
        from eagle3_runner.targets.capture import capture
        ref = capture(models["one"], batches[0], aux_ids)
        equal = {}
        for name, m in models.items():
            got = capture(m, batches[0], aux_ids)  # also the warm-up
            equal[name] = bool(torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]))
        secs: dict[str, list[float]] = {k: [] for k in models}
        for _ in range(a.rounds):
            for name, m in models.items():
                secs[name].append(timed(m, batches, aux_ids, sync))
        maps = {k: getattr(m, "hf_device_map", None) for k, m in models.items()}
    tokens = a.batch * a.seq * a.batches
    rows = []
    for name in models:
        tps = tokens / statistics.median(secs[name])
        rows.append({"mode": name, "tokens_per_s": tps, "equal": equal[name],
                     "devices": sorted({str(v) for v in (maps[name] or {"": a.device}).values()}),
                     "seconds": secs[name]})
    one = rows[0]["tokens_per_s"]
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / one
    meta = {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "layers": L, "hidden": a.hidden, "cpu_map": cpu_map,
            "batch": a.batch, "seq": a.seq, "batches": a.batches, "rounds": a.rounds,
            "dtype": dtype}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_split.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"capture, {L} layers x {a.hidden}, {a.batch} x {a.seq} tokens x {a.batches} "
          f"batches, {dtype}, {meta['device']}; cpu map {cpu_map}", "",
          "| mode | devices | tokens/s | vs one GPU | features equal |", "|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {', '.join(r['devices'])} | {r['tokens_per_s']:,.0f} | "
           f"{r['ratio']:.2f} | {r['equal']} |" for r in rows]
    (a.out / "bench_split.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
