"""scripts/bench/bench_extract.py end to end on a tiny random Llama (CPU, float32): both modes run the
stage's own extract_samples and write their tables; the numbers themselves are the benchmark's
business (BENCHMARKS.md), here only their shape and the bytes per token."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
H = 64


@pytest.fixture()
def be(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_extract",
                                                  ROOT / "scripts" / "bench" / "bench_extract.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=H, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    monkeypatch.setattr(mod, "load_model",
                        lambda args: (model, "tiny", torch.device("cpu"), torch.float32))
    return mod


def test_rounds_mode(be, tmp_path):
    r = be.main(["--device", "cpu", "--batch", "2", "--seq", "32", "--batches", "3", "--rounds",
                 "2", "--aux", "0,1", "--out", str(tmp_path)])
    assert len(r["rounds"]) == 2 and r["rounds"][1]["order"] == ["extract_no_wb", "extract"]
    for row in r["rounds"]:
        for k in ("plain", "capture", "extract", "extract_no_wb", "write_only"):
            assert row[f"{k}_tok_s"] > 0
    per_tok = (2 + 1) * H * 4 + 8 + 1  # aux (2 ids) + last, float32; ids int64, mask uint8
    assert per_tok <= r["bytes_per_token"] < per_tok + 16  # + header, offsets, sample_ids
    md = (tmp_path / "bench_extract.md").read_text()
    assert md.count("\n| ") == 4  # header, 2 rounds, median
    assert json.loads((tmp_path / "bench_extract.json").read_text())["median"]


def test_varlen_mode(be, tmp_path):
    r = be.main(["--device", "cpu", "--batch", "2", "--seq", "64", "--batches", "1", "--aux",
                 "0,1", "--varlen", "12", "--runs", "sorted:4,dataset:5", "--batch-tokens",
                 "128", "--out", str(tmp_path)])
    assert [(x["order"], x["shards"]) for x in r["rows"]] == [("sorted", 3), ("dataset", 3)]
    assert all(x["extract_tok_s"] > 0 for x in r["rows"])
    assert "| sorted | 4 | 3 |" in (tmp_path / "bench_extract_varlen.md").read_text()


@pytest.mark.parametrize("argv", [["--varlen", "4", "--runs", "foo"],
                                  ["--varlen", "4", "--runs", "sorted:x"], ["--rounds", "0"],
                                  ["--varlen", "-3"], ["--runs", "sorted:2"],
                                  ["--varlen", "4", "--rounds", "3"], ["--batch-tokens", "0"]])
def test_bad_arguments_are_one_line(be, argv, capsys):
    with pytest.raises(SystemExit) as e:
        be.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and ": error: --" in err[-1]  # prog name varies
