"""`runner inspect`, `runner convert` and `--server-args` never hang and never raise (issue 21
item 5, issue 20 item 4): the generated malformed drafters and server lines of tests/bad_drafts.py
each get a one-line result in bounded time; killed converts leave no partial output."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bad_drafts import make_case
from draft_fixtures import TINY, make_draft
from eagle3_runner.runner.convert import convert
from eagle3_runner.runner.errors import ConvertError
from eagle3_runner.runner.inspect import inspect_draft

ROOT = Path(__file__).resolve().parent.parent
N = 400


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang("took longer than the bound")


@pytest.fixture
def bounded():
    old = signal.signal(signal.SIGALRM, _alarm)
    yield lambda s: signal.alarm(s)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_inspect_gives_findings_for_every_generated_bad_draft(tmp_path, bounded):
    seen = set()
    t0 = time.monotonic()
    for i in range(N):
        d, t, line, v = make_case(tmp_path, i)
        bounded(10)
        f = inspect_draft(d, t, line, v)
        bounded(0)
        assert isinstance(f, list), i
        for x in f:
            assert x.severity in ("error", "warning") and x.code[:2] in ("E_", "W_"), (i, x)
            assert "\n" not in x.message and len(x.message) < 3000, (i, x)
        assert "E_INSPECT_INTERNAL" not in [x.code for x in f], (i, f)
        seen |= {x.code for x in f}
    assert time.monotonic() - t0 < 60
    # the generator reaches the classes it claims to
    assert {"E_CONFIG_FIELD", "E_NO_CONFIG", "E_SAFETENSORS", "E_TRUNCATED", "E_INDEX",
            "E_DUPLICATE_TENSOR", "E_SERVER_ARGS_PARSE", "E_SGLANG_VERSION",
            "E_SERVER_SPEC_PARAMS"} <= seen, sorted(seen)


def test_convert_refuses_cleanly_every_generated_bad_draft(tmp_path, bounded):
    ok = 0
    for i in range(0, N, 3):
        d, t, _, v = make_case(tmp_path, i)
        dst = tmp_path / f"out{i}"
        bounded(20)
        try:
            convert(d, dst, t, v if v and v[0].isdigit() and v != "x.y" else None)
            ok += 1
            assert (dst / "config.json").exists()
        except ConvertError as e:
            assert str(e) and not dst.exists(), i
        finally:
            bounded(0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert ok > 0  # some mutations are harmless and convert fine


def test_cli_never_prints_a_traceback(tmp_path):
    """One subprocess runs the CLI over a share of the cases: exit codes 0/1, no traceback."""
    cases = [make_case(tmp_path, i) for i in range(0, N, 10)]
    script = ("import sys, json\nfrom eagle3_runner.runner.cli import main\nrcs = []\n"
              "for d, t, line, v, out in json.loads(sys.argv[1]):\n"
              "    a = ['inspect', d, '--target', t] + (['--server-args', line] if line else [])\n"
              "    a += ['--sglang-version', v] if v else []\n"
              "    rcs.append(main(a))\n"
              "    rcs.append(main(['convert', d, out, '--target', t]))\n"
              "print('RCS', json.dumps(rcs))\n")
    arg = json.dumps([[str(d), str(t), line, v, str(tmp_path / f"o{i}")]
                      for i, (d, t, line, v) in enumerate(cases)])
    r = subprocess.run([sys.executable, "-c", script, arg], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    rcs = json.loads(r.stdout.rsplit("RCS", 1)[1])
    assert set(rcs) <= {0, 1} and len(rcs) == 2 * len(cases)


# --- the handed cases ------------------------------------------------------------------


def _offsets_past_end(d: Path) -> None:
    """Rewrite fc.weight's end offset past the end of the file (the convert hang of issue 21)."""
    p = d / "model.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    a, b = h["fc.weight"]["data_offsets"]
    h["fc.weight"]["data_offsets"] = [a, b + 10 ** 9]
    hb = json.dumps(h).encode()
    p.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])


def test_offsets_past_the_end_and_truncated_tensor_refused_not_hung(tmp_path, bounded, capsys):
    from eagle3_runner.runner.cli import main
    t = tmp_path / "target"
    past = make_draft(tmp_path, TINY, dense=True, name="past")
    _offsets_past_end(past)
    cut = make_draft(tmp_path, TINY, dense=True, name="cut")
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate((cut / "model.safetensors").stat().st_size - 100)
    for d in (past, cut):
        bounded(20)
        assert main(["convert", str(d), str(tmp_path / (d.name + "-out")), "--target", str(t)]) == 1
        bounded(0)
        err = capsys.readouterr().err
        assert "past the end" in err and "Traceback" not in err
        assert "E_TRUNCATED" in [x.code for x in inspect_draft(d, t)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def _layers0_big(root: Path) -> Path:
    """A Llama-8B-sized (sparse, ~1 GB declared) layers.0-style draft: slow enough to kill."""
    def edit(ts):
        for k in [k for k in ts if k.startswith("midlayer.")]:
            ts["layers.0." + k[len("midlayer."):]] = ts.pop(k)
    return make_draft(root, tensor_edit=edit)


def _files(d: Path) -> dict[str, int]:
    """{name: bytes} of a folder's files."""
    return {p.name: p.stat().st_size for p in d.iterdir()}


def _converted(cmd: list[str], dst: Path) -> Path:
    """cmd (a convert) run to its end into dst instead of its own destination."""
    r = subprocess.run(cmd[:5] + [str(dst)] + cmd[6:], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return dst


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_killed_convert_leaves_no_partial_output(tmp_path, sig):
    src = _layers0_big(tmp_path)
    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "eagle3_runner.runner", "convert", str(src), str(dst), "--target",
           str(tmp_path / "target"), "--sglang-version", "0.5.23"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tmp = tmp_path / f".tmp-out-{p.pid}"
    deadline = time.monotonic() + 60
    while not tmp.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    if p.poll() is not None:
        pytest.skip("convert finished before it could be interrupted on this machine")
    os.kill(p.pid, sig)
    p.wait(timeout=60)
    if dst.exists():  # the signal came after the rename (a fast machine, or a late handler)
        assert not tmp.exists() and _files(dst) == _files(_converted(cmd, tmp_path / "again"))
        pytest.skip("convert had renamed its complete output before the signal arrived")
    assert tmp.exists() == (sig == signal.SIGKILL)  # SIGTERM / Ctrl-C clean up at once
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not tmp.exists() and (dst / "config.json").exists()
    if sig == signal.SIGKILL:
        assert "left by a convert that was killed" in r.stdout
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    assert (dst / "model.safetensors").stat().st_blocks * 512 < 64 << 20  # stayed sparse
