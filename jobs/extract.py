"""The extract stage: run the target over the training conversations and store what the drafter
trains on, in the format documented in targets/features.py.

What is captured, and the capture itself: targets/capture.py (shared with the online train stage).
Per token on disk: (3+1)*H*bytes + 9 B (targets/features.py); input_ids int64 and loss_mask uint8
(1 = assistant token, data/conversations.py) are stored next to the hidden states.

Shards and batching: the samples are sorted by length, longest first (ties by index), and cut
into shards of params.shard_samples in that order; each shard records its samples' dataset
indices (sample_ids), so targets/features.py still serves sample i as the i-th tokenised sample.
Within a shard, samples are packed so that batch_size * longest <= params.batch_tokens (right
padding; causal attention keeps the padding invisible to real tokens). Length-sorted shards
waste little compute on padding, and each shard is complete (and written) as soon as it is
computed, so the disk works alongside the GPU; the shortest samples come last, so the write
left after the last forward is the smallest shard (BENCHMARKS.md, extraction, varlen). Features
are stored in the compute dtype (float32 on CPU).

Atomicity, durability and resume of the shard files: targets/shards.py.

Data parallel (ctx.world_size > 1, launched by runner/launch.py): every rank tokenises the same
samples and cuts the same shards; shard s goes to one rank (assign_shards: balanced by tokens,
a pure function of the shard sizes and the world size). Each rank verifies/computes only its own
shards, so the shard files are the single-rank ones and a partial dir resumes under any number
of ranks. After a gather, rank 0 alone writes target_head/target_config and ONE features.json
listing every shard in shard order.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3_runner.runner import dist as D
from eagle3_runner.runner.cpu import cores, local_ranks
from eagle3_runner.targets.capture import (as_target, capture, capture_engine, capture_manifest,
                                          load_target_data, write_json)
from eagle3_runner.targets.features import FORMAT, MANIFEST
from eagle3_runner.targets.shards import (drop_shard, reusable_sha, sha_record, shard_index, sync_shards,
                         write_atomic, write_shard)
from eagle3_runner.runner.files import sha256_file
from eagle3_runner.runner.stage import StageContext

SHARD = "shard-{:05d}.safetensors"


# ----------------------------------------------------------------------------------------------
# batching and capture


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches: longest first, batch_size * max_len <= batch_tokens (a
    sample longer than batch_tokens gets a batch of its own). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def forward_features(model, batch: list[list[int]], aux_ids: list[int],
                     pad_id: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """capture() moved to the CPU (through pinned memory on CUDA) and split per sample:
    [(aux [T_i, len(aux_ids)*H], last [T_i, H])]."""
    aux, last = capture(model, batch, aux_ids, pad_id)
    pin = aux.is_cuda
    a = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=pin).copy_(aux)
    b = torch.empty(last.shape, dtype=last.dtype, pin_memory=pin).copy_(last)
    return [(a[i, :len(x)], b[i, :len(x)]) for i, x in enumerate(batch)]


# ----------------------------------------------------------------------------------------------
def default_writers(target) -> int:
    """Shard writer threads: 1 on CPU (the cores compute); on CUDA up to 12, leaving 4 cores to
    the main thread. sha256 and file writes release the GIL, so writers overlap each other and
    the forward passes. Measured on an H200 (SmolLM2, 8x2048 bf16 shards of 75 MB, 16 cores):
    extract/plain = 0.49 with 4 writers, 0.67 with 8, 0.70-0.75 with 12, 0.65 with 16 (then
    with an fsync per shard, since replaced by one sync_shards pass per rank).
    Several ranks on one node (LOCAL_WORLD_SIZE) split the cores unless Slurm already pinned
    this process to its share. target: a loaded model or a TargetData."""
    if as_target(target).device.type == "cuda":
        return max(1, min(12, _my_cores() - 4))
    return 1


def _local_ranks() -> int:
    return local_ranks()


def _my_cores() -> int:
    """Logical CPUs for this process (runner/cpu.py cores: its CPU affinity, or the node's
    CPUs / local ranks when it is not pinned: the local launcher and torchrun do not pin)."""
    return cores(physical=False)


def inflight_budget() -> int:
    """Bytes of finished-but-unwritten shards kept in (pinned) host memory: a quarter of the
    RAM, at most 32 GiB, divided among the ranks of this node (LOCAL_WORLD_SIZE). Bounds memory
    when shards are large (shard_samples x length x bytes/token)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return int(min(32 << 30, ram // 4) // _local_ranks())


def assign_shards(tokens: list[int], world: int) -> list[list[int]]:
    """Shard indices per rank: longest shard first to the least-loaded rank (ties: lower shard,
    lower rank), each rank's list ascending. tokens[s] = tokens of shard s. Deterministic, so
    every rank computes the same assignment without communicating."""
    load, out = [0] * world, [[] for _ in range(world)]
    for s in sorted(range(len(tokens)), key=lambda s: (-tokens[s], s)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += tokens[s]
        out[r].append(s)
    return [sorted(x) for x in out]


def extract_samples(target, samples: list[tuple[list[int], list[int]]], aux_ids: list[int],
                    out_dir: Path, shard_samples: int, batch_tokens: int, pad_id: int = 0,
                    progress: bool = True, writers: int | None = None, rank: int = 0,
                    world: int = 1, length_sorted: bool = True) -> dict:
    """Write shards for `samples` into out_dir, resuming after complete shards. target: the
    loaded model, or a TargetData (targets/capture.py: the model or the SGLang capture server).

    Shard s holds the samples at positions s*shard_samples... of the length-sorted order
    (module docstring); length_sorted=False keeps the dataset order instead (the benchmark's
    baseline).
    Per shard: length-bucketed batches -> capture() -> asynchronous copies into a reused
    (pinned) host buffer -> a writer thread serialises, hashes and atomically renames it (no
    fsync); at the end sync_shards fsyncs this rank's shards and out_dir once.
    rank/world: only this rank's shards (assign_shards) are verified and computed.
    Returns {"shards": [{"file", "num_samples", "num_tokens", "sha256", "sample_ids"}] (this
    rank's, in shard order), "shard_ids" (their indices), "resumed_shards", "computed_tokens",
    "seconds" (all of it, the final fsync included), "sync_seconds" (the final fsync)}.
    Raises StageError when a write fails (e.g. disk full); shards that completed stay, and a
    re-run resumes after them."""
    from tqdm import tqdm
    out_dir = Path(out_dir)
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i][0]), i)) \
        if length_sorted else list(range(len(samples)))
    group_ids = [order[i:i + shard_samples] for i in range(0, len(order), shard_samples)]
    groups = [[samples[i] for i in ids] for ids in group_ids]
    mine = assign_shards([sum(len(x[0]) for x in g) for g in groups], world)[rank]
    stale = out_dir.glob(".tmp-shard-*") if world == 1 else \
        (out_dir / f".tmp-{SHARD.format(s)}" for s in mine)  # other ranks write theirs
    for f in stale:
        f.unlink(missing_ok=True)
    td = as_target(target, pad_id)
    H = td.hidden_size
    width = len(aux_ids) * H
    dtype = td.dtype
    cuda = td.device.type == "cuda"
    writers = writers or default_writers(td)
    shards, resumed, todo = [None] * len(groups), 0, []
    for s in mine:
        group = groups[s]
        path = out_dir / SHARD.format(s)
        sha = reusable_sha(path, group, group_ids[s], width)
        if sha:
            shards[s] = {"file": path.name, "num_samples": len(group),
                         "num_tokens": sum(len(x[0]) for x in group), "sha256": sha,
                         "sample_ids": group_ids[s]}
            resumed += 1
        else:
            drop_shard(path)
            todo.append(s)
    total = sum(len(x[0]) for s in todo for x in groups[s])
    bar = tqdm(total=total, unit="tok", desc="extract", disable=not progress, smoothing=0.1)
    t0, pending, budget, free = time.perf_counter(), [], inflight_budget(), []
    # one host buffer size for all of this rank's shards (the largest one's bytes), so every
    # written buffer serves any later shard: pinning is slow, and torch's pinned cache reuses a
    # block only for the same power-of-two size. At most min(writers, budget / cap) + 1 exist.
    esize = dtype.itemsize
    cap = max((sum(len(x[0]) for x in groups[s]) for s in todo), default=0) * (width + H) * esize
    with ThreadPoolExecutor(max_workers=writers) as pool:
        try:
            for s in todo:
                group = groups[s]
                idx = shard_index(group, group_ids[s])
                n_tok = int(idx["input_ids"].numel())
                buf = free.pop() if free else torch.empty(cap, dtype=torch.uint8, pin_memory=cuda)
                aux_buf = buf[:n_tok * width * esize].view(dtype).view(n_tok, width)
                last_buf = buf[n_tok * width * esize:n_tok * (width + H) * esize].view(
                    dtype).view(n_tok, H)
                offs = idx["offsets"].tolist()
                for b in plan_batches([len(x[0]) for x in group], batch_tokens):
                    aux, last = td.capture_batch([group[i][0] for i in b], aux_ids)
                    for j, i in enumerate(b):
                        a, e = offs[i], offs[i + 1]
                        aux_buf[a:e].copy_(aux[j, :e - a], non_blocking=cuda)
                        last_buf[a:e].copy_(last[j, :e - a], non_blocking=cuda)
                    bar.update(sum(len(group[i][0]) for i in b))
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record()
                tensors = {**idx, "aux_hidden": aux_buf, "last_hidden": last_buf}
                path = out_dir / SHARD.format(s)
                pending.append((pool.submit(write_shard, path, tensors, ready), cap, buf))
                shards[s] = {"file": path.name, "num_samples": len(group),
                             "num_tokens": n_tok, "sha256": pending[-1][0],
                             "sample_ids": group_ids[s]}
                # bounded memory (count and bytes); surfaces write errors early
                while pending and (len(pending) > writers or pending[0][0].done()
                                   or sum(p[1] for p in pending) > budget):
                    f, _, done_buf = pending.pop(0)
                    f.result()
                    free.append(done_buf)  # written: the next shards may reuse it
            for f, _, _ in pending:
                f.result()
        except BaseException:
            for f, _, _ in pending:
                f.cancel()
            raise
    bar.close()
    sync_s = sync_shards([out_dir / SHARD.format(s) for s in mine], out_dir)
    shards = [shards[s] for s in mine]
    for sh in shards:
        if not isinstance(sh["sha256"], str):
            sh["sha256"] = sh["sha256"].result()
    return {"shards": shards, "shard_ids": mine, "resumed_shards": resumed,
            "computed_tokens": total, "seconds": time.perf_counter() - t0,
            "sync_seconds": sync_s}


def gather_shards(res: dict) -> dict:
    """extract_samples results of all ranks merged: every shard in shard order, resumed shards
    and computed tokens summed, seconds and sync_seconds = the slowest rank's. One rank: `res`
    itself."""
    parts = D.all_gather_object(res)
    if len(parts) == 1:
        return res
    by_id = {s: sh for r in parts for s, sh in zip(r["shard_ids"], r["shards"])}
    ids = sorted(by_id)
    return {"shards": [by_id[s] for s in ids], "shard_ids": ids,
            "resumed_shards": sum(r["resumed_shards"] for r in parts),
            "computed_tokens": sum(r["computed_tokens"] for r in parts),
            "seconds": max(r["seconds"] for r in parts),
            "sync_seconds": max(r["sync_seconds"] for r in parts)}


# ----------------------------------------------------------------------------------------------
# the stage


def write_target_parts(target, config: dict, out_dir: Path) -> dict[str, str]:
    """target_head.safetensors (embed_tokens, norm, lm_head; lm_head = embed copy when tied) and
    target_config.json. target: the loaded model or a TargetData. Returns {relative path:
    sha256}."""
    from safetensors.torch import save
    write_json(out_dir / "target_config.json", config)
    if (out_dir / "target_head.safetensors").exists():  # atomic: present = complete (resume)
        return {"target_head.safetensors": sha256_file(out_dir / "target_head.safetensors")}
    tensors = {k: v.cpu().clone().contiguous() for k, v in as_target(target).head().items()}
    hashes = {"target_head.safetensors": write_atomic(out_dir / "target_head.safetensors",
                                                      [save(tensors)])}
    return hashes


def run(ctx: StageContext) -> dict:
    """Extract features for the spec's training conversations into ctx.out_dir.

    Data parallel when ctx.world_size > 1 (module docstring): every rank returns the same
    summary; rank 0 writes target parts and features.json after all shards exist.
    Raises StageError for bad data, a tokenizer without chat template, aux ids out of range for
    the real model, a hidden-size mismatch, or a full disk."""
    spec, p, out = ctx.spec, ctx.params, Path(ctx.out_dir)
    rank, world = D.check(ctx)
    out.mkdir(parents=True, exist_ok=True)
    with capture_engine(ctx):
        td = load_target_data(ctx)
        samples, tok_report, aux_ids = td.samples, td.tok_report, list(spec.aux_ids)
        res = gather_shards(extract_samples(td, samples, aux_ids, out, p.shard_samples,
                                            p.batch_tokens, td.pad, progress=rank == 0,
                                            rank=rank, world=world))
    if rank == 0:
        ctx.file_hashes.update(write_target_parts(td, td.cfg, out))
    ctx.file_hashes.update({s["file"]: s["sha256"] for s in res["shards"]})
    n_tok = sum(sh["num_tokens"] for sh in res["shards"])
    cm = capture_manifest(spec, td)
    manifest = {
        **cm, "format": FORMAT, "num_tokens": n_tok, "shards": res["shards"],
        "data_report": {**td.data_report, "tokenize": tok_report},
        "tensors": {"input_ids": "int64 [T]", "loss_mask": "uint8 [T]",
                    "aux_hidden": f"{cm['dtype']} [T, {cm['feature_width']}]",
                    "last_hidden": f"{cm['dtype']} [T, {cm['hidden_size']}]",
                    "offsets": "int64 [n+1]", "sample_ids": "int64 [n]"},
    }
    if rank == 0:
        write_json(out / MANIFEST, manifest)
        for sh in res["shards"]:  # features.json now records the hashes
            sha_record(out / sh["file"]).unlink(missing_ok=True)
    D.barrier()  # the manifest exists before any rank returns
    secs = max(res["seconds"], 1e-9)
    dropped = sum(td.data_report.get("dropped", {}).values())
    return {"samples": len(samples), "tokens": (n_tok, "tok"),
            "supervised_tokens": (tok_report["supervised_tokens"], "tok"),
            "tokens_per_s": (res["computed_tokens"] / secs if res["computed_tokens"] else 0.0,
                             "tok/s"),
            "seconds": (res["seconds"], "s"), "shards": len(res["shards"]),
            "resumed_shards": res["resumed_shards"], "dropped_records": dropped,
            "mask_all_zero": tok_report["mask_all_zero"], "truncated": tok_report["truncated"]}
