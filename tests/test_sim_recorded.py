"""scripts/bench/sim_recorded.py given the wrong arguments: each user mistake (a chain length or
prompt count that is not a positive integer, a folder that is not an exported drafter, a
recording that is not one, a spec that is not there) ends with one line naming it and exit 1 or
2, never a traceback. All of them fail before the target loads (the spec error: before any
weights are read), so nothing here runs a model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench" / "sim_recorded.py"
RECORDED = ROOT / "tests" / "data" / "sglang" / "h100-0.5.14"


def sim(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def drafter(tmp_path) -> Path:
    """A folder with the two files an exported drafter has (never loaded here)."""
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


def one_line(p: subprocess.CompletedProcess, rc: int, *words: str) -> None:
    err = p.stderr.strip()
    assert p.returncode == rc, p.stderr
    assert "Traceback" not in err and err.count("\n") == 0, err
    for w in words:
        assert w in err, err


@pytest.mark.parametrize("argv, words", [
    (["--steps", "a"], ["--steps", "'a' is not an integer >= 1"]),
    (["--steps", "3,0"], ["--steps", "'0' is not an integer >= 1"]),
    (["--prompts", "0"], ["--prompts", "'0' is not an integer >= 1"]),
    (["--prompts", "-1"], ["--prompts", "'-1' is not an integer >= 1"]),
])
def test_bad_numbers_are_argument_errors(drafter, argv, words):
    """Before: --steps a raised ValueError, --steps 0 a RuntimeError inside the simulation,
    --prompts 0 a ValueError saying the server is not speculative, --prompts -1 silently read
    all requests but the last."""
    p = sim("--spec", "s.yaml", "--drafter", str(drafter), "--sglang", str(RECORDED), *argv)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr


def test_a_folder_that_is_not_a_drafter(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    p = sim("--spec", "s.yaml", "--drafter", str(tmp_path), "--sglang", str(RECORDED))
    one_line(p, 1, "--drafter", "model.safetensors", "export")
    p = sim("--spec", "s.yaml", "--drafter", str(tmp_path / "nope"), "--sglang", str(RECORDED))
    one_line(p, 1, "is not a folder")


@pytest.mark.parametrize("text, words", [("garbage\n", ["line 1", "not a recorded request"]),
                                         ("", ["holds no recorded request"]),
                                         (json.dumps({"request": {}}) + "\n", ["line 1"])])
def test_a_recording_that_is_not_one(tmp_path, drafter, text, words):
    plain = tmp_path / "sg" / "plain-cg1"
    plain.mkdir(parents=True)
    (plain / "generate.jsonl").write_text(text)
    p = sim("--spec", "s.yaml", "--drafter", str(drafter), "--sglang", str(tmp_path / "sg"))
    one_line(p, 1, "generate.jsonl", *words)


def test_a_drafter_sglang_would_not_load_is_one_error_line(tmp_path, drafter):
    """Two files present but not a drafter (config.json {}, empty weights): runner inspect's
    first error, named before the target loads."""
    import yaml
    from bad_inputs import base_spec
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(base_spec(tmp_path)))
    p = sim("--spec", str(spec), "--drafter", str(drafter), "--sglang", str(RECORDED),
            "--prompts", "1")
    one_line(p, 1, "--drafter", "is not a drafter SGLang would load", "runner inspect")


def test_a_device_that_is_not_there_is_one_error_line(drafter):
    import torch
    p = sim("--spec", "s.yaml", "--drafter", str(drafter), "--sglang", str(RECORDED),
            "--device", "gpu")
    assert p.returncode == 2 and "--device" in p.stderr and "Traceback" not in p.stderr
    if not torch.cuda.is_available():
        p = sim("--spec", "s.yaml", "--drafter", str(drafter), "--sglang", str(RECORDED),
                "--device", "cuda")
        one_line(p, 1, "--device cuda", "no CUDA device")


def test_a_missing_spec_is_one_error_line(tmp_path, drafter):
    p = sim("--spec", str(tmp_path / "nothere.yaml"), "--drafter", str(drafter), "--sglang",
            str(RECORDED), "--prompts", "1")
    one_line(p, 1, "error:", "nothere.yaml", "cannot read spec file")
