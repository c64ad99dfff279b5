"""What a spec may and may not pass to the SGLang servers the bench launches
(`stages.bench.sglang`): the flags the runner sets itself, each with the spec field that sets it,
and the loopback-only bind address. `extra_args` are appended last to the server's argv
(target/sglang.py server_argv), so an extra `--speculative-algorithm EAGLE` would silently
override the runner's EAGLE3; these rules refuse that at validation. No torch.
"""

from __future__ import annotations

import ipaddress

# flag the runner sets -> the spec field that sets it (target/sglang.py server_argv)
GUARDED_FLAGS = {
    "--model-path": "target.path",
    "--host": "stages.bench.sglang.host",
    "--port": "stages.bench.sglang.port",
    "--tp-size": "stages.bench.sglang.tp",
    "--speculative-algorithm": "drafter.algorithm (always EAGLE3)",
    "--speculative-draft-model-path": "the export stage's output (the runner passes it)",
    "--speculative-num-steps": "stages.bench.configs[].num_steps",
    "--speculative-eagle-topk": "stages.bench.configs[].eagle_topk",
    "--speculative-num-draft-tokens": "stages.bench.configs[].num_draft_tokens",
    "--disable-cuda-graph": "stages.bench.cuda_graph",
    "--cuda-graph-max-bs": "stages.bench.sglang.cuda_graph_max_bs",
    "--context-length": "stages.bench.context_length",
    "--dtype": "target.dtype",
    "--mem-fraction-static": "stages.bench.sglang.mem_fraction_static",
    "--nccl-port": "stages.bench.sglang.port (the runner picks free ports)",
}
# aliases SGLang's parser accepts for the same settings
ALIASES = {"--model": "--model-path", "--tp": "--tp-size", "--tensor-parallel-size": "--tp-size"}


def guarded_flag(arg: str) -> str | None:
    """The guarded flag that the argv item `arg` would set, or None. `--flag=value`, `_` for
    `-`, aliases and unambiguous prefixes (argparse accepts abbreviations) all count."""
    if not arg.startswith("--") or len(arg) < 4:
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    name = ALIASES.get(name, name)
    if name in GUARDED_FLAGS:
        return name
    hits = [f for f in GUARDED_FLAGS if f.startswith(name)]
    return hits[0] if hits else None


def extra_args_problems(args: list[str]) -> list[str]:
    """One message per extra server argument that would override a flag the runner sets."""
    out = []
    for a in args:
        flag = guarded_flag(a)
        if flag is not None:
            out.append(f"stages.bench.sglang.extra_args: {a!r} sets {flag}, which the runner "
                       f"sets itself; use {GUARDED_FLAGS[flag]} instead (extra_args are "
                       "appended last and would override it).")
    return out


def host_problem(host: str) -> str | None:
    """Why `host` is not a loopback address (the servers have no authentication), or None."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"stages.bench.sglang.host = {host!r}: the bench servers bind loopback only "
            "(127.0.0.1, ::1 or localhost); they have no authentication, so another address "
            "would expose them to the network.")
