"""What the bench says about the drafter's training (stages.bench.curve, and the predicted
acceptance of every chain configuration). No torch.

Two comparisons, both from trainer/acceptance.py's simulated greedy chains:
- Train and serve agree: per chain configuration, the acceptance per draft position the engines
  measured (bench_summary.accept_per_pos) next to the simulation on the SAME text (the plain
  greedy decode of the bench's prompts: sim_tau, sim_accept_per_pos) and on held-out text of
  the target's own (the train stage's evaluation of the exported drafter: heldout_tau,
  heldout_accept_per_pos). Measured against sim is the train/serve check (features, positions,
  masks at TTT steps >= 1): the simulation is what serving does when they agree, so a position
  that falls well short is flagged (`mismatch_flag`). Held-out against sim is the text: other
  prompts, not a bug.
- The learning curve: the train stage's kept drafters (stages.train.snapshots; export writes
  them under snapshots/), `curve_snapshots` of them, each at the first configuration (a chain):
  its simulated tau on the bench's text (backend embedded, how "simulated") and, with an SGLang
  backend, SGLang's measured accept (backend sglang, how "measured"), against the optimizer
  steps and distinct samples it had seen: table bench_curve (runner/store.py); runner/report.py
  draws it with the break-even line of each engine.
"""

from __future__ import annotations

import json
from pathlib import Path

SNAPSHOTS = "snapshots"  # the kept drafters' folder, in the train artifact and in the export's


def snapshot_name(step: int) -> str:
    """The name of optimizer step `step`'s kept drafter: step-NNNNNN (a .safetensors file in
    the train artifact, an SGLang draft folder in the export's)."""
    return f"step-{step:06d}"


def snapshot_step(name: str) -> int:
    """The optimizer step of a kept drafter's file or folder stem (snapshot_name's inverse)."""
    return int(name.removeprefix("step-"))


MISMATCH_REL = 0.15  # a measured position this far below the simulation (relative) ...
MISMATCH_ABS = 0.03  # ... and this far in absolute terms (~7 standard errors at 80 x 256 tokens)


def read_provenance(draft_dir: Path) -> dict:
    """An export's (or a snapshot's) provenance.json, {} when absent or unreadable."""
    try:
        return json.loads((Path(draft_dir) / "provenance.json").read_text())
    except (OSError, ValueError):
        return {}


def heldout_chain(export_dir: Path, num_steps: int) -> dict | None:
    """The exported drafter's simulated chain of `num_steps` steps on the train stage's held-out
    samples ({tau, accept_per_pos, rounds}, trainer/acceptance.py summarize): the evaluation of
    the step it was taken from (train_metrics.selected, else the last); None when the export has
    no such evaluation (older exports, evaluation on the training set only still counts)."""
    m = read_provenance(export_dir).get("train_metrics") or {}
    hist = m.get("history") or []
    if not hist:
        return None
    step = (m.get("selected") or {}).get("step", hist[-1].get("step"))
    h = next((h for h in hist if h.get("step") == step), hist[-1])
    return (h.get("chain") or {}).get(str(num_steps))


def mismatch_flag(measured: list[float], simulated: list[float]) -> str | None:
    """A flag when the engine's acceptance at some draft position falls short of the simulation
    on the same text by more than MISMATCH_REL relative and MISMATCH_ABS absolute: the first
    such position, both values, and what it suggests; None when they agree."""
    for i, (m, s) in enumerate(zip(measured, simulated)):
        if s - m > MISMATCH_ABS and m < s * (1 - MISMATCH_REL):
            return (f"train/serve mismatch: draft position {i} accepted {m:.3f} against "
                    f"{s:.3f} simulated on the same text (features, positions or masks at TTT "
                    f"step {i} differ between training and serving)")
    return None


def curve_snapshots(export_dir: Path, n: int) -> list[dict]:
    """Up to n of the export's snapshot drafters (snapshots/step-NNNNNN/), evenly spaced by
    position in step order, always with the last and the selected one: [{step, dir, samples,
    tokens, selected, heldout (the evaluation's simulated chains)}] in step order; [] when n is
    0 or the export has none."""
    dirs = sorted(Path(export_dir).glob(f"{SNAPSHOTS}/step-*/"))
    if n <= 0 or not dirs:
        return []
    snaps = []
    for d in dirs:
        prov = read_provenance(d)
        h = prov.get("snapshot") or {}
        snaps.append({"step": snapshot_step(d.name), "dir": d,
                      "samples": h.get("samples"), "tokens": h.get("tokens"),
                      "selected": bool(prov.get("selected")), "heldout": h.get("chain") or {}})
    if len(snaps) <= n:
        return snaps
    idx = {round(i * (len(snaps) - 1) / max(n - 1, 1)) for i in range(n)}
    idx |= {i for i, s in enumerate(snaps) if s["selected"]}
    return [snaps[i] for i in sorted(idx)]


def curve_row(cfg: dict, snap: dict, backend: str, how: str, tau: float,
              accept_per_pos: list[float], rounds: int, n_prompts: int,
              server_accept_length: float | None = None) -> dict:
    """One `bench_curve` row: snapshot `snap` (curve_snapshots) at configuration `cfg`
    (config_fields of configs[0]); how = "simulated" (trainer/acceptance.py on the bench's plain
    decode) or "measured" (an SGLang server's responses)."""
    n = cfg["num_steps"]
    held = (snap.get("heldout") or {}).get(str(n)) or {}
    return {k: cfg[k] for k in ("prompt_set", "num_steps", "eagle_topk", "num_draft_tokens",
                                "cuda_graph", "max_new_tokens", "temperature")} | {
        "backend": backend, "how": how, "snapshot_step": snap["step"],
        "train_samples": snap.get("samples"), "train_tokens": snap.get("tokens"),
        "selected": snap.get("selected"), "n_prompts": n_prompts, "rounds": rounds, "tau": tau,
        "accept_per_pos": json.dumps(accept_per_pos),
        "server_accept_length": server_accept_length, "heldout_tau": held.get("tau")}


def predicted(summaries: list[dict], export_dir: Path, sims: dict) -> None:
    """Each chain summary gets what the drafter's training predicts (in place):
    heldout_* (the train stage's simulation on its held-out samples) and, where this stage
    simulated it, sim_* (on its own plain decode; sims {(prompt_set, max_new, num_steps):
    trainer/acceptance.py summarize}); an engine that accepts well below sim_* is flagged."""
    for s in summaries:
        if s.get("eagle_topk") != 1 or not s.get("n_prompts"):
            continue
        held = heldout_chain(export_dir, s["num_steps"])
        if held:
            s["heldout_tau"], s["heldout_accept_per_pos"] = (held["tau"],
                                                             json.dumps(held["accept_per_pos"]))
        sim = sims.get((s["prompt_set"], s["max_new_tokens"], s["num_steps"]))
        if not sim:
            continue
        s["sim_tau"], s["sim_accept_per_pos"] = sim["tau"], json.dumps(sim["accept_per_pos"])
        if s["backend"] == "embedded":  # SGLang's own text differs from ours at near-ties
            flag = mismatch_flag(json.loads(s["accept_per_pos"]), sim["accept_per_pos"])
            if flag:
                s["flags"] = ", ".join(x for x in [s.get("flags"), flag] if x)
        s["explanation"] += (f" Simulated on the plain decode's text (trainer/acceptance.py, "
                             f"what serving accepts when training and serving agree): tau "
                             f"{sim['tau']:.3f}, per position "
                             f"{[round(a, 3) for a in sim['accept_per_pos']]}"
                             + (f"; on held-out training text {held['tau']:.3f}" if held else "")
                             + ".")
