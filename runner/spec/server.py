"""What a spec may and may not pass to the SGLang servers the runner launches (the bench's,
`stages.bench.sglang`, and the target's, `target.sglang`): the flags the runner sets itself, each
with the spec field that sets it, and the loopback-only bind address. `extra_args` are appended
last to the server's argv (targets/sglang.py server_argv), so an extra `--speculative-algorithm
EAGLE` would silently override the runner's EAGLE3; these rules refuse that at validation. No
torch.
"""

from __future__ import annotations

import ipaddress

# flag the runner sets -> the spec field that sets it (targets/sglang.py server_argv)
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
# flag the runner sets on a target server (targets/sglang_target.py target_flags) -> the field
_T = "target.sglang"
TARGET_GUARDED_FLAGS = {
    "--model-path": "target.path",
    "--host": f"{_T}.host",
    "--port": f"{_T}.port",
    "--tp-size": f"{_T}.tp",
    "--ep-size": f"{_T}.ep",
    "--dp-size": f"{_T}.dp",
    "--dtype": "target.dtype",
    "--trust-remote-code": "target.trust_remote_code",
    "--mem-fraction-static": f"{_T}.mem_fraction_static",
    "--max-running-requests": f"{_T}.max_running_requests",
    "--cuda-graph-max-bs": f"{_T}.cuda_graph_max_bs",
    "--enable-return-hidden-states": "the runner's setting (on for capture servers)",
    "--disable-radix-cache": "the runner's setting (capture servers: a prefix hit would "
                             "misalign the captured rows)",
    "--chunked-prefill-size": "the runner's setting (capture servers: -1, a chunked prompt "
                              "would misalign the captured rows)",
    "--skip-tokenizer-init": "the runner's setting (it sends token ids, reads output_ids)",
    "--speculative-algorithm": "no speculation (a target server's hidden states and answers "
                               "are the plain target's)",
    "--cuda-graph-backend-prefill": "the runner's setting (capture servers: disabled)",
}
# aliases SGLang's parser accepts for the same settings
ALIASES = {"--model": "--model-path", "--tp": "--tp-size", "--tensor-parallel-size": "--tp-size",
           "--ep": "--ep-size", "--expert-parallel-size": "--ep-size",
           "--data-parallel-size": "--dp-size", "--cuda-graph-max-bs-decode": "--cuda-graph-max-bs"}
BENCH_FIELD = "stages.bench.sglang"


def guarded_flag(arg: str, flags: dict = GUARDED_FLAGS) -> str | None:
    """The flag of `flags` (default: the bench's) that the argv item `arg` would set, or None.
    `--flag=value`, `_` for `-`, aliases and unambiguous prefixes (argparse accepts
    abbreviations) all count."""
    if not arg.startswith("--") or len(arg) < 4:
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    name = ALIASES.get(name, name)
    if name in flags:
        return name
    hits = [f for f in flags if f.startswith(name)]
    return hits[0] if hits else None


def extra_args_problems(args: list[str], field: str = BENCH_FIELD,
                        flags: dict = GUARDED_FLAGS) -> list[str]:
    """One message per extra server argument that would override a flag the runner sets
    (`flags`, named in the message under `field`.extra_args)."""
    out = []
    for a in args:
        flag = guarded_flag(a, flags)
        if flag is not None:
            out.append(f"{field}.extra_args: {a!r} sets {flag}, which the runner "
                       f"sets itself; use {flags[flag]} instead (extra_args are "
                       "appended last and would override it).")
    return out


def host_problem(host: str, field: str = BENCH_FIELD) -> str | None:
    """Why `host` is not a loopback address (the servers have no authentication), or None."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"{field}.host = {host!r}: the servers the runner launches bind loopback only "
            "(127.0.0.1, ::1 or localhost); they have no authentication, so another address "
            "would expose them to the network.")


MAX_PORT = 65535
# SGLang 0.5.14 server_args.py (_handle_deprecated_args): grpc_port = $SGLANG_GRPC_PORT or
# --port + 10000, and a value past 65535 stops the server at start ("SGLANG_GRPC_PORT (67059)
# must be between 1 and 65535"), gRPC enabled or not: an HTTP port above 55535 never starts
# (seen on the H200, 2026-12-05, with a port the kernel picked)
GRPC_PORT_OFFSET = 10000
MAX_HTTP_PORT = MAX_PORT - GRPC_PORT_OFFSET
MIN_PORT = 1024  # stages.bench.sglang.port's lowest: below it ports need root


def ports_problem(port: int | None, parallel: int = 1,
                  field: str = "parallel") -> str | None:
    """Why the ports the bench's servers take from stages.bench.sglang.port would not work, or
    None: each of the `parallel` servers started at once takes two consecutive ports (HTTP,
    --nccl-port; targets/sglang_bench.py), so a wave takes port .. port + 2 x parallel - 1, and
    its last HTTP port, port + 2 x (parallel - 1), must be at most MAX_HTTP_PORT (55535: SGLang
    adds 10000 for its gRPC port). None (free ports picked per server) takes none. `field`: the
    field that sets the widest wave (parallel, or curve_parallel when that is larger). When no
    port from MIN_PORT fits the wave, the fix says how many servers any port fits instead of a
    port below MIN_PORT."""
    if port is None:
        return None
    last_http = port + 2 * (parallel - 1)
    if last_http <= MAX_HTTP_PORT:
        return None
    highest = MAX_HTTP_PORT - 2 * (parallel - 1)
    fix = (f"Set port to at most {highest}, lower {field}," if highest >= MIN_PORT else
           f"No port from {MIN_PORT} fits {parallel} servers at once: lower {field} to at most "
           f"{(MAX_HTTP_PORT - MIN_PORT) // 2 + 1},")
    return (f"{BENCH_FIELD}.port = {port}: {BENCH_FIELD}.{field} = {parallel} servers at once "
            f"take HTTP ports up to {last_http}, and SGLang 0.5.14 refuses to start when the HTTP "
            f"port + {GRPC_PORT_OFFSET} (its gRPC port) is past {MAX_PORT}. {fix} or leave port "
            f"out (free ports at most {MAX_HTTP_PORT} are picked per server).")
