"""A generator of malformed drafter directories and server lines (issues 20 and 21): every case
must get findings, never a traceback, a hang or an unbounded read, from `runner inspect`, and a
clean refusal (ConvertError) or a correct result from `runner convert`.

Classes generated (seeded, so a failure names a reproducible case):
- config.json values of the wrong kind: strings, lists where objects or ints belong, objects
  where lists belong, null, booleans, huge / negative / zero / float numbers, NaN, deep nesting,
  fields deleted, whole file not an object or not JSON;
- safetensors files: random bytes, header lengths past the end or huge, headers that are not
  objects, entries with bad dtypes / shapes / offsets, offsets past the end of the file
  (truncation), byte counts that disagree with dtype x shape, huge shapes, d2t of another rank,
  byte ranges that overlap or leave bytes no tensor covers (the safetensors library refuses
  both), a tensor in two files, a broken index;
- server lines: random flags of launch_server's speculative vocabulary with random values,
  unbalanced quotes, leading environment words, empty values, huge and negative numbers.

Run `python tests/bad_drafts.py N` to print one line per case. tests/test_bad_drafts.py runs it in
CI. No torch.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_fixtures import TINY, sglang_config, target_config, tensors, write_st  # noqa: E402

BAD_VALUES = [None, "abc", "", -1, 0, 2 ** 70, -2 ** 63, 1e308, 3.5, float("nan"), True, False,
              [], [1, "x"], [[1, 2], [3]], {}, {"a": 1}, [None], "1", [2 ** 40, 1, 2],
              {"eagle_aux_hidden_state_layer_ids": "x"}, list(range(50)), [-5, 0, 3]]
FIELDS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "vocab_size", "draft_vocab_size", "max_position_embeddings",
          "num_hidden_layers", "target_hidden_size", "rms_norm_eps", "rope_theta",
          "rope_scaling", "tie_word_embeddings", "bias", "attention_bias", "fc_norm",
          "norm_output", "norm_before_fc", "norm_before_residual", "num_aux_hidden_states",
          "architectures", "torch_dtype", "dtype", "eagle_config", "model_type",
          "eagle_aux_hidden_state_layer_ids", "transformer_layer_config", "rope_parameters",
          "text_config"]
FLAGS = ["--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
         "--speculative-num-draft-tokens", "--speculative-draft-model-path", "--quantization",
         "--speculative-draft-model-quantization", "--kv-cache-dtype",
         "--speculative-draft-kv-cache-dtype", "--speculative-draft-load-format", "--load-format",
         "--speculative-draft-window-size", "--speculative-accept-threshold-single",
         "--speculative-accept-threshold-acc", "--speculative-adaptive", "--context-length",
         "--speculative-token-map", "--dtype"]
FLAG_VALUES = ["EAGLE3", "eagle3", "EAGLE", "3", "0", "-2", "99999999999999999999", "1e3",
               "fp8", "fp8_e4m3", "unquant", "dummy", "0.5", "nan", "", "'", '"', "x y",
               "--", "\u00e9\u00e8", "$(rm -rf /)", "=", "4=5"]
VERSIONS = ["0.5.6", "0.5.14", "0.5.23", "0.5.10", "1.0", "0.4.0", "x.y", None]


def bad_config(rng: random.Random) -> object:
    """A mutated copy of a valid TINY config.json object (1-3 fields)."""
    cfg = sglang_config(TINY)
    for _ in range(rng.randint(1, 3)):
        f = rng.choice(FIELDS)
        r = rng.random()
        if r < 0.15:
            cfg.pop(f, None)
        elif f == "eagle_config" and r < 0.5:
            cfg[f] = {"eagle_aux_hidden_state_layer_ids": rng.choice(BAD_VALUES),
                      "use_aux_hidden_state": rng.choice(BAD_VALUES)}
        else:
            cfg[f] = rng.choice(BAD_VALUES)
    return cfg


def _header_bytes(header) -> bytes:
    b = json.dumps(header).encode()
    return struct.pack("<Q", len(b)) + b


def bad_safetensors(rng: random.Random, cfg: dict) -> dict[str, bytes] | None:
    """Files to write over a valid draft's model.safetensors ({name: bytes}; None = keep)."""
    kind = rng.randrange(11)
    if kind == 0:
        return {"model.safetensors": bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))}
    if kind == 1:  # header length past the end, or huge
        return {"model.safetensors": struct.pack("<Q", rng.choice([2 ** 63, 10 ** 9, 200])) + b"{}"}
    if kind == 2:
        return {"model.safetensors": _header_bytes(rng.choice([[1], "x", 3, None, {"a": []}]))}
    name = rng.choice(["fc.weight", "d2t", "lm_head.weight", "midlayer.mlp.up_proj.weight"])
    e = {"dtype": rng.choice(["BF16", "I64", "F8_E4M3", "Q4", 7, None]),
         "shape": rng.choice([[4, 4], [2 ** 40, 2 ** 40], [-1], [1, 200], [], [0], ["a"], [1] * 9]),
         "data_offsets": rng.choice([[0, 32], [0, 10 ** 12], [64, 0], [0], [0, "x"], [0, 2 ** 62]])}
    if kind in (3, 4, 5):
        return {"model.safetensors": _header_bytes({name: e}) + bytes(rng.randint(0, 64))}
    if kind == 6:  # a valid file cut short
        return "truncate"
    if kind == 7:  # a tensor in two files
        return "duplicate"
    if kind == 9:  # byte ranges that overlap, or bytes no tensor covers
        return rng.choice(["overlap", "trailing"])
    if kind == 8:
        return {"model.safetensors.index.json": rng.choice(
            [b"{", b"[]", b'{"weight_map": 3}', b'{"weight_map": {"fc.weight": 5}}',
             b'{"weight_map": {"fc.weight": "nope.safetensors"}}'])}
    return None


def _overlap(p: Path) -> None:
    """Move the second tensor of a valid file 8 bytes back, into the first (every entry still
    inside the file and of the right size; only the tiling is wrong)."""
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    a, b = h[names[1]]["data_offsets"]
    h[names[1]]["data_offsets"] = [a - 8, b - 8]
    head = json.dumps(h).encode()
    head += b" " * (n - len(head))  # the same header length: the data stays where it was
    p.write_bytes(raw[:8] + head + raw[8 + n:])


def bad_server_line(rng: random.Random, d: Path) -> str:
    toks = []
    if rng.random() < 0.3:
        toks.append(rng.choice(["SGLANG_SIMULATE_ACC_LEN=2", "SGLANG_SIMULATE_ACC_LEN=x",
                                "env", "A=1", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"]))
    toks += ["python", "-m", "sglang.launch_server"]
    for _ in range(rng.randint(0, 8)):
        f = rng.choice(FLAGS)
        v = str(d) if f == "--speculative-draft-model-path" and rng.random() < 0.7 else \
            rng.choice(FLAG_VALUES)
        toks.append(f"{f}={v}" if rng.random() < 0.3 else f"{f} {v}")
    return " ".join(toks)


def make_case(root: Path, i: int, seed: int = 0) -> tuple[Path, Path, str | None, str | None]:
    """(draft dir, target dir, server line or None, sglang version or None) of case i."""
    rng = random.Random(seed * 100003 + i)
    d, t = root / f"case{i}", root / f"target{i}"
    d.mkdir(parents=True)
    t.mkdir()
    tcfg = target_config(TINY)
    if rng.random() < 0.2:
        tcfg[rng.choice(["num_hidden_layers", "hidden_size", "vocab_size", "architectures"])] = \
            rng.choice(BAD_VALUES)
    (t / "config.json").write_text(json.dumps(tcfg))
    cfg = sglang_config(TINY)
    write_st(d / "model.safetensors", tensors(cfg, dense=True, seed=i))
    mode = rng.randrange(3)
    if mode in (0, 2):  # config broken
        c = bad_config(rng)
        raw = json.dumps(c).encode() if rng.random() < 0.9 else rng.choice(
            [b"", b"{", b"\xff", b"[1,2]", b"1" * 10, b"[" * 5000])
        (d / "config.json").write_bytes(raw)
    else:
        (d / "config.json").write_text(json.dumps(cfg))
    if mode in (1, 2):  # weights broken
        files = bad_safetensors(rng, cfg)
        p = d / "model.safetensors"
        if files == "truncate":
            with open(p, "r+b") as f:
                f.truncate(max(8, p.stat().st_size - rng.randint(1, 5000)))
        elif files == "overlap":
            _overlap(p)
        elif files == "trailing":
            with open(p, "ab") as f:
                f.write(bytes(8))
        elif files == "duplicate":
            write_st(d / "zz.safetensors", {"fc.weight": ("BF16", [64, 192], np.zeros((64, 192),
                                                                                       np.uint16))})
        elif files:
            for name, data in files.items():
                (d / name).write_bytes(data)
    line = bad_server_line(rng, d) if rng.random() < 0.6 else None
    return d, t, line, rng.choice(VERSIONS)


if __name__ == "__main__":
    import tempfile
    import time

    from eagle3_runner.runner.inspect import inspect_draft
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            d, t, line, v = make_case(Path(tmp), i)
            t0 = time.monotonic()
            f = inspect_draft(d, t, line, v)
            print(f"case {i}: {time.monotonic() - t0:.2f}s "
                  f"{[x.code for x in f if x.severity == 'error'][:4]}")
