"""How the embedded engine (engine/speculative.py) compiles its fixed-shape steps, and keeps them
compiled: torch.compile options per device, private code objects per engine, the warm-up that
builds a generate path's graphs once, on its first use, with generate's own inputs, the
"fail_on_recompile" seal, graph counts.

Modes (Engine `cuda_graph`, `compile_backend`): cuda_graph=True on CUDA -> mode="reduce-overhead"
(inductor + CUDA graphs; the KV caches and RoPE tables are marked static addresses, written in
place); compile_backend ("eager", "aot_eager", "inductor") -> that backend on any device, without
CUDA graphs (tests: the dynamo guards are the same); neither -> eager. Always fullgraph=True,
dynamic=False. No silent fallback: a graph break raises (fullgraph), dynamo's suppress_errors is
refused, and after warm-up a new shape raises (sealed).

The fused Triton path (Engine kernels="triton") compiles only on CUDA: on CPU its kernels run
through Triton's interpreter, which dynamo cannot trace (ValueError at construction).
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable, Optional

import torch

from eagle3_runner.engine.steps import draft_extend


def private(fn: Callable) -> Callable:
    """A copy of `fn` with its own code object. Dynamo keys its graph cache and its recompile
    limit (8) on the code object, so without this every Engine of a bench sweep (each num_steps
    a new static shape) would add graphs to one shared, capped cache."""
    g = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                           fn.__closure__)
    g.__doc__ = fn.__doc__
    return g


def compile_options(device: torch.device, cuda_graph: bool, compile_backend: Optional[str],
                    kernels: str) -> Optional[dict]:
    """torch.compile kwargs for the engine's steps (and engine/generate.py's decode step), or None
    (eager). Raises ValueError when
    dynamo's suppress_errors is set (a compile failure would run eagerly, silently), and for
    the triton kernels compiled on a CPU device (the interpreter is not traceable)."""
    if compile_backend is not None:
        kw = dict(backend=compile_backend)
    elif cuda_graph and device.type == "cuda":
        kw = dict(mode="reduce-overhead")
    else:
        return None
    if torch._dynamo.config.suppress_errors:
        raise ValueError("torch._dynamo.config.suppress_errors is set: a compile failure "
                         "would silently run eagerly; unset it or use cuda_graph: false")
    if kernels == "triton" and device.type != "cuda":
        raise ValueError(f"kernels = 'triton' with compile_backend = {compile_backend!r} on "
                         f"{device.type}: dynamo cannot trace Triton's interpreter; use "
                         "kernels='torch' to compile on CPU, or no compile_backend")
    return dict(kw, fullgraph=True, dynamic=False)


def compile_steps(steps: dict, hot: list[str], kw: dict, static: list[torch.Tensor]) -> None:
    """Replace steps[name] for every name in `hot` by its compiled private copy, in place;
    `static`: tensors the steps write or read by address (marked static under CUDA graphs)."""
    if kw.get("mode") == "reduce-overhead":
        for t in static:
            torch._dynamo.mark_static_address(t)
    steps.update({k: torch.compile(private(steps[k]), **kw) for k in hot})


@contextlib.contextmanager
def sealed(compiled: bool):
    """While generating: a compiled step that meets a new input shape/stride raises."""
    if not compiled:
        yield
        return
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    except RuntimeError as e:
        if "fail_on_recompile" not in str(e):
            raise
        raise RuntimeError("engine: a compiled step saw a new input shape/stride after "
                           "warm-up (a bug in engine/speculative.py; results would be timed on a "
                           f"recompiled graph). Bench with cuda_graph: false. {e}") from e


def graph_counts(steps: dict, hot: list[str]) -> dict[str, int]:
    """Compiled graphs per hot step (dynamo cache entries of its private code object)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return {k: len(_debug_get_cache_entry_list(steps[k]._torchdynamo_orig_callable.__code__))
            for k in hot}


@torch.inference_mode()
def warm_up(e, path: str) -> None:
    """Compile the steps one generate path of Engine e uses, once, with inputs built exactly as
    that path builds them: path "baseline" (generate_baseline: decode) or "spec" (generate:
    the chain's verify + greedy chain/round or sampling extend/step, or the tree's steps).
    Compiling per path, on first use, keeps a bench's engines from building graphs they never
    run (a baseline engine's verify, a drafter engine's decode: each a whole-target inductor
    compile, ~40 s on the H200). Writes junk into cache rows 1..W+K, which a prefill or a later
    step rewrites before any query reads."""
    K, dev, S, sl, kn, rope = e.K, e.device, e.steps, e.slots, e.kernels, e.rope
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    if path == "baseline":
        S["decode"](e.target, tok.view(1, 1), sl[1:1 + e.decode_rows], kn)
        return
    d = e.drafter
    if e.topk > 1:
        if d is not None:
            _warm_up_tree(e, tok)
        return
    toks = torch.zeros(1, K + 1, dtype=torch.long, device=dev)
    _, vaux, best = S["verify"](e.target, toks, sl[1:1 + e.W], kn)
    vaux, best = vaux.clone(), best.clone()  # CUDA graphs: the next replay reuses the buffers
    if d is None:
        return
    if e.sampling:
        root, rlog, _ = S["extend"](d, e.dk, e.dv, vaux, toks, sl[1:K + 2], sl[1:2], rope, kn)
        if K > 1:
            tid = d.to_target_ids(rlog.argmax(-1)).clamp(0, e.V - 1)
            S["step"](d, e.dk, e.dv, tid.view(1, 1), root.clone(), sl[2:3], rope, kn)
        return
    # the prompt's first chain: its root comes from the eager step 0 over the prompt
    root, _, rid = draft_extend(d, e.dk, e.dv, vaux, toks, sl[1:K + 2], sl[K:K + 1], rope, kn)
    S["chain"](d, e.dk, e.dv, best[:1].clone(), root, rid, sl[K:K + 1], K, rope, kn)
    S["round"](d, e.dk, e.dv, vaux, best, sl[1:K + 2], sl[1:2], K, rope, kn)


def _warm_up_tree(e, tok) -> None:
    """The tree steps, from a zero root (the shapes and strides of draft_extend's output)."""
    d, S, sl = e.drafter, e.steps, e.slots
    root = torch.zeros(1, 1, d.config.hidden_size, device=e.device, dtype=d.fc.weight.dtype)
    rlog = torch.zeros(1, d.config.draft_vocab_size, device=e.device)
    shape = (e.K, e.topk, e.N, e.V)
    tree = [t.clone() for t in S["tree"](d, e.dk, e.dv, tok, root, rlog, sl[1:2], *shape)]
    for name in ["tree_verify"] + (["tree_verify_sample"] if e.sampling else []):
        out = S[name](e.target, *tree, sl[2:3], sl[:e.W], e.D, e.kernels,
                      *e._uniforms(name, 1.0, None))
        paux, nxt, m, _ = [t.clone() for t in out]
    S["tree_round"](d, e.dk, e.dv, paux, nxt, sl[2:e.D + 3], m, *shape, e.rope, e.kernels)
