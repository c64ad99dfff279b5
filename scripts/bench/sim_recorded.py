#!/usr/bin/env python3
"""Train against serve on the bench's own text: a drafter's simulated greedy chains over the text a
recorded plain SGLang server wrote, next to the accept lengths the speculative servers measured.

    python scripts/bench/sim_recorded.py --spec specs/smollm2-pays-gpu.yaml --drafter DIR \
        --sglang BENCH_SGLANG_DIR [--steps 3,5] [--prompts 80] [--device cpu]

BENCH_SGLANG_DIR: a bench stage's `sglang/` folder (runs/<spec>/bench/<key>/sglang, in the
sglang-rec.tgz scripts/gpu/pays.sh brings back), holding `plain-cg1/generate.jsonl` (each prompt's
input_ids and SGLang's greedy output_ids) and one `s<N>-k1-n<N+1>-cg1/` folder per chain it
measured. DIR: an exported drafter (config.json + model.safetensors).

Why: SGLang 0.5.14 reports only a request's accept length, not which draft position failed, so
the bench's SGLang-only rows cannot say whether a tau below the training's held-out simulation is
the text (MT-bench's prompts are not the regenerated set's) or a train/serve mismatch of features,
positions or masks at TTT steps >= 1. trainer/acceptance.py simulate is exact for greedy chains
on the target's own greedy text: run on the very text SGLang's plain server wrote, its tau is
what a drafter that serves as it trained must reach. Equal (up to numerics: this runs the target
in the spec's dtype on --device, SGLang ran bfloat16 on a GPU) = no mismatch, the gap is the text;
SGLang well below = a mismatch. Prints one line per chain: simulated tau and per-position
acceptance, SGLang's tau (its accept length over the recorded requests) and per-position acceptance (its
spec_accept_histogram), and the difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def load_recorded(folder: Path, prompts: int) -> list[tuple[list[int], int]]:
    """[(prompt ids + SGLang's output ids, index of the first generated token)] of the first
    `prompts` requests of a recorded server (generate.jsonl: request.input_ids,
    response.output_ids). Raises SystemExit naming the file when it is missing, holds no request,
    a line that is not a recorded request, or one without output_ids (a server that never became
    ready)."""
    from eagle3_runner.targets.sglang_bench import read_recording
    f = folder / "generate.jsonl"
    if not f.is_file():
        sys.exit(f"sim_recorded: {f} not found: --sglang must be a bench stage's sglang/ folder")
    try:
        recs = read_recording(folder)[:prompts]
    except (OSError, ValueError) as e:
        sys.exit(f"sim_recorded: {e}: --sglang must be a bench stage's sglang/ folder as the "
                 "stage wrote it")
    out = []
    for r in recs:
        ids, gen = r["request"].get("input_ids"), r["response"].get("output_ids")
        if not isinstance(ids, list) or not gen:
            sys.exit(f"sim_recorded: {f}: request {r.get('prompt_id')} has no input_ids or no "
                     "output_ids")
        out.append((list(ids) + list(gen), len(ids)))
    if not out:
        sys.exit(f"sim_recorded: {f} holds no recorded request (a server that never answered)")
    return out


def drafter_problem(folder: Path) -> str | None:
    """Why `folder` is not an exported drafter (config.json + model.safetensors), or None."""
    if not folder.is_dir():
        return f"--drafter {folder} is not a folder"
    missing = [n for n in ("config.json", "model.safetensors") if not (folder / n).is_file()]
    if missing:
        return (f"--drafter {folder} has no {' or '.join(missing)}: give an exported drafter "
                "(runs/<spec>/export/<key>/, or one `runner convert` wrote)")
    return None


def drafter_errors(folder: Path) -> str | None:
    """The first error `runner inspect` finds in the drafter at `folder` (its config.json and
    weights as SGLang would read them: runner/inspect.py inspect_draft), or None."""
    from eagle3_runner.runner.inspect import inspect_draft
    bad = [f for f in inspect_draft(folder) if f.severity == "error"]
    if not bad:
        return None
    return (f"--drafter {folder} is not a drafter SGLang would load ({bad[0].code}: "
            f"{bad[0].message}); `runner inspect {folder}` lists every finding")


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return v


def chain_lengths(text: str) -> list[int]:
    """argparse type of --steps: comma-separated integers >= 1, sorted, each once."""
    return sorted({positive(s.strip()) for s in text.split(",")})


def sglang_accept(folder: Path, prompts: int, num_steps: int) -> tuple[float, list[float]] | None:
    """(tau, per-position acceptance) over a speculative server's first `prompts` recorded
    requests: targets/sglang.py tau_from_meta (1 + accepted drafts / verify passes) and
    accept_per_pos_from_meta (SGLang 0.5.14's spec_correct_drafts_histogram). None when the
    folder is missing; SystemExit naming the file when its requests are not a speculative
    server's."""
    from eagle3_runner.targets.sglang import accept_per_pos_from_meta, tau_from_meta
    from eagle3_runner.targets.sglang_bench import read_recording
    f = folder / "generate.jsonl"
    if not f.is_file():
        return None
    try:
        metas = [r["response"]["meta_info"] for r in read_recording(folder)[:prompts]]
        return tau_from_meta(metas), accept_per_pos_from_meta(metas, num_steps)
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"sim_recorded: {f}: not a speculative server's recorded requests ({e})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--drafter", required=True, type=Path)
    ap.add_argument("--sglang", required=True, type=Path)
    ap.add_argument("--steps", default="3,5", type=chain_lengths,
                    help="chain lengths (num_steps), comma-separated")
    ap.add_argument("--prompts", type=positive, default=80)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    if (why := drafter_problem(a.drafter)) is not None:
        sys.exit(f"sim_recorded: {why}")
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("sim_recorded: --device cuda: torch sees no CUDA device here; use --device cpu")
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.targets.load import load_target
    from eagle3_runner.trainer.acceptance import simulate, summarize
    steps = a.steps
    texts = load_recorded(a.sglang / "plain-cg1", a.prompts)
    spec = load_spec(a.spec)
    if (why := drafter_errors(a.drafter)) is not None:
        sys.exit(f"sim_recorded: {why}")
    hf, _tok, _cfg = load_target(spec, device=a.device)
    dtype = next(hf.parameters()).dtype
    embed = hf.get_input_embeddings().weight
    draft = load_exported(a.drafter, embed, device=a.device, dtype=dtype)
    eps = float(getattr(hf.config, "rms_norm_eps", 1e-5))
    with torch.inference_mode():
        # the layers the drafter reads are its own config's (eagle_config), not the spec's
        hists = simulate(draft, hf, texts, list(draft.config.aux_layer_ids), steps, eps)
    print(f"{len(texts)} recorded plain answers ({sum(len(t) - s for t, s in texts):,} tokens), "
          f"target {dtype} on {a.device}")
    for n in steps:
        sm = summarize(hists[n])
        sg = sglang_accept(a.sglang / f"s{n}-k1-n{n + 1}-cg1", a.prompts, n)
        pos = ", ".join(f"{x:.3f}" for x in sm["accept_per_pos"])
        vs = ("SGLang not recorded" if sg is None else f"SGLang {sg[0]:.3f} "
              f"[{', '.join(f'{x:.3f}' for x in sg[1])}] ({sg[0] - sm['tau']:+.3f})")
        print(f"chain {n}: simulated tau {sm['tau']:.3f} [{pos}] over {sm['rounds']} rounds; {vs}")
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))  # a spec, target or device error: one `error:` line
