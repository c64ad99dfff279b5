"""The conformance lab: one good exported draft broken on purpose (runner/drafts/lab.py CASES),
what our checks say about each variant BEFORE any server (`runner inspect` with the server line
and SGLang's version, the spec's rules on the same settings), then what a real SGLang does with
it: each variant served (many servers at once on the one GPU, free ports, a small memory
fraction, a timeout each), the same few prompts sent, and per row: loaded silently, loaded with
new warnings, refused (its error line), crashed or hung; its accept length; whether our checks
caught it; the claims of runner/drafts/rules.py and the inspector confirmed or corrected.
scripts/gpu/sglang_lab.py is the command; the recordings use the bench's layout
(targets/sglang_bench.py), so scripts/gpu/sglang_fixtures.py turns them into test fixtures.
No torch here (the target's tokenizer is loaded by the caller).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_runner.runner.drafts.checks import spec_draft_tokens_problem
from eagle3_runner.runner.drafts.lab import (BY_NAME, CASES, VERSION, Case, claims_map, outcome,
                                             verdict, write_variant)
from eagle3_runner.runner.drafts.layout import ALGORITHM
from eagle3_runner.runner.drafts.server import simulate_acc_len_problem
from eagle3_runner.runner.errors import ServerError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.runner.inspect import inspect_draft
from eagle3_runner.runner.spec.server import extra_args_problems
from eagle3_runner.targets.sglang import (error_line, free_ports, generate, launch, server_argv,
                                         server_accept_length, server_info, stop_all,
                                         tau_from_meta, wait_ready)
from eagle3_runner.targets.sglang_bench import INFO_KEYS, record


@dataclass
class LabSettings:
    """How every lab server runs. model: the target's HF folder; target: its config dict;
    shape: (num_steps, eagle_topk, num_draft_tokens) unless a case overrides it; prompts:
    [(prompt_id, input_ids)]; extra: launch flags for every server (attention backend...);
    stop_ids: the target's end-of-turn ids (targets/load.py end_of_turn_ids), sent as
    stop_token_ids."""

    python: str
    model: str
    target: dict
    prompts: list
    shape: tuple = (3, 1, 4)
    max_new: int = 128
    host: str = "127.0.0.1"
    dtype: str = "bfloat16"
    mem_fraction_static: float | None = 0.5
    cuda_graph_max_bs: int | None = 1
    extra: list = field(default_factory=list)
    timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    parallel: int = 32
    stop_ids: tuple = ()


def case_argv(case: Case, draft: Path, port: int, nccl: int, st: LabSettings) -> list[str]:
    """The launch_server argv of a case: the bench's server line (targets/sglang.py server_argv)
    with the case's algorithm, shape and extra flags."""
    K, k, N = case.server.get("shape", st.shape)
    return server_argv(st.python, st.model, port, st.host, 1, str(draft), K, k, N, True,
                       st.cuda_graph_max_bs, None, list(st.extra) + case.server.get("extra", []),
                       dtype=st.dtype, mem_fraction_static=st.mem_fraction_static,
                       nccl_port=nccl, algorithm=case.server.get("algorithm", ALGORITHM))


def server_line(case: Case, argv: list[str]) -> str:
    """The line `runner inspect --server-args` reads: the case's environment as leading
    VAR=value words, then the argv."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in case.env.items()) + \
        (" " if case.env else "") + shlex.join(argv)


def spec_says(case: Case, st: LabSettings) -> list[str]:
    """What a spec asking for the case's server settings would be told at validation (the
    stages.bench rules: the draft-token bound, extra_args, drafter.algorithm) and what the
    bench stage refuses to run under (SGLANG_SIMULATE_ACC_LEN)."""
    K, k, N = case.server.get("shape", st.shape)
    out = [m for m in [spec_draft_tokens_problem(K, k, N)] if m]
    out += extra_args_problems(case.server.get("extra", []))
    alg = case.server.get("algorithm", ALGORITHM)
    if alg != ALGORITHM:
        out.append(f"drafter.algorithm = {alg!r}: must be exactly 'EAGLE3'")
    sim = simulate_acc_len_problem(case.env)
    if sim:
        out.append(f"bench: {sim}")
    return out


def prepare(good: Path, work: Path, st: LabSettings, names=None) -> list[dict]:
    """Write every case's variant under work/variants/<case> and check it (inspect with the
    case's server line on SGLang VERSION, the spec's rules): the rows, before any server.
    we_said_error = inspect's errors for VERSION (the spec's rules are shown beside them: they
    hold every version the table knows, e.g. `eagle3` is refused for 0.5.6's sake)."""
    rows = []
    for case in (BY_NAME[n] for n in names) if names else CASES:
        d = write_variant(case, Path(good), Path(work) / "variants" / case.name, st.target)
        argv = case_argv(case, d, 0, 0, st)
        found = inspect_draft(d, st.model, server_line(case, argv), sglang_version=VERSION)
        said = spec_says(case, st)
        rows.append({"case": case.name, "what": case.what, "dir": str(d),
                     "expect": list(case.expect), "harm": case.harm,
                     "inspect": [f.as_dict() for f in found], "spec": said,
                     "we_said_error": any(f.severity == "error" for f in found)})
    return rows


def _serve_one(row: dict, srv, st: LabSettings, rec: Path) -> None:
    """Wait for one lab server, send the prompts, fill the row (never raises)."""
    row.update(ready=False, hung=False, error=None, tau=None, server_accept_length=None,
               answered=0, asked=len(st.prompts), info={})
    try:
        wait_ready(srv, st.timeout_s, poll_s=1.0)
        row.update(ready=True, ready_s=round(srv.ready_s, 1))
        info = server_info(srv.url)
        row["info"] = {k: info[k] for k in INFO_KEYS if k in info}
        atomic_write(rec / "server_info.json", json.dumps(row["info"], indent=1))
        metas = []
        with open(rec / "generate.jsonl", "w") as f:
            for pid, ids in st.prompts:
                r, dt = generate(srv.url, ids, st.max_new, 0.0, st.request_timeout_s, st.stop_ids)
                f.write(json.dumps(record("mtbench", pid, st.max_new, ids, 0.0, st.stop_ids, r,
                                          dt)) + "\n")
                metas.append(r["meta_info"])
                row["answered"] += 1
        row["tau"] = tau_from_meta(metas)
        row["server_accept_length"] = server_accept_length(metas)
        if srv.proc.poll() is not None:
            row["error"] = f"the server exited with code {srv.proc.returncode} after answering"
    except ServerError as e:
        row["hung"] = row["ready"] is False and "not ready after" in str(e)
        row["error"] = error_line(e.log_tail) or str(e).splitlines()[0]
    except (OSError, ValueError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
    row["error_line"] = error_line(srv.log_text())


def serve(rows: list[dict], st: LabSettings, rec_root: Path) -> None:
    """Serve every prepared row, st.parallel servers at a time, and fill its server fields;
    recordings under rec_root/<case>/ (argv.json, server.log, server_info.json,
    generate.jsonl). Servers are stopped whatever happens."""
    for i in range(0, len(rows), st.parallel):
        wave = rows[i:i + st.parallel]
        ports = free_ports(2 * len(wave), st.host)
        servers = []
        try:
            for j, row in enumerate(wave):
                case, rec = BY_NAME[row["case"]], Path(rec_root) / row["case"]
                rec.mkdir(parents=True, exist_ok=True)
                argv = case_argv(case, Path(row["dir"]), ports[2 * j], ports[2 * j + 1], st)
                row["argv"] = argv
                atomic_write(rec / "argv.json", json.dumps(argv, indent=1))
                servers.append(launch(row["case"], argv, st.host, ports[2 * j],
                                      rec / "server.log", {**os.environ, **case.env}))
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda rs: _serve_one(rs[0], rs[1], st,
                                                    Path(rec_root) / rs[0]["case"]),
                              zip(wave, servers)))
        finally:
            stop_all(servers)


_STAMP = re.compile(r"^\[[^\]]*\]\s*|\d+(\.\d+)?")


def _warnings(log: str) -> set[str]:
    """A log's warning lines with timestamps and numbers blanked (to compare two servers')."""
    return {_STAMP.sub("#", ln).strip() for ln in log.splitlines() if "warn" in ln.lower()}


def judge(rows: list[dict], rec_root: Path) -> list[dict]:
    """Fill observed / verdict / caught / new_warnings per row (against the `good` row) and
    return the claims map (runner/drafts/lab.py claims_map)."""
    good = next((r for r in rows if r["case"] == "good"), {})
    good_tau = good.get("tau")
    base = _warnings(_read(Path(rec_root) / "good" / "server.log"))
    for r in rows:
        if "ready" not in r:  # not served (a dry run)
            r.update(observed=None, verdict="not served", caught="-", new_warnings=[])
            continue
        r["observed"] = outcome(r["ready"], r["error"], r["answered"] == r["asked"], r["tau"],
                                good_tau, r["hung"])
        r.update(verdict(BY_NAME[r["case"]], r["observed"], r["we_said_error"]))
        mine = _warnings(_read(Path(rec_root) / r["case"] / "server.log"))
        r["new_warnings"] = sorted(mine - base)[:3]
    return claims_map([r for r in rows if r.get("observed") is not None])


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def _sglang_cell(r: dict) -> str:
    if r.get("observed") is None:
        return r.get("verdict", "")
    if not r["ready"]:
        return ("hung (not ready in time)" if r["hung"] else "refused: ") + \
            (r.get("error") or "")[:160]
    if r["error"]:
        return f"crashed: {r['error'][:160]}"
    w = r.get("new_warnings") or []
    n = r.get("info", {}).get("speculative_num_draft_tokens")
    return ("loaded, new warnings: " + "; ".join(x[:100] for x in w) if w else
            "loaded silently") + (f" (serves num_draft_tokens {n})" if n is not None else "")


def markdown(rows: list[dict], claims: list[dict], meta: dict) -> str:
    """The lab table and the claims map as markdown (docs/ and BENCHMARKS.md take them)."""
    out = [f"# SGLang {meta.get('version') or VERSION} conformance lab",
           "", " ".join(f"{k}: {v}." for k, v in meta.items() if k != "version"), "",
           "| case | defect | we said before any server | SGLang | tau | expected | verdict | "
           "ours |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        errs = [f["code"] for f in r["inspect"] if f["severity"] == "error"]
        warns = [f["code"] for f in r["inspect"] if f["severity"] == "warning"]
        said = ", ".join(errs) or ("no error; warning " + ", ".join(warns) if warns else
                                   "nothing")
        if r["spec"]:
            said += "; spec: " + "; ".join(s[:80] for s in r["spec"])
        tau = f"{r['tau']:.3f}" if isinstance(r.get("tau"), float) else "-"
        out.append(f"| {r['case']} | {r['what']} | {said} | {_sglang_cell(r)} | {tau} | "
                   f"{'/'.join(r['expect'])} | {r.get('verdict')} | {r.get('caught')} |")
    out += ["", "## The claims of runner/drafts/rules.py and the inspector", "",
            "| claim | says | rows | status |", "|---|---|---|---|"]
    for c in claims:
        out.append(f"| {c['claim']} | {c['says']} | {', '.join(c['observed']) or '-'} | "
                   f"{c['status']} |")
    return "\n".join(out) + "\n"
