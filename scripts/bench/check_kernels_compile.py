#!/usr/bin/env python
"""Compile every Triton launch of the fused decode paths for a GPU architecture, on a machine
without a GPU (Triton's frontend, LLVM and its bundled ptxas run on the CPU): catches what the
interpreter lets through (non-constexpr globals, branch type mismatches, tl.dot shape rules,
shared-memory overflow) before the few runs on the device.

How: JITFunction.__getitem__ is patched to record each launch instead of running it, the fused
target forward (SmolLM2-135M geometry: W = 1, 5 and a 16-node tree), the draft step (step 0 with
top-8 and a chain step) and decode_attention (B = 1024 and flash-decoding splits) run their host
code on CPU tensors, and each distinct specialisation goes through
triton.compile(ASTSource(...), target=GPUTarget("cuda", ARCH, 32)). Prints one line per kernel
(shared memory bytes) and exits 1 if any fails. Uses Triton internals (ASTSource, JITFunction
.params): written against triton 3.9. About 35 s on 2 cores.

  python scripts/bench/check_kernels_compile.py            # sm_90 (H100 / H200)
  python scripts/bench/check_kernels_compile.py --arch 80
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the real JIT, before any kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
      torch.int32: "i32", torch.bool: "i1"}


def signature(fn, args, kwargs) -> tuple[dict, dict]:
    """(signature, constexprs) for ASTSource from one recorded launch."""
    vals = dict(zip(fn.arg_names, args), **kwargs)
    sig, const = {}, {}
    for p in fn.params:
        v = vals[p.name]
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + DT[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
        else:
            sig[p.name] = "fp32"
    return sig, const


def record_launches() -> list:
    """Run the fused paths' host code on CPU tensors; returns the launches (fn, args, kwargs)."""
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    from eagle3_runner.models.llama import Llama, LlamaConfig
    from eagle3_runner.kernels.attention import decode_attention
    from eagle3_runner.kernels.draft_decode import _forward_triton, rope_table
    from eagle3_runner.kernels.llama_decode import forward_triton
    calls = []
    JITFunction.__getitem__ = lambda self, grid: (lambda *a, **k: calls.append((self, a, k)))
    bf, z = torch.bfloat16, torch.zeros
    c = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=2, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536)
    m = Llama(c, (0, 1)).to(bf)
    m.setup_cache(1, 512)
    for W, tm in ((1, None), (5, None), (16, torch.ones(16, 16, dtype=torch.bool).tril())):
        forward_triton(m, z(1, W, dtype=torch.long), torch.arange(W), torch.tensor([10]), tm)
    dc = DraftConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, draft_vocab_size=32000,
                     target_hidden_size=576, aux_layer_ids=[1, 14, 26])
    d = Eagle3Draft(dc).to(bf)
    kc = z(1, 3, 512, 64, dtype=bf)
    rope = rope_table(d, 512)
    ids1, ids5 = z(1, 1, dtype=torch.long), z(1, 5, dtype=torch.long)
    _forward_triton(d, kc, kc.clone(), ids5, torch.arange(5), torch.tensor([3]), None, None,
                    z(1, 5, 1728, dtype=bf), rope, 8)
    _forward_triton(d, kc, kc.clone(), ids1, torch.arange(1), torch.tensor([3]), None,
                    z(1, 1, 576, dtype=bf), None, rope, 1)
    k = z(1024, 3, 512, 64, dtype=bf)
    decode_attention(z(1024, 9, 1, 64, dtype=bf), k, k, z(1024, dtype=torch.int32))
    decode_attention(z(1, 9, 1, 64, dtype=bf), k[:1], k[:1], z(1, dtype=torch.int32), splits=8)
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90, 80")
    a = ap.parse_args(argv)
    seen, bad = set(), 0
    for fn, args, kwargs in record_launches():
        sig, const = signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted(sig.items())),
               tuple(sorted((k, str(v)) for k, v in const.items())))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        shown = {k: v for k, v in const.items() if not isinstance(v, bool)}
        try:
            cc = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", a.arch, 32))
            print(f"ok   {fn.__name__:16s} shared {cc.metadata.shared:6d} B  {time.time() - t0:4.1f} s  "
                  f"{shown}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every kernel
            bad += 1
            print(f"FAIL {fn.__name__:16s} {shown}\n{type(e).__name__}: {e}", flush=True)
    print(f"{len(seen)} specialisations for sm_{a.arch}, triton {triton.__version__}: {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
