"""Bench backend `sglang` (stages.bench.backend: sglang, or both with the embedded engine): real
SGLang servers, one plain server (no speculation) per cuda_graph setting and one speculative
server per configuration, the same prompts through /generate at batch 1, and the `bench` /
`bench_summary` rows of runner/bench_rows.py (the columns every backend writes).

Servers (targets/sglang.py) start in waves on the one GPU (plan_waves: the timed servers,
stages.bench.sglang.parallel at a time, then the learning curve's, curve_parallel at a time),
each on free ports (HTTP and torch.distributed's), with the target's dtype and
stages.bench.sglang.mem_fraction_static; `start` launches the first wave and returns at once (the
embedded bench builds its engines meanwhile), `measure` waits for each server (startup_timeout_s),
then sends every prompt to one server after another, so only one server decodes at a time, and
stops the wave. A server that does not start, or dies, leaves its log tail: its configuration
gets a summary row flagged "sglang server failed" and no prompt rows; the bench goes on.

Definitions (SGLang 0.5.14 meta_info, targets/sglang.py):
- tau = 1 + sum(spec_num_correct_drafts) / sum(spec_verify_ct): tokens per verify pass with the
  bonus token, the prefill's first token not counted: the embedded engine's definition, so the
  two backends' tau compare directly; server_accept_length = sum(completion_tokens) /
  sum(spec_verify_ct), SGLang's own spec_accept_length (the prefill's token counted).
- tok/s = sum(completion_tokens) / sum(meta_info e2e_latency): server-side seconds, prefill and
  first token included (as the embedded backend's end-to-end tok/s), the client's wall time
  when a server reports none; the baseline is the plain server's on the same prompts.
- a round = sum(e2e) / sum(spec_verify_ct); its cost in plain tokens (round ms / plain ms per
  token) is the break-even tau, and the profile (bench_rows.speed_profile) the embedded bench
  predicts SGLang's speedup from.
- lossless (temperature 0) = the speculative server's output_ids equal the plain server's;
  ref_* = the plain server's output_ids against the embedded engine's greedy baseline, when
  both backends ran (Compare); divergence margins come from our target's own forward
  (jobs.bench.divergence) when it is loaded, else NULL: a prompt that differs is then flagged
  unjudged ("differs from plain ... (unjudged: no target margins)", bench_rows.UNJUDGED), not
  "not lossless", since SGLang 0.5.14's speculative servers differ from its plain server on
  most prompts (60-64 of 80 on the H100, 2026-12-07) and nothing here tells a near-tie from a
  bug.

Recorded under the stage's output (the layout tests/data/sglang/ replays;
scripts/gpu/sglang_fixtures.py turns it into fixtures):
  sglang/<server>/argv.json        the launch_server argv
  sglang/<server>/server.log       the server's own output (stdout and stderr)
  sglang/<server>/server_info.json GET /server_info once ready (version, speculative_*)
  sglang/<server>/generate.jsonl   per request: prompt_set, prompt_id, max_new_tokens,
                                   request {input_ids, sampling_params}, response, client_s
  sglang/<server>/measured.json    written once the server answered every request (its info,
                                   readiness, decode-log accept lens, the machine): a resumed
                                   bench reads the server back instead of launching it
  sglang_profile.json              the round-cost profile (bench_rows.speed_profile)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle3_runner.runner.bench_rows import (config_fields, failed_summary_row, lossless_verdict,
                                             machine, prompt_row, round_cost, summary_row)
from eagle3_runner.runner.errors import ServerError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.targets.sglang import (Server, accept_per_pos_from_meta, free_ports,
                                         generate, launch, parse_accept_lens,
                                         server_accept_length, server_argv, server_info,
                                         stop_all, tau_from_meta, wait_ready)

# /server_info keys kept in the recording (the rest is every ServerArgs field)
INFO_KEYS = ("version", "model_path", "dtype", "attention_backend", "speculative_algorithm",
             "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
             "speculative_num_draft_tokens", "mem_fraction_static", "cuda_graph_max_bs",
             "max_total_num_tokens", "context_length")


@dataclass
class Planned:
    """One server of the bench: the plain baseline (config None), one configuration, or one of
    the learning curve's snapshot drafters (snapshot: runner/bench_curve.py curve_snapshots'
    entry; its draft directory instead of the export's, configs[0], tau only)."""

    name: str  # "plain-cg1", "s3-k1-n4-cg1", "snap000400-s3-k1-n4-cg1": its recording folder
    cuda_graph: bool
    config: Any = None  # runner.spec.stage_blocks.SpecParams
    snapshot: dict | None = None


@dataclass
class Measured:
    """What one server did: responses per (prompt_set, max_new_tokens, prompt_id) as (response,
    client seconds), or why it failed (with its log tail)."""

    planned: Planned
    responses: dict = field(default_factory=dict)
    error: str | None = None
    info: dict = field(default_factory=dict)
    accept_lens: list = field(default_factory=list)  # decode-log `accept len` values
    ready_s: float | None = None


@dataclass
class Compare:
    """The embedded engine's side, when both backends ran in one stage: ours[(cuda_graph,
    prompt_set, max_new_tokens, prompt_id)] = its greedy baseline tokens; diverge(prompt_set,
    prompt_id, tokens, reference) -> jobs.bench.divergence's dict (None when equal)."""

    ours: dict
    diverge: Callable[[str, str, list, list], dict | None]


def _name(c, cg: bool) -> str:
    return f"s{c.num_steps}-k{c.eagle_topk}-n{c.draft_tokens}-cg{int(cg)}"


def plan_servers(p, snapshots: list[dict] = ()) -> list[Planned]:
    """The servers of a bench stage (p: stages.bench): per cuda_graph setting, the plain server,
    then one per configuration; then one per curve snapshot (configs[0], the first cuda_graph
    setting)."""
    out = []
    for cg in p.cuda_graph:
        out.append(Planned(f"plain-cg{int(cg)}", cg))
        out += [Planned(_name(c, cg), cg, c) for c in p.configs]
    c, cg = p.configs[0], p.cuda_graph[0]
    out += [Planned(f"snap{s['step']:06d}-{_name(c, cg)}", cg, c, s) for s in snapshots]
    return out


def plan_waves(plan: list[Planned], parallel: int,
               curve_parallel: int | None = None) -> list[list[Planned]]:
    """The bench's waves (servers started together) of `plan` (plan_servers' order): the timed
    servers (plain and configurations, snapshot None) in chunks of `parallel`, in plan order,
    then the learning curve's snapshot servers in chunks of `curve_parallel` (None = parallel).
    A curve server never shares a timed server's wave.

    Why: a timed server's tok/s is measured while the rest of its wave is up, and an idle SGLang
    server still costs CPU (its scheduler, tokenizer and detokenizer processes), which a small
    target's batch-1 decode is bound by. On an H100 with SGLang 0.5.14 (SmolLM2-135M, 80
    MT-bench prompts; BENCHMARKS.md, session of 2026-12-07, fourth window) all 8 servers in one
    wave (parallel 8) against waves of 2 gave plain 629.8 vs 751.0 tok/s, 3/1/4 511.9 vs 707.0,
    5/1/6 639.2 vs 815.6, 5/4/8 598.6 vs 788.9 (speedups 0.813/1.015/0.950 vs 0.941/1.086/1.050).
    The curve's servers measure tau only, which no neighbour changes: they may start many at
    once."""
    timed = [pl for pl in plan if pl.snapshot is None]
    curve = [pl for pl in plan if pl.snapshot is not None]

    def chunks(xs: list[Planned], n: int) -> list[list[Planned]]:
        return [xs[i:i + n] for i in range(0, len(xs), n)]

    return chunks(timed, parallel) + chunks(curve, curve_parallel or parallel)


class SglangBench:
    """The sglang side of one bench stage. sets: {prompt_set: [(prompt_id, input_ids)]};
    stop_ids: the target's end-of-turn ids (targets/load.py end_of_turn_ids), the embedded
    engine's stop ids, sent as stop_token_ids, so both engines end a completion at the same
    tokens."""

    def __init__(self, spec, p, out_dir: Path, model: str, export_dir: Path, sets: dict,
                 stop_ids=(), dtype: str | None = None, snapshots: list[dict] = (),
                 resume: bool = False):
        self.spec, self.p, self.o = spec, p, p.sglang
        self.root = Path(out_dir) / "sglang"
        self.model, self.export_dir, self.sets = model, Path(export_dir), sets
        self.stop_ids, self.dtype = tuple(stop_ids), dtype
        plan = plan_servers(p, snapshots)
        # resume: the servers an earlier run of this stage measured completely on this machine
        # are read back from their recordings, the others measured
        self.done = {pl.name: m for pl in plan
                     if (m := load_measured(self.root, pl, sets, p.max_new_tokens) if resume
                         else _forget(self.root, pl)) is not None}
        plan = [pl for pl in plan if pl.name not in self.done]
        self.waves = plan_waves(plan, self.o.parallel, self.o.curve_parallel)
        self.started: list[Server] | None = None

    def _argv(self, pl: Planned, port: int, nccl: int) -> list[str]:
        o, c = self.o, pl.config
        draft = self.export_dir if pl.snapshot is None else pl.snapshot["dir"]
        spec_kw = {} if c is None else dict(draft_path=str(draft), num_steps=c.num_steps,
                                            eagle_topk=c.eagle_topk,
                                            num_draft_tokens=c.draft_tokens)
        return server_argv(o.python, self.model, port, o.host, o.tp, cuda_graph=pl.cuda_graph,
                           cuda_graph_max_bs=o.cuda_graph_max_bs,
                           context_length=self.p.context_length, extra=o.extra_args,
                           dtype=self.dtype, mem_fraction_static=o.mem_fraction_static,
                           nccl_port=nccl, **spec_kw)

    def _launch(self, wave: list[Planned]) -> list[Server]:
        o = self.o
        if o.port is None:
            ports = free_ports(2 * len(wave), o.host)
        else:  # declared: consecutive from stages.bench.sglang.port
            ports = list(range(o.port, o.port + 2 * len(wave)))
        out = []
        for i, pl in enumerate(wave):
            d = self.root / pl.name
            d.mkdir(parents=True, exist_ok=True)
            argv = self._argv(pl, ports[2 * i], ports[2 * i + 1])
            atomic_write(d / "argv.json", json.dumps(argv, indent=1))
            out.append(launch(pl.name, argv, o.host, ports[2 * i], d / "server.log",
                              dict(os.environ)))
        return out

    def start(self) -> None:
        """Launch the first wave and return (the servers start while the caller works)."""
        if self.started is None and self.waves:
            self.started = self._launch(self.waves[0])

    def close(self) -> None:
        """Stop the servers `start` launched and `measure` has not yet (a failure between)."""
        if self.started:
            stop_all(self.started)
        self.started = None

    def measure(self) -> dict[str, Measured]:
        """Every wave (plan_waves): wait for all its servers, then measure them one after another
        (none is timed while a neighbour still starts; a wave of the curve's snapshot servers
        all at once: their tau does not depend on time), stop them. Returns {server name:
        Measured}. The servers are stopped whatever happens."""
        from concurrent.futures import ThreadPoolExecutor
        out = dict(self.done)
        for i, wave in enumerate(self.waves):
            servers = self.started if i == 0 and self.started is not None else self._launch(wave)
            t0, whole = time.monotonic(), False
            try:
                timed = [(pl, srv) for pl, srv in zip(wave, servers) if pl.snapshot is None]
                self._await(srv for _, srv in timed)
                for pl, srv in timed:
                    out[pl.name] = self._measure_one(pl, srv)
                curve = [(pl, srv) for pl, srv in zip(wave, servers) if pl.snapshot is not None]
                if curve:
                    with ThreadPoolExecutor(len(curve)) as ex:
                        for pl, m in zip([pl for pl, _ in curve],
                                         ex.map(lambda a: self._measure_one(*a), curve)):
                            out[pl.name] = m
                whole = True
            finally:
                t1 = time.monotonic()
                stop_all(servers)
                say(f"wave {i + 1}/{len(self.waves)} of {len(wave)} server(s) "
                    f"{'measured' if whole else 'interrupted'} after {t1 - t0:.1f} s, "
                    f"stopped in {time.monotonic() - t1:.1f} s")
            for pl, srv in zip(wave, servers):  # the logs are complete once stopped
                out[pl.name].accept_lens = parse_accept_lens(srv.log_text())
                if out[pl.name].error is None:
                    keep_measured(self.root, out[pl.name])
        self.started = None
        return out

    def _await(self, servers) -> None:
        """Wait until every one of `servers` is ready or has failed (its _measure_one then says
        why, at once: wait_ready raises again without waiting). Why: a server still starting
        (loading, capturing CUDA graphs) beside the one being timed slows it; on the H100 of
        the fifth window of 2026-12-07 the plain server was timed while its wave's 3/1/4 server
        was still 23 s from ready."""
        for srv in servers:
            try:
                wait_ready(srv, self.o.startup_timeout_s)
            except (ServerError, OSError, ValueError):
                pass

    def _measure_one(self, pl: Planned, srv: Server) -> Measured:
        m = Measured(pl)
        p = self.p
        try:
            wait_ready(srv, self.o.startup_timeout_s)
            m.ready_s = srv.ready_s
            say(f"{pl.name} ready {srv.ready_s:.1f} s after its launch")
            t0 = time.monotonic()
            info = server_info(srv.url)
            m.info = {k: info[k] for k in INFO_KEYS if k in info}
            atomic_write(self.root / pl.name / "server_info.json", json.dumps(m.info, indent=1))
            with open(self.root / pl.name / "generate.jsonl", "w") as rec:
                for s, prompts in self.sets.items():
                    for mx in p.max_new_tokens:
                        for pid, ids in prompts:
                            r, dt = generate(srv.url, ids, mx, p.temperature,
                                             self.o.request_timeout_s, self.stop_ids)
                            m.responses[s, mx, pid] = (r, dt)
                            rec.write(json.dumps(record(s, pid, mx, ids, p.temperature,
                                                        self.stop_ids, r, dt)) + "\n")
                            rec.flush()
            # complete: kept at once, so a bench stopped later in this wave resumes without it
            m.accept_lens = parse_accept_lens(srv.log_text())
            keep_measured(self.root, m)
            toks = sum(r.get("meta_info", {}).get("completion_tokens", 0)
                       for r, _ in m.responses.values())
            say(f"{pl.name}: {len(m.responses)} request(s), {toks:,} tokens in "
                f"{time.monotonic() - t0:.1f} s")
        except (ServerError, OSError, ValueError) as e:  # at startup wait_ready's message has
            # the log tail; after it (a request failed, the server died) the tail is added
            m.error = str(e) if srv.ready_s is None else (
                f"sglang server {pl.name}: {type(e).__name__}: {e}; log {srv.log_path}:\n"
                f"{srv.log_tail()}")
        return m


MEASURED = "measured.json"  # a server's folder: written once its every request was answered


def say(msg: str) -> None:
    """A progress line of the bench's SGLang side (readiness, each server's measurement, each
    wave's stop), on stdout as the embedded side's: a time-boxed run shows where its time went."""
    print(f"bench: sglang {msg}", flush=True)


def keep_measured(root: Path, m: Measured) -> None:
    """Mark server m.planned's recording complete (its info, readiness and decode-log accept
    lengths, and this machine: runner/bench_rows.py machine), so that a resumed bench reads it
    back instead of measuring again."""
    atomic_write(Path(root) / m.planned.name / MEASURED, json.dumps(
        {"machine": machine(), "info": m.info, "ready_s": m.ready_s,
         "accept_lens": m.accept_lens}))


def load_measured(root: Path, pl: Planned, sets: dict, max_new: list[int],
                  any_machine: bool = False) -> Measured | None:
    """Server pl's measurement from its recording (generate.jsonl + measured.json), when
    keep_measured marked it complete on this machine (any machine with `any_machine`: reading a
    recording brought back, scripts/bench/sglang_parts.py) and it answered every request of
    `sets` x max_new; else None (it is measured again)."""
    d = Path(root) / pl.name
    try:
        meta = json.loads((d / MEASURED).read_text())
        recs = read_recording(d)
        if not any_machine and meta.get("machine") != machine():
            return None
        m = Measured(pl, info=meta.get("info") or {}, accept_lens=meta.get("accept_lens") or [],
                     ready_s=meta.get("ready_s"))
    except (OSError, ValueError, AttributeError):  # AttributeError: measured.json not an object
        return None
    for r in recs:
        m.responses[r["prompt_set"], r["max_new_tokens"], r["prompt_id"]] = (r["response"],
                                                                            r["client_s"])
    want = {(s, mx, pid) for s, prompts in sets.items() for mx in max_new for pid, _ in prompts}
    return m if want <= set(m.responses) else None


RECORD_KEYS = ("prompt_set", "prompt_id", "max_new_tokens", "request", "response", "client_s")


def read_recording(folder: Path) -> list[dict]:
    """The requests a recorded server answered: its generate.jsonl, one `record` per line (blank
    lines skipped). Raises OSError when the file is missing or unreadable, ValueError naming the
    file and line when a line is not a recorded request (not UTF-8 text, not JSON, or without a
    field of `record`'s)."""
    f = Path(folder) / "generate.jsonl"
    try:
        lines = f.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{f} is not text ({e.reason})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{f} line {n} is not a recorded request (not JSON: {e})") from None
        missing = [k for k in RECORD_KEYS if not isinstance(r, dict) or k not in r]
        if missing or not isinstance(r["request"], dict) or not isinstance(r["response"], dict):
            raise ValueError(f"{f} line {n} is not a recorded request (no "
                             f"{', '.join(missing) or 'request/response object'})")
        out.append(r)
    return out


def _forget(root: Path, pl: Planned) -> None:
    """A fresh (not resumed) bench: an earlier run's completion mark goes (the recording itself
    is rewritten when the server is measured). Returns None."""
    (Path(root) / pl.name / MEASURED).unlink(missing_ok=True)


def record(prompt_set: str, prompt_id: str, max_new: int, ids: list, temperature: float,
           stop_ids, response: dict, client_s: float) -> dict:
    """One line of generate.jsonl: the request as sent and the response as received."""
    params = {"max_new_tokens": max_new, "temperature": temperature}
    if stop_ids:
        params["stop_token_ids"] = list(stop_ids)
    return {"prompt_set": prompt_set, "prompt_id": prompt_id, "max_new_tokens": max_new,
            "request": {"input_ids": list(ids), "sampling_params": params},
            "response": response, "client_s": client_s}


def seconds(response: dict, client_s: float) -> float:
    """A request's time: the server's meta_info e2e_latency, else the client's wall seconds."""
    e2e = response.get("meta_info", {}).get("e2e_latency")
    return float(e2e) if isinstance(e2e, (int, float)) and e2e > 0 else client_s


# ----------------------------------------------------------------------------------------------
# rows


def rows_and_summaries(measured: dict[str, Measured], p, sets: dict, trained_on: int | None,
                       compare: Compare | None = None) -> tuple[list[dict], list[dict]]:
    """The `bench` and `bench_summary` rows of every configuration x prompt set x max_new_tokens
    (p: stages.bench; sets: as SglangBench's). A configuration whose server, or whose cuda_graph
    setting's plain server, failed gets failed_summary_row only."""
    rows_all, summaries = [], []
    for pl in (m.planned for m in measured.values()):
        if pl.config is None or pl.snapshot is not None:
            continue
        spec_m, plain_m = measured[pl.name], measured[f"plain-cg{int(pl.cuda_graph)}"]
        version = spec_m.info.get("version") or plain_m.info.get("version")
        for s, prompts in sets.items():
            for mx in p.max_new_tokens:
                cfg = config_fields(pl.config, pl.cuda_graph, mx, p.temperature, "sglang", s,
                                    trained_on)
                bad = spec_m.error or plain_m.error
                if bad:
                    summaries.append({**failed_summary_row(cfg, bad), "server_version": version})
                    continue
                try:
                    rows = [_prompt_row(cfg, s, pid, spec_m.responses[s, mx, pid],
                                        plain_m.responses[s, mx, pid], compare)
                            for pid, _ in prompts]
                except ValueError as e:  # a response without spec_verify_ct
                    summaries.append({**failed_summary_row(cfg, f"sglang server {pl.name}: {e}"),
                                      "server_version": version})
                    continue
                summaries.append(_summary(cfg, rows, spec_m, version))
                rows_all += rows
    return rows_all, summaries


def _prompt_row(cfg: dict, prompt_set: str, pid: str, spec: tuple, plain: tuple,
                compare: Compare | None) -> dict:
    (r, dt), (b, bdt) = spec, plain
    mi, bi = r["meta_info"], b["meta_info"]
    e2e, be2e = seconds(r, dt), seconds(b, bdt)
    toks, btoks = int(mi["completion_tokens"]), int(bi["completion_tokens"])
    out, ref = r.get("output_ids"), b.get("output_ids")
    greedy = cfg["temperature"] == 0
    lossless = (out == ref) if greedy else None
    div = compare.diverge(prompt_set, pid, out, ref) if compare and lossless is False else None
    extra = {}
    if compare and greedy:
        ours = compare.ours[cfg["cuda_graph"], prompt_set, cfg["max_new_tokens"], pid]
        rdiv = compare.diverge(prompt_set, pid, ref, ours) if ref != ours else None
        extra = dict(ref_same=ref == ours, ref_diverge_at=(rdiv or {}).get("diverge_at"),
                     ref_diverge_margin=(rdiv or {}).get("diverge_margin"),
                     _ref_runner_up=(rdiv or {}).get("diverge_runner_up"))
    pos = accept_per_pos_from_meta([mi], cfg["num_steps"])
    return prompt_row(cfg, pid, tau_from_meta([mi]), toks, int(mi["spec_verify_ct"]), toks / e2e,
                      btoks / be2e, lossless, div, server_accept_length=server_accept_length([mi]),
                      **({"accept_per_pos": pos} if pos else {}),
                      _meta=mi, _e2e=e2e, _be2e=be2e, _btoks=btoks, **extra)


def _ref_verdict(rows: list[dict]) -> dict:
    """ref_same_prompts / ref_max_margin and a sentence: SGLang's plain decode against the
    embedded engine's, counted like lossless (bench_rows.lossless_verdict, NEAR_TIE)."""
    if "ref_same" not in rows[0]:
        return {}
    same, n, margin, text = lossless_verdict([
        {"lossless": r["ref_same"], "diverge_margin": r["ref_diverge_margin"],
         "diverge_at": r["ref_diverge_at"], "diverge_runner_up": r["_ref_runner_up"],
         "prompt_id": r["prompt_id"]} for r in rows])
    text = (" SGLang's plain greedy decode equals the embedded engine's on every prompt." if same
            else " SGLang's plain greedy decode against the embedded engine's:" + text)
    return {"ref_same_prompts": n, "ref_max_margin": margin, "_ref_text": text}


def _summary(cfg: dict, rows: list[dict], spec_m: Measured, version: str | None) -> dict:
    metas = [r["_meta"] for r in rows]
    tau, sal = tau_from_meta(metas), server_accept_length(metas)
    toks, verify = sum(r["new_tokens"] for r in rows), sum(r["verify_ct"] for r in rows)
    spec_s, base_s = sum(r["_e2e"] for r in rows), sum(r["_be2e"] for r in rows)
    btoks = sum(r["_btoks"] for r in rows)
    spec_tps, base_tps = toks / spec_s, btoks / base_s
    round_ms, base_ms, cost = round_cost(spec_s, verify, base_s, btoks)
    K, k, N = cfg["num_steps"], cfg["eagle_topk"], cfg["num_draft_tokens"]
    logs = spec_m.accept_lens
    text = (f"sglang {version or '?'}, {'tree' if k > 1 else 'chain'} {K}/{k}/{N} "
            f"(num_steps/eagle_topk/num_draft_tokens): tau {tau:.3f} (1 + accepted drafts / "
            f"verify passes, the embedded engine's definition); SGLang's own accept length "
            f"{sal:.3f} (completion tokens / verify passes: the prefill's token counted)"
            + (f"; decode-log accept len median {statistics.median(logs):.2f} over {len(logs)} "
               "lines" if logs else "") +
            f". {spec_tps:.1f} vs plain {base_tps:.1f} tok/s = {spec_tps / base_tps:.2f}x end to "
            f"end (server e2e_latency); one round = {round_ms:.2f} ms = {cost:.2f} plain tokens of "
            f"{base_ms:.2f} ms (break-even tau {cost:.2f}).")
    ref = _ref_verdict(rows)
    pos = accept_per_pos_from_meta(metas, K)  # SGLang's per-request accept histograms
    out = summary_row(cfg, rows, tau, spec_tps, base_tps, cost, text,
                      server_accept_length=sal, server_version=version,
                      **({"accept_per_pos": pos} if pos else {}),
                      **{k: v for k, v in ref.items() if not k.startswith("_")})
    out["explanation"] += ref.get("_ref_text", "")
    return out


def curve_rows(measured: dict[str, Measured], p, sets: dict) -> list[dict]:
    """The `bench_curve` rows of the snapshot servers (runner/bench_curve.py): per snapshot,
    prompt set and max_new_tokens, SGLang's tau and accept length over every prompt (a failed
    server: no row; its log is in its recording folder)."""
    from eagle3_runner.runner.bench_curve import curve_row
    out = []
    for m in measured.values():
        pl = m.planned
        if pl.snapshot is None or m.error:
            continue
        for s, prompts in sets.items():
            for mx in p.max_new_tokens:
                metas = [m.responses[s, mx, pid][0]["meta_info"] for pid, _ in prompts
                         if (s, mx, pid) in m.responses]
                if not metas:
                    continue
                cfg = config_fields(pl.config, pl.cuda_graph, mx, p.temperature, "sglang", s,
                                    pl.snapshot.get("samples"))
                try:
                    tau, sal = tau_from_meta(metas), server_accept_length(metas)
                except ValueError:  # not a speculative response: no tau to draw
                    continue
                verify = sum(int(mi["spec_verify_ct"]) for mi in metas)
                out.append(curve_row(cfg, pl.snapshot, "sglang", "measured", tau,
                                     accept_per_pos_from_meta(metas, pl.config.num_steps),
                                     verify, len(metas), sal))
    return out
