"""Where the target lives: the ranks' GPU groups, and whether the target fits them (`runner plan`
section `memory`, and the loader's max_memory in targets/load.py). No torch.

Layout. A stage that runs the target (extract; train with features: online; regenerate, one GPU
always) gets `ranks` = its nproc_per_node processes on a node of G GPUs:
- target.device_map unset: every rank holds a whole target on GPU `rank` (ranks <= G).
- target.device_map set (auto or explicit): one target REPLICA per rank, split over a group of
  g = G / ranks GPUs (ranks must divide G); rank r owns GPUs r*g .. r*g+g-1 (`replica_gpus`, a
  pure function) and extracts its own shards / trains on its own slice of each batch. One rank
  with device_map: auto on an 8-GPU node = one replica over all 8 (pipeline split: one GPU
  computes at a time).
The plan cannot see a Slurm node's GPUs from the login node: G is executor.gpus_per_node (the
stage's override first), the memory per GPU executor.gpu_memory_gb (GiB, as torch and
nvidia-smi count: an H200 has ~139, an H100 ~79). Undeclared = not checked, and the plan says so.

Fit, per GPU (GiB = 2**30 bytes): usable = gpu_memory_gb x USABLE (CUDA context, allocator
slack); activations = runner/target_size.py activation_bytes for the stage's batch (extract:
batch_tokens; online train: this rank's share of batch_size x max_length) on EVERY GPU of a
group (each runs its layers on the whole batch); the weights per GPU = ceil(L / g) of the
largest decoder layer + the larger of embedding and lm_head (accelerate keeps layers whole),
or weights / g + one layer's share when only declared totals are known. Online training also
keeps the drafter (fp32 weights, grads and two AdamW moments: 16 B per parameter), its frozen
fp32 embedding and the target's lm_head copy on the group's first GPU (TTT activations are not
counted). target.max_memory caps the weights per GPU (`gpu`, or a group index) and lets the rest
go to CPU memory (`cpu`: accelerate offloads those layers and streams them to the GPU per
forward). A plan whose target cannot fit is refused, naming the fix.

A stage whose engine is SGLang (runner/engines.py choose_engine) holds no target itself: a server
launched on GPUs 0 .. tp x dp - 1 of the stage's node holds it, dp replicas of tp GPUs each
(`server_memory`); its weights per GPU ~ weights / tp (attention heads, MLP columns, experts within
the ep group and the vocab all split over tp), within the share SGLang takes
(target.sglang.mem_fraction_static, else SGLANG_FRACTION); what SGLang leaves of each GPU holds
the online drafter. A server you run (target.sglang.server) is not checked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eagle3_runner.runner.engines import CAPTURE, SGLANG, choose_engine, stage_role, target_cfg
from eagle3_runner.runner.errors import PlanError
from eagle3_runner.runner.stages import stage_nproc
from eagle3_runner.runner.target_size import DTYPE_BITS, FUSED_ATTENTION, activation_bytes, weight_bytes

USABLE = 0.95  # of a GPU's memory, for tensors (CUDA context and allocator slack take the rest)
GIB = 2 ** 30
# the share of an H200 SGLang 0.5.14 takes when --mem-fraction-static is not given (server_args.py
# _handle_gpu_memory_settings: (memory - reserved) / memory; ~0.81 with --chunked-prefill-size -1,
# ~0.93 with 8k chunks): the lower end, for the fit check
SGLANG_FRACTION = 0.8
KV_SHARE = 0.1  # of SGLang's share, at least, left for the KV cache next to the weights


# ----------------------------------------------------------------------------------------------
# layout


def replica_gpus(rank: int, ranks: int, gpus: int, split: bool = True) -> list[int]:
    """The GPU indices rank `rank` of `ranks` (local ranks of one node) holds its target on,
    out of `gpus` visible ones: [rank] unsplit, else the rank's group of gpus // ranks.
    Raises PlanError when the ranks cannot share the GPUs that way (layout_problem)."""
    problem = layout_problem(gpus, ranks, split)
    if problem:
        raise PlanError(problem)
    if not split:
        return [rank]
    g = gpus // ranks
    return list(range(rank * g, (rank + 1) * g))


def layout_problem(gpus: int, ranks: int, split: bool, where: str = "") -> str | None:
    """Why `ranks` ranks cannot share `gpus` GPUs (module docstring), or None."""
    at = f"{where}: " if where else ""
    if gpus < 1:
        return (f"{at}the target runs on CUDA but no GPU is visible or declared; set "
                "executor.gpus_per_node (or target.device: cpu)")
    if not split and ranks > gpus:
        return (f"{at}{ranks} ranks but {gpus} GPUs: each rank needs its own GPU; set "
                f"nproc_per_node <= {gpus}")
    if split and gpus % ranks:
        fit = [n for n in range(1, gpus + 1) if gpus % n == 0]
        return (f"{at}{ranks} ranks cannot split {gpus} GPUs into equal groups "
                f"(target.device_map is set): use nproc_per_node {' or '.join(map(str, fit))}")
    return None


def layer_devices(device_map: dict, layers: int) -> dict[int, int | str]:
    """An explicit target.device_map ({"0-29": 0, "30-60": 1} or single layers "7": "cpu") as
    {decoder layer: device}: a GPU index within the rank's group, "cpu" or "disk" (offloaded:
    the weights live there and run on the group's first GPU, streamed per forward). Raises
    ValueError naming the key when a key is not a layer or range, ranges overlap, or the layers
    0..layers-1 are not all covered."""
    out: dict[int, int | str] = {}
    for key, dev in device_map.items():
        a, _, b = str(key).partition("-")
        if not (a.strip().isdigit() and (not b or b.strip().isdigit())):
            raise ValueError(f"target.device_map key {key!r}: give a decoder layer (\"7\") or "
                             "a range (\"0-29\")")
        lo, hi = int(a), int(b or a)
        if lo > hi or hi >= layers:
            raise ValueError(f"target.device_map key {key!r}: layers run 0..{layers - 1}")
        if isinstance(dev, int) and dev < 0:
            raise ValueError(f"target.device_map[{key!r}] = {dev}: a GPU index is >= 0")
        for i in range(lo, hi + 1):
            if i in out:
                raise ValueError(f"target.device_map key {key!r}: layer {i} is mapped twice")
            out[i] = dev
    missing = [i for i in range(layers) if i not in out]
    if missing:
        raise ValueError(f"target.device_map: layers {missing[0]}..{missing[-1]} "
                         f"({len(missing)} of {layers}) have no device; map every layer")
    return out


def stage_target(spec, stage: str, cfg: dict | None = None) -> str | None:
    """How `stage` holds the target: "server" (its engine is SGLang: a server holds it),
    "split" (may use target.device_map: extract, online train), "whole" (regenerate: the
    embedded engine on one GPU), or None (it does not run it). cfg: the target's config when
    readable (the engine choice reads it). Raises PlanError when target.engine cannot run it."""
    try:
        choice = choose_engine(spec, stage, cfg)
    except ValueError as e:
        raise PlanError(str(e))
    if choice is None:
        return None
    if choice.engine == SGLANG:
        return "server"
    return "split" if stage_role(spec, stage) == CAPTURE else "whole"


GPU_SIGNS = ("/proc/driver/nvidia/gpus", "/dev/nvidia0", "/dev/kfd")  # NVIDIA driver, AMD ROCm


def gpu_visible() -> bool:
    """Whether this machine shows a GPU torch could use, without importing torch: the NVIDIA
    driver's /proc entries or device node, or ROCm's /dev/kfd."""
    for sign in map(Path, GPU_SIGNS):
        try:
            if sign.is_dir() and any(sign.iterdir()) or not sign.is_dir() and sign.exists():
                return True
        except OSError:
            continue
    return False


def device_problem(spec, stage: str, sid: str) -> str | None:
    """target.device: cuda for a stage that loads the target (or benches on the embedded engine)
    on a machine that shows no GPU: the stage would fail when it loads the target."""
    p = spec.stages.bench
    try:  # an SGLang server ("server") holds the target on its own GPUs
        local = stage_target(spec, stage, target_cfg(spec)) in ("split", "whole")
    except PlanError:  # an engine that cannot run the stage: the plan's engine check says so
        return None
    loads = local or (stage == "bench" and p is not None and p.backend in ("embedded", "both"))
    if not loads or not str(spec.target.device).startswith("cuda") or gpu_visible():
        return None
    return (f"target.device = {spec.target.device!r}: this machine shows no GPU "
            f"({', '.join(GPU_SIGNS)}), so {sid} would fail when it loads the target. Use "
            "target.device: auto (the GPU when there is one, else the CPU), or run on a GPU "
            "machine.")


def splits(spec, stage: str, cfg: dict | None = None) -> bool:
    """Whether `stage`'s ranks each hold a target split over a GPU group."""
    return spec.target.device_map is not None and stage_target(spec, stage, cfg) == "split"


def _stage_gpus(spec, stage: str) -> int | None:
    ex = spec.executor
    over = getattr(ex, "stages", {}).get(stage)
    if over is not None and over.gpus_per_node is not None:
        return over.gpus_per_node
    return ex.gpus_per_node


# ----------------------------------------------------------------------------------------------
# memory


def cpu_reason(spec, stage: str = "") -> str | None:
    """Why the target of `stage` runs on the CPU, or None: target.device cpu; or auto under the
    local executor on a machine that shows no GPU (gpu_visible); or auto in a Slurm job given
    no GPU (executor.gpus_per_node 0, or the stage's own). A Slurm job's node is not this
    machine."""
    d = spec.target.device
    if d == "cpu":
        return "target.device cpu"
    if d != "auto":
        return None
    if spec.executor.kind == "local":
        return None if gpu_visible() else "target.device auto, and this machine shows no GPU"
    return "target.device auto, and the job gets no GPU (executor.gpus_per_node 0)" \
        if _stage_gpus(spec, stage) == 0 else None


def on_cpu(spec, stage: str = "") -> bool:
    """Whether the target of `stage` runs on the CPU (cpu_reason)."""
    return cpu_reason(spec, stage) is not None


def _dtype_bits(spec) -> int:
    dt = spec.target.dtype
    if dt == "auto":  # float32 on CPU, bfloat16 on CUDA (targets/load.py)
        dt = "float32" if on_cpu(spec) else "bfloat16"
    return DTYPE_BITS[dt]


def _geometry(spec, cfg: dict | None) -> dict:
    """The config the estimates read: the target's own, else the spec's declared geometry (the
    drafter's heads and intermediate size standing in for the target's)."""
    if cfg:
        return cfg
    t, d = spec.target, spec.drafter
    return {"hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers,
            "vocab_size": t.vocab_size, "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
            "intermediate_size": d.intermediate_size}


def weights(spec, cfg: dict | None) -> dict | None:
    """{"bytes", "parameters", "per_gpu": f(g), "how"} of the target as loaded, from
    target.num_parameters_b + target.weight_bits when declared, else the config (None when
    neither is known)."""
    t, bits = spec.target, _dtype_bits(spec)
    L = t.num_hidden_layers
    if t.num_parameters_b is not None:
        wbits = t.weight_bits if t.weight_bits is not None else bits
        total = t.num_parameters_b * 1e9 * wbits / 8
        return {"bytes": total, "parameters": t.num_parameters_b * 1e9,
                "per_gpu": lambda g: total if g == 1 else total / g + total / L,
                "how": f"target.num_parameters_b {t.num_parameters_b:g} x target.weight_bits "
                       f"{wbits:g} (declared)"}
    if not cfg:
        return None
    try:
        w = weight_bytes(cfg, bits)
    except ValueError:
        return None
    return {"bytes": w["bytes"], "parameters": w["parameters"],
            "per_gpu": lambda g: w["bytes"] if g == 1 else
            math.ceil(L / g) * w["layer_bytes"] + w["edge_bytes"],
            "how": f"from the target's config: {w['how']}"}


def batch_shape(spec, stage: str, ranks: int) -> tuple[int, int]:
    """(padded tokens per forward, longest sample) of one capture in `stage`."""
    T = spec.data.max_length
    if stage == "extract":
        return spec.stages.extract.batch_tokens, T
    if stage == "train":
        return math.ceil(spec.stages.train.batch_size / ranks) * T, T
    return spec.stages.regenerate.batch_size * T, T


def drafter_state_bytes(spec, cfg: dict | None) -> int:
    """What online training keeps on the drafter's GPU: the drafter's parameters x 16 B (fp32
    weights, grads, AdamW m and v), its frozen fp32 copy of the target embedding and the
    target's lm_head + norm in the target dtype. Missing geometry counts as the target's."""
    g, d = _geometry(spec, cfg), spec.drafter
    H, V = spec.target.hidden_size, spec.target.vocab_size
    Hd = spec.draft_hidden
    nh = d.num_attention_heads or g.get("num_attention_heads") or 1
    nkv = d.num_key_value_heads or g.get("num_key_value_heads") or nh
    hd = d.head_dim or g.get("head_dim") or Hd // nh
    inter = d.intermediate_size or g.get("intermediate_size") or 4 * Hd
    p = (len(spec.aux_ids) * H * Hd + 2 * Hd * (nh + 2 * nkv) * hd + nh * hd * Hd
         + 3 * Hd * inter + d.draft_vocab_size * Hd + 4 * Hd)
    return int(16 * p + 4 * V * H + V * H * _dtype_bits(spec) / 8)


def stage_memory(spec, stage: str, cfg: dict | None) -> dict:
    """The memory entry of one stage that runs the target (module docstring): layout, bytes and
    the verdict. {"stage", "layout", "replicas", "gpus_per_replica", "weights_gib",
    "per_gpu_gib", "activations_gib", "drafter_gib", "usable_gib", "fits" (True/False/None =
    not checked), "why", "how", "assumptions"}."""
    t, kind = spec.target, stage_target(spec, stage, cfg)
    if kind == "server":
        return server_memory(spec, stage, cfg)
    ranks = stage_nproc(spec, stage)
    split = splits(spec, stage, cfg)
    out: dict[str, Any] = {"stage": stage, "replicas": ranks, "fits": None}
    if (why := cpu_reason(spec, stage)) is not None:
        return {**out, "layout": f"{ranks} replica(s) on the CPU ({why})",
                "why": "runs on the CPU: GPU memory not checked"}
    G = _stage_gpus(spec, stage)
    if G is not None and G > 0 and (problem := layout_problem(G, ranks, split, stage)):
        raise PlanError(problem)
    g = (G // ranks if G else None) if split else 1
    out["gpus_per_replica"] = g
    if split:
        mode = "target.device_map " + ("auto" if t.device_map == "auto" else "explicit")
        groups = f"rank r -> GPUs r*{g}..r*{g}+{g - 1}" if g and ranks > 1 else \
            (f"rank 0 -> GPUs 0-{g - 1}" if g else "GPUs: executor.gpus_per_node not declared")
        out["layout"] = f"{ranks} replica(s) x {g or '?'} GPUs ({mode}; {groups})"
    else:
        why = " (the embedded engine)" if kind == "whole" else ""
        out["layout"] = f"{ranks} replica(s) x 1 GPU{why}: a whole target per rank"
    w = weights(spec, cfg)
    if w is None:
        return {**out, "why": "target size unknown: make target.path readable or declare "
                              "target.num_parameters_b and target.weight_bits"}
    tokens, T = batch_shape(spec, stage, ranks)
    act_b = activation_bytes(_geometry(spec, cfg), tokens, T, _dtype_bits(spec) // 8,
                             t.attn_implementation) if kind == "split" else 0
    drafter = drafter_state_bytes(spec, cfg) if stage == "train" else 0
    out.update(weights_gib=w["bytes"] / GIB, parameters=w["parameters"], how=w["how"],
               activations_gib=act_b / GIB, drafter_gib=drafter / GIB)
    out["assumptions"] = (
        f"activations for {tokens:,} tokens at max_length {T:,}"
        + ("" if t.attn_implementation in FUSED_ATTENTION else
           ", eager attention scores (declare target.attn_implementation sdpa to drop them)")
        + ("" if cfg else "; the target's heads and MLP from drafter.* (config.json not "
           "readable here)")
        if kind == "split" else "weights only (activations and KV cache not counted)")
    gib = spec.executor.gpu_memory_gb
    if gib is None:
        return {**out, "why": "GPU memory not declared (executor.gpu_memory_gb): not checked"}
    usable = gib * USABLE * GIB
    out["usable_gib"] = usable / GIB
    mm = t.max_memory or {}
    if split and not g:
        return {**out, "why": "executor.gpus_per_node not declared: the split is not checked"}
    per = w["per_gpu"](g)  # balanced, layers whole
    cap = mm["gpu"] * GIB if "gpu" in mm else usable - act_b  # weights room per GPU
    cap0 = cap if "gpu" in mm else cap - drafter  # the group's first GPU holds the drafter
    cpu = mm.get("cpu", 0) * GIB
    room = cap0 + (g - 1) * cap  # what the group's GPUs hold, layer slack counted in `per`
    spill = max(0.0, g * per - room) if split and cpu else 0.0
    on0 = min(per, cap0)
    rest = min(cap, (g * per - on0) / (g - 1)) if g > 1 else 0.0
    out["weights_per_gpu_gib"] = max(on0, rest) / GIB
    out["weights_first_gpu_gib"] = on0 / GIB
    out["per_gpu_gib"] = max(on0 + drafter, rest) / GIB + act_b / GIB
    out["cpu_gib"] = spill / GIB
    fits = g * per <= room or (spill > 0 and spill <= cpu)
    if "gpu" in mm and cap + act_b + drafter > usable:
        fits = False
    out["fits"] = fits
    if not fits:
        def fits_with(n: int) -> bool:  # n replicas of G // n GPUs, the rest unchanged
            act = activation_bytes(_geometry(spec, cfg), batch_shape(spec, stage, n)[0], T,
                                   _dtype_bits(spec) // 8, t.attn_implementation)
            n_g = G // n
            return n_g * w["per_gpu"](n_g) <= n_g * (usable - act) - drafter
        out["why"] = _fix(stage, w, g, ranks, G, cap, act_b, drafter, split, fits_with)
    else:
        out["why"] = "fits"
    return out


def server_memory(spec, stage: str, cfg: dict | None) -> dict:
    """The memory entry of a stage whose target is an SGLang server (module docstring): the same
    keys as stage_memory. Raises PlanError when tp x dp exceeds the stage's GPUs, or an extract
    asks for several ranks (one process feeds the server; its dp replicas parallelise)."""
    o = spec.target.sglang_options
    out: dict[str, Any] = {"stage": stage, "replicas": o.dp, "fits": None, "server": True}
    if o.server is not None:
        return {**out, "layout": f"the SGLang server at {o.server} (yours)",
                "why": "a server you run: its memory is not checked"}
    G, ranks = _stage_gpus(spec, stage), stage_nproc(spec, stage)
    if G is not None and G < o.gpus:
        raise PlanError(f"{stage}: target.sglang tp x dp = {o.tp} x {o.dp} = {o.gpus} GPUs, but "
                        f"the stage has {G} (executor.gpus_per_node or executor.stages.{stage}."
                        "gpus_per_node); lower tp or dp, or give the stage more GPUs")
    if stage == "extract" and ranks > 1:
        raise PlanError(f"extract through SGLang runs one process (the server's dp replicas "
                        f"parallelise it), not {ranks}: set executor.stages.extract."
                        "nproc_per_node: 1, or target.sglang.dp for more replicas")
    ep = f", ep {o.ep}" if o.ep > 1 else ""
    out["layout"] = (f"SGLang server, {o.dp} replica(s) x tp {o.tp}{ep} = GPUs 0-{o.gpus - 1}"
                     + (f" of {G}" if G else "") + (f"; {ranks} training ranks beside it"
                                                    if stage == "train" else ""))
    out["gpus_per_replica"] = o.tp
    w = weights(spec, cfg)
    if w is None:
        return {**out, "why": "target size unknown: make target.path readable or declare "
                              "target.num_parameters_b and target.weight_bits"}
    frac = o.mem_fraction_static or SGLANG_FRACTION
    drafter = drafter_state_bytes(spec, cfg) if stage == "train" else 0
    per = w["bytes"] / o.tp
    out.update(weights_gib=w["bytes"] / GIB, parameters=w["parameters"], how=w["how"],
               activations_gib=0.0, drafter_gib=drafter / GIB, weights_per_gpu_gib=per / GIB,
               weights_first_gpu_gib=per / GIB, cpu_gib=0.0,
               assumptions=f"weights / tp; SGLang takes {frac:g} of each GPU "
                           f"({'target.sglang.mem_fraction_static' if o.mem_fraction_static else 'assumed: not declared'})"
                           ", its KV cache and activations inside that share")
    gib = spec.executor.gpu_memory_gb
    if gib is None:
        return {**out, "why": "GPU memory not declared (executor.gpu_memory_gb): not checked"}
    share = gib * GIB * frac
    out["usable_gib"] = share / GIB
    out["per_gpu_gib"] = per / GIB + drafter / GIB
    if per > share * (1 - KV_SHARE):
        out["fits"] = False
        out["why"] = (f"{stage}: the target needs ~{per / GIB:,.1f} GiB of weights per GPU at tp "
                      f"{o.tp}, SGLang's share of a GPU is ~{share / GIB:,.1f} GiB and its KV "
                      f"cache needs room beside them: raise target.sglang.tp (GPUs per replica) "
                      f"or target.sglang.mem_fraction_static")
    elif drafter and drafter > gib * GIB * (USABLE - frac):
        out["fits"] = False
        out["why"] = (f"train: the drafter's ~{drafter / GIB:,.1f} GiB of state does not fit "
                      f"the {gib * (USABLE - frac):,.1f} GiB SGLang leaves of a GPU "
                      f"(mem_fraction_static {frac:g}); lower target.sglang.mem_fraction_static "
                      "or train offline (stages.extract)")
    else:
        out["fits"], out["why"] = True, "fits"
    return out


def _fix(stage, w, g, ranks, G, cap, act_b, drafter, split, fits_with) -> str:
    """The refusal: what does not fit, and the change that makes it fit (fits_with(n): whether
    n replicas over the node's G GPUs would)."""
    need = w["per_gpu"](g) / GIB
    beside = f"~{act_b / GIB:,.1f} GiB of activations" + (
        f" (and ~{drafter / GIB:,.1f} GiB of drafter state on the first)" if drafter else "")
    head = (f"{stage}: the target needs ~{need:,.1f} GiB of weights per GPU "
            f"({w['bytes'] / GIB:,.1f} GiB over {g} GPU(s)) but a GPU has room for "
            f"~{max(cap, 0) / GIB:,.1f} GiB next to {beside}")
    if not split:
        return head + ": set target.device_map: auto to split it over a group of the node's GPUs"
    if G and ranks > 1:
        ok = [n for n in range(ranks - 1, 0, -1) if G % n == 0 and fits_with(n)]
        if ok:
            return head + (f": use fewer replicas (executor.stages.{stage}.nproc_per_node: "
                           f"{ok[0]}, {G // ok[0]} GPUs each)")
    return head + (": use more GPUs (executor.gpus_per_node), CPU offload (target.max_memory: "
                   "{cpu: GiB}), a quantized checkpoint, or a smaller batch "
                   f"({'stages.extract.batch_tokens' if stage == 'extract' else 'batch_size'})")


def report(entries: list[tuple[str, Any, dict | None]]) -> dict:
    """The plan's memory section for (stage id, spec, target config or None) of each stage that
    runs and loads the target. Raises PlanError for the first that cannot fit."""
    out = []
    for sid, spec, cfg in entries:
        m = {**stage_memory(spec, sid.split("@")[0], cfg), "stage": sid}
        if m["fits"] is False:
            raise PlanError(m["why"] + f" [{m['layout']}; {m.get('assumptions', '')}]")
        out.append(m)
    return {"stages": out}


def render(d: dict) -> list[str]:
    """The plan text's memory lines."""
    lines = []
    for m in d.get("stages", []):
        lines.append(f"memory: {m['stage']}: layout {m['layout']}")
        if "weights_gib" in m:
            lines.append(f"memory: {m['stage']}: target ~{m['parameters'] / 1e9:,.1f}B "
                         f"parameters, ~{m['weights_gib']:,.1f} GiB of weights ({m['how']})")
        if m.get("per_gpu_gib") is not None and m.get("server"):
            beside = f" + ~{m['drafter_gib']:,.1f} GiB drafter state beside it" \
                if m["drafter_gib"] else ""
            lines.append(f"memory: {m['stage']}: ~{m['weights_per_gpu_gib']:,.1f} GiB weights "
                         f"per GPU in SGLang's ~{m['usable_gib']:,.1f} GiB share{beside} "
                         f"(executor.gpu_memory_gb, declared, not measured): {m['why']}; "
                         f"{m['assumptions']}")
        elif m.get("per_gpu_gib") is not None:
            weights = f"~{m['weights_per_gpu_gib']:,.1f} GiB weights" if not m["drafter_gib"] \
                else (f"the first GPU ~{m['weights_first_gpu_gib']:,.1f} GiB weights + "
                      f"~{m['drafter_gib']:,.1f} GiB drafter state, the others up to "
                      f"~{m['weights_per_gpu_gib']:,.1f} GiB weights")
            cpu = f", ~{m['cpu_gib']:,.1f} GiB offloaded to CPU memory" if m.get("cpu_gib") else ""
            lines.append(f"memory: {m['stage']}: up to ~{m['per_gpu_gib']:,.1f} GiB per GPU "
                         f"({weights}; + ~{m['activations_gib']:,.1f} GiB activations{cpu}) of "
                         f"{m['usable_gib']:,.1f} usable (executor.gpu_memory_gb x {USABLE}, "
                         f"declared, not measured): {m['why']}; {m['assumptions']}")
        else:
            lines.append(f"memory: {m['stage']}: {m['why']}")
    return lines
