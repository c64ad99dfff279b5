#!/usr/bin/env python
"""Warm a spec's bench compile cache before its drafter exists: the bench stage's engines
(jobs/bench.py build_engines, the same code and shapes) built and warmed up with a RANDOM drafter
of the geometry the train stage will export, so that the real bench finds inductor's compiled
graphs in the on-disk cache (TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_$USER by default) and
builds each engine in seconds instead of about a minute (BENCHMARKS.md: 165 s for the baselines
and ~60 s per configuration cold on the H200, 9-11 s warm). Run it beside the train stage on the
same machine (scripts/gpu/pays.sh train): the compile is mostly CPU work.

    python scripts/bench/warm_bench.py specs/smollm2-pays-gpu.yaml [-o stages.bench.num_prompts=8]

Prints each engine's build time; exits 0, or 1 with one error line (runner/errors.py exit_code).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("-o", dest="overrides", action="append", default=[],
                    help="spec override, as runner apply -o")
    a = ap.parse_args(argv)
    import torch

    from eagle3_runner.data.prompts import load_prompt_set, render
    from eagle3_runner.jobs.bench import build_engines
    from eagle3_runner.jobs.export import sglang_config
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.targets.load import end_of_turn_ids, load_target
    t0 = time.perf_counter()
    spec = load_spec(a.spec, overrides=a.overrides)
    p = spec.stages.bench
    hf, tok, tcfg = load_target(spec)
    w = next(hf.parameters())
    target = from_hf_model(hf, spec.aux_ids)
    # the config export writes and the bench loads (models/draft_model.py load_exported)
    cfg = DraftConfig.from_sglang(sglang_config(DraftConfig.from_spec(spec, tcfg), tcfg,
                                                p.context_length))
    torch.manual_seed(0)
    drafter = Eagle3Draft(cfg, target.embed_tokens.weight.to(w.dtype))
    with torch.no_grad():  # a valid draft vocab: the first draft_vocab_size target ids
        drafter.t2d[:cfg.draft_vocab_size] = True
    drafter = drafter.to(device=w.device, dtype=w.dtype).eval()
    stop = end_of_turn_ids(spec, tok)
    sets = {s: [(q["id"], torch.tensor([render(tok, q["messages"])], device=w.device))
                for q in load_prompt_set(s, spec, p.num_prompts)] for s in p.prompt_sets}
    print(f"warm_bench: target and prompts loaded in {time.perf_counter() - t0:.1f} s",
          flush=True)
    for cg in p.cuda_graph:
        build_engines(p, target, drafter, sets, stop, cg)
    print(f"warm_bench: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
