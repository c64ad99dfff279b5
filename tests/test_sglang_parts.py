"""scripts/bench/sglang_parts.py on a recorded bench cut short (the H100 recordings of
tests/data/sglang/h100-0.5.14, three servers marked complete, the tree's left as a cut one): the
complete configurations get the bench stage's own summaries, the cut one is named, and a folder
that is no bench's recording ends with one error line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bad_inputs import base_spec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench" / "sglang_parts.py"
RECORDED = ROOT / "tests" / "data" / "sglang" / "h100-0.5.14"
CONFIGS = [{"num_steps": 3}, {"num_steps": 5}, {"num_steps": 5, "eagle_topk": 4,
                                                  "num_draft_tokens": 8}]


def parts(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def cut_bench(tmp_path) -> tuple[Path, Path]:
    """(spec file, sglang folder): the recording with plain, 3/1/4 and 5/1/6 complete (their
    measured.json, as keep_measured writes it) and 5/4/8's recording left without one."""
    from eagle3_runner.targets.sglang_bench import Measured, Planned, keep_measured
    root = tmp_path / "sglang"
    shutil.copytree(RECORDED, root)
    for name in ("plain-cg1", "s3-k1-n4-cg1", "s5-k1-n6-cg1"):
        keep_measured(root, Measured(Planned(name, True)))
    spec = base_spec(tmp_path)
    spec["stages"]["bench"].update(configs=CONFIGS, max_new_tokens=[256], temperature=0.0,
                                   cuda_graph=[True])
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(spec))
    return f, root


def test_a_cut_bench_reports_its_complete_servers_as_the_stage_would(cut_bench, tmp_path):
    from eagle3_runner.targets.sglang import tau_from_meta
    spec, root = cut_bench
    out = tmp_path / "parts.json"
    p = parts("--spec", str(spec), "--sglang", str(root), "--json", str(out))
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["not_complete"] == ["s5-k4-n8-cg1"]
    rows = {(s["num_steps"], s["eagle_topk"]): s for s in got["summaries"]}
    assert set(rows) == {(3, 1), (5, 1)}
    for (K, _k), s in rows.items():
        metas = [json.loads(x)["response"]["meta_info"] for x in
                 (root / f"s{K}-k1-n{K + 1}-cg1" / "generate.jsonl").read_text().splitlines()]
        assert s["tau"] == pytest.approx(tau_from_meta(metas))
        assert s["n_prompts"] == len(metas) and len(s["accept_per_pos"]) == K
        assert s["speedup"] == pytest.approx(s["spec_tok_s"] / s["base_tok_s"])
        assert f"{K}/1/{K + 1} mtbench ({len(metas)} prompts): tau {s['tau']:.3f}" in p.stdout
    assert "not complete (cut or never started): s5-k4-n8-cg1" in p.stdout


def one_line(p: subprocess.CompletedProcess, *words: str) -> None:
    err = p.stderr.strip()
    assert p.returncode == 1 and "Traceback" not in err and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_what_is_not_a_cut_bench_is_one_error_line(cut_bench, tmp_path):
    """A missing folder, a plain recording that is not text or holds no request, a --json
    folder that is not there, and a folder where no server finished: one line each, exit 1."""
    spec, root = cut_bench
    one_line(parts("--spec", str(spec), "--sglang", str(tmp_path / "nowhere")), "is not a folder")
    one_line(parts("--spec", str(spec), "--sglang", str(root), "--json",
                   str(tmp_path / "no" / "x.json")), "--json", "does not exist")
    plain = root / "plain-cg1" / "generate.jsonl"
    kept = plain.read_bytes()
    for content, words in ((b"\xff\xfe\x00garbage", ["is not text"]),
                           (b"", ["holds no recorded request"]),
                           (b'{"prompt_set": "mtbench"}\n', ["line 1", "not a recorded request"])):
        plain.write_bytes(content)
        one_line(parts("--spec", str(spec), "--sglang", str(root)), "generate.jsonl", *words)
    plain.write_bytes(kept)
    for d in root.iterdir():  # no server marked complete
        (d / "measured.json").unlink(missing_ok=True)
    one_line(parts("--spec", str(spec), "--sglang", str(root)), "no server's recording")


def test_a_spec_server_line_without_a_response_counts_as_cut(cut_bench, tmp_path):
    """read_recording refuses a line without `response`: load_measured then treats the server
    as not complete (it would be measured again), not a traceback."""
    spec, root = cut_bench
    rec = root / "s5-k1-n6-cg1" / "generate.jsonl"
    first, *rest = rec.read_text().splitlines()
    r = json.loads(first)
    del r["response"]
    rec.write_text("\n".join([json.dumps(r), *rest]) + "\n")
    p = parts("--spec", str(spec), "--sglang", str(root))
    assert p.returncode == 0, p.stderr
    assert "not complete (cut or never started): s5-k1-n6-cg1, s5-k4-n8-cg1" in p.stdout


def test_a_complete_server_without_spec_counts_is_a_failed_row_not_a_traceback(cut_bench,
                                                                                 tmp_path):
    """A recording marked complete whose responses lack spec_verify_ct (a plain server's
    answers under a speculative server's name): the stage's failed row, said on stdout."""
    spec, root = cut_bench
    shutil.copy(root / "plain-cg1" / "generate.jsonl", root / "s3-k1-n4-cg1" / "generate.jsonl")
    out = tmp_path / "parts.json"
    p = parts("--spec", str(spec), "--sglang", str(root), "--json", str(out))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "3/1/4 mtbench: sglang server failed" in p.stdout and "spec_verify_ct" in p.stdout
    rows = json.loads(out.read_text())["summaries"]
    assert [r["tau"] for r in rows if r["num_steps"] == 3] == [None]
