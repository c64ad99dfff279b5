"""The target side of the features, shared by the extract stage (which writes them to disk) and
the online train stage (stages.train.features: online, which trains on them batch by batch):
the training conversations, the target and its tokenised samples, the capture itself, and the
capture manifest and target parts an artifact records.

What is captured (SGLang convention, sglang/srt/models/llama.py + llama_eagle3.py; SpecForge):
- aux [n, T, 3*H]: for each aux id k (ascending) the OUTPUT of 0-based decoder layer k, i.e. the
  residual stream entering layer k+1 = HF `hidden_states[k+1]`, concatenated in ascending layer
  order. Captured with forward hooks on `layers[k]`.
- last [n, T, H]: the last decoder layer's output BEFORE the final norm (HF's last
  `hidden_states` element is post-norm). Captured with a forward pre-hook on the final norm.
  Training derives the soft labels from it: norm + lm_head restricted to the draft vocab.
The LM head is never run here (the base model is called directly).

The same features come from an SGLang server when the stage's engine is sglang
(runner/engines.py): `capture_sglang` asks the stage's capture server
(targets/sglang_target.py) for the same two things per prompt position, taken inside SGLang by
targets/sglang_hooks.py (aux: SGLang's set_eagle3_layers_to_capture; last: the final norm's
pre-norm input), and pads them into the same tensors. `TargetData` carries either the loaded model
or that server, and `capture_batch` / `head` / the geometry serve both, so extract and online
training have one code path.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from eagle3_runner.runner import dist as D
from eagle3_runner.runner.cpu import gc_paused
from eagle3_runner.targets.split import decoder_parts, input_device, text_config, weight
from eagle3_runner.runner.drafts.checks import model_aux_problem
from eagle3_runner.runner.drafts.families import target_family
from eagle3_runner.runner.drafts.layout import to_hf_indices
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.runner.stage import StageContext


def check_aux_ids(model, aux_ids: list[int]) -> None:
    """Run-time check against the real model: ids distinct, ascending and in SGLang's range
    (runner/drafts/checks.py), read as the loaded target's family does (families.py). Raises
    StageError."""
    cfg = model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None
    problem = model_aux_problem(aux_ids, len(decoder_parts(model)[1]), target_family(cfg))
    if problem:
        raise StageError(problem)


PINNED_H2D = True  # False: plain pageable copies (scripts/bench/profile_train.py's "before")


def pin_for(device) -> bool:
    """Whether host buffers bound for `device` should be allocated pinned (`h2d` then copies
    them without staging)."""
    return torch.device(device).type == "cuda" and PINNED_H2D


def h2d(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor t on `device`. To CUDA: staged through pinned memory (PyTorch's caching host
    allocator) and copied non-blocking, so the host never waits for the stream's queued work: a
    copy from pageable memory may wait for it (CUDA's cudaMemcpyAsync: "might be synchronous
    with respect to host" for pageable memory), which stalls the host that should be enqueuing
    the next kernels. Elsewhere (or t already there): t.to(device)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t.pin_memory() if PINNED_H2D else t).to(device, non_blocking=True)  # pinned already
    # (pack_samples with pin_for): pin_memory() returns t itself


def capture_sglang(srv, batch: list[list[int]], n_aux: int, hidden: int, dtype=torch.bfloat16,
                   device=None, calls: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """capture() through an SGLang capture server `srv` (targets/sglang_target.py TargetServer):
    the batch's prompts split into up to `calls` /generate calls by tokens, in flight together
    (the server batches them; this process converts one call's rows while the others compute).
    Returns (aux [n, T, n_aux*H], last [n, T, H]) in `dtype` on `device` (default CPU), right-
    padded with zeros like capture(). Raises StageError (sglang_target) for rows of another
    shape."""
    from eagle3_runner.targets.sglang_target import capture_call, in_flight
    n, T = len(batch), max(len(x) for x in batch)
    aux = torch.zeros(n, T, n_aux * hidden, dtype=dtype)
    last = torch.zeros(n, T, hidden, dtype=dtype)
    order = sorted(range(n), key=lambda i: -len(batch[i]))
    per = max(1, min(srv.per_call, -(-n // max(calls, 1))))
    parts = [order[a:a + per] for a in range(0, n, per)]

    def put(done):
        part, rows = done
        for i, r in zip(part, rows):
            t = torch.from_numpy(r)
            aux[i, :len(r)] = t[:, :n_aux * hidden].to(dtype)
            last[i, :len(r)] = t[:, n_aux * hidden:].to(dtype)
    in_flight(((lambda part=part: (part, capture_call(srv, [batch[i] for i in part])))
               for part in parts), calls, put)
    if device is not None:
        aux, last = aux.to(device, non_blocking=True), last.to(device, non_blocking=True)
    return aux, last


@torch.inference_mode()
def capture(model, batch: list[list[int]], aux_ids: list[int], pad_id: int = 0,
            device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target's decoder (no LM head) on one right-padded batch of token lists.

    Returns (aux [n, T, len(aux_ids)*H], last [n, T, H]) in the model's dtype on `device`
    (default: input_device(model), where the forward starts), T = longest sample (inference
    tensors: copy them before autograd saves them). aux = concat of decoder layer k outputs
    (= HF hidden_states[k+1]) for k ascending; last = the input of the final norm (pre-norm last
    hidden). Rows past a sample's length are padding. A target split over devices (accelerate,
    targets/split.py split_plan) hands each hook its layer's output on that layer's device; the
    hooks copy it to `device` as it is produced, so no layer's device holds the batch's
    captures and the result is the one-device run's, value for value."""
    base, layers, norm = decoder_parts(model)
    dev = input_device(model)
    out_dev = torch.device(device) if device is not None else dev
    n, T = len(batch), max(len(x) for x in batch)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
    got: dict = {}

    def keep(k):
        def hook(_m, _inp, out):
            got[k] = (out[0] if isinstance(out, tuple) else out).to(out_dev, non_blocking=True)
        return hook

    def keep_last(_m, inp):
        got["last"] = inp[0].to(out_dev, non_blocking=True)

    hooks = [layers[k].register_forward_hook(keep(k)) for k in aux_ids]
    hooks.append(norm.register_forward_pre_hook(keep_last))
    try:
        # no attention mask: the batch is right-padded, so under the causal mask a real
        # position only ever sees real ones (padding comes after it). Without a padding mask
        # HF's SDPA runs its causal fused kernel, and builds no [n, 1, T, T] mask.
        base(input_ids=h2d(ids, dev), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[k] for k in sorted(aux_ids)], dim=-1), got["last"]


# ----------------------------------------------------------------------------------------------
# the training data and the target, as a stage loads them


class TargetData(NamedTuple):
    """The target and its tokenised training samples (dataset order): model (eval, no grad; None
    when an SGLang server runs the target), tok, cfg (HF config dict), samples [(input_ids,
    loss_mask)] (lists of ints), data_report / tok_report (data/conversations.py), pad (the
    padding id), server (targets/sglang_target.py TargetServer of the stage, or None), spec."""
    model: Any
    tok: Any
    cfg: dict
    samples: list
    data_report: dict
    tok_report: dict
    pad: int
    server: Any = None
    spec: Any = None

    @property
    def engine(self) -> str:
        return "sglang" if self.server is not None else "hf"

    @property
    def hidden_size(self) -> int:
        return int(self.cfg["hidden_size"]) if self.model is None else \
            text_config(self.model).hidden_size

    @property
    def num_layers(self) -> int:
        return int(self.cfg["num_hidden_layers"]) if self.model is None else \
            len(decoder_parts(self.model)[1])

    @property
    def dtype(self) -> torch.dtype:
        """The features' dtype: the model's, or the server's --dtype."""
        if self.model is not None:
            return next(self.model.parameters()).dtype
        dt = getattr(torch, str(self.server.info.get("dtype")), None)
        return dt if isinstance(dt, torch.dtype) else torch.bfloat16  # "auto": bf16 on GPUs

    @property
    def device(self) -> torch.device:
        """Where capture_batch's tensors are: the model's input device, or the CPU (server)."""
        return input_device(self.model) if self.model is not None else torch.device("cpu")

    def capture_batch(self, batch: list[list[int]], aux_ids: list[int],
                      device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """capture() or capture_sglang() of one batch of token lists: (aux [n, T, 3H],
        last [n, T, H])."""
        if self.model is not None:
            return capture(self.model, batch, aux_ids, self.pad, device)
        return capture_sglang(self.server, batch, len(aux_ids), self.hidden_size, self.dtype,
                              device)

    def head(self) -> dict[str, torch.Tensor]:
        """{embed_tokens, norm, lm_head}: target_head of the model, or read from the
        checkpoint's files (targets/load.py load_head) when a server holds the model."""
        if self.model is not None:
            return target_head(self.model)
        from eagle3_runner.targets.load import load_head
        return load_head(self.spec, self.dtype)


def as_target(target, pad: int = 0) -> TargetData:
    """`target` itself when it is a TargetData, else a TargetData around a loaded HF model
    (padding with `pad`): what extract's shard loop captures from."""
    return target if isinstance(target, TargetData) else \
        TargetData(target, None, {}, [], {}, {}, pad)


_SERVER: ContextVar = ContextVar("eagle3_capture_server", default=None)


@contextmanager
def capture_engine(ctx: StageContext) -> Iterator[Any]:
    """The capture engine of ctx's stage (extract, online train) for the block: None when it is
    transformers (the stage loads the model itself, load_target_data), else the SGLang capture
    server started per target.sglang (targets/sglang_target.py stage_server; its log in
    out_dir/logs), which load_target_data then uses. runner/engines.py stage_engine decides,
    as the plan did. Raises StageError when the engine cannot run or the server fails."""
    from eagle3_runner.runner import placement as P
    from eagle3_runner.runner.engines import CAPTURE, SGLANG, stage_engine
    from eagle3_runner.targets.load import target_config
    from eagle3_runner.targets.sglang_target import stage_server
    try:
        choice = stage_engine(ctx.spec, ctx.stage)
    except ValueError as e:
        raise StageError(str(e))
    if choice is None or choice.engine != SGLANG:
        yield None
        return
    tokens = P.batch_shape(ctx.spec, ctx.stage, ctx.world_size)[0]
    with stage_server(ctx.spec, CAPTURE, target_config(ctx.spec), Path(ctx.out_dir) / "logs",
                      ctx.rank, ctx.world_size, tokens) as srv:
        token = _SERVER.set(srv)
        try:
            yield srv
        finally:
            _SERVER.reset(token)


def conversations(ctx: StageContext) -> tuple[list, dict]:
    """The training conversations: the regenerate artifact's when that stage is an input (its
    shards, data/regen_store.py), else data (data/conversations.py) without any conversation that holds a
    bench prompt (data/contamination.py). Both are cleaned and counted by data/conversations.py and held
    to data.max_bad_fraction. Returns (conversations, report). Raises StageError for an
    unreadable regenerate artifact, too many unusable records, or when nothing is left."""
    from eagle3_runner.data.conversations import check_bad_fraction, conversations_from_records, load_conversations
    if "regenerate" in ctx.inputs:
        from eagle3_runner.data.regen_store import read_conversations
        try:
            records, info = read_conversations(Path(ctx.inputs["regenerate"]))
        except (OSError, ValueError) as e:
            raise StageError(f"the regenerate artifact is unreadable ({e}); rerun with "
                             "--force regenerate")
        convs, rep = conversations_from_records(records, {
            "path": info["path"], "format": "regenerate", "compression": "gzip",
            "shards": info["shards"], "records_read": len(records),
            "regenerate_dropped": info["dropped"]})  # the stage's own drops (its metrics)
        check_bad_fraction(rep, ctx.spec.data.max_bad_fraction)
        return convs, {"source": "regenerate", **rep,
                       "max_bad_fraction": ctx.spec.data.max_bad_fraction, "train": len(convs)}
    from eagle3_runner.data.contamination import bench_guard
    train, _holdout, report = load_conversations(ctx.spec.data)
    guard = bench_guard(ctx.spec)  # no bench prompt in the training data
    kept = [c for c in train if not guard.conversation(c)]
    report["dropped_contaminated"] = len(train) - len(kept)
    if not kept:
        raise StageError("data: every training conversation holds a bench prompt (MT-bench, "
                         "HumanEval or the holdout's); use other data")
    return kept, {**report, "train": len(kept)}


def load_target_data(ctx: StageContext, server=None) -> TargetData:
    """Conversations, target (a GGUF converted once, by rank 0 first when data parallel) and
    tokenised samples, with the aux ids and hidden size checked against the real model; the
    drop report is printed and recorded (data/conversations.py show_data_report: dropped/<reason>,
    bad_fraction) before any capture. server: the stage's SGLang capture server
    (targets/sglang_target.py stage_server; default: the one of the enclosing capture_engine
    block) when the engine is sglang: then only the tokenizer and config are loaded here. Raises StageError for bad data, a tokenizer without chat template,
    aux ids out of range or a hidden-size mismatch. Runs without the cyclic garbage collector
    (runner/cpu.py gc_paused: the conversations, ids and masks are millions of objects)."""
    with gc_paused():
        return _load_target_data(ctx, server)


def _load_target_data(ctx: StageContext, server) -> TargetData:
    from eagle3_runner.data.chat import tokenize_workers
    from eagle3_runner.data.conversations import show_data_report, tokenize_dataset
    from eagle3_runner.targets.load import hf_config, hf_folder, load_target, load_tokenizer
    spec = ctx.spec
    rank, world = D.check(ctx)
    convs, data_report = conversations(ctx)
    if world > 1:
        D.rank0_first(rank, lambda: hf_folder(spec.target))
    server = server if server is not None else _SERVER.get()
    if server is None:
        model, tok, cfg = load_target(spec, split=_split(ctx) if spec.target.device_map else None)
        check_aux_ids(model, list(spec.aux_ids))
        H = text_config(model).hidden_size
    else:
        model, tok, cfg = None, load_tokenizer(spec), hf_config(spec)
        problem = model_aux_problem(list(spec.aux_ids), int(cfg["num_hidden_layers"]),
                                    target_family(cfg))
        if problem:
            raise StageError(problem)
        H = int(cfg["hidden_size"])
    samples, tok_report = tokenize_dataset(tok, convs, spec.target.chat_template,
                                           spec.data.max_length, tokenize_workers(len(convs)))
    if spec.target.hidden_size and spec.target.hidden_size != H:
        raise StageError(f"target.hidden_size = {spec.target.hidden_size}, but the loaded model "
                         f"has hidden_size {H}")
    show_data_report(ctx, data_report, tok_report)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return TargetData(model, tok, cfg, samples, data_report, tok_report, pad, server, spec)


def _split(ctx: StageContext) -> dict:
    """from_pretrained's device-map kwargs for this rank (targets/split.py split_plan): its GPU
    group (runner/placement.py replica_gpus), the activation headroom of this stage's batch and,
    online, the drafter's state on the group's first GPU, sized from the target's config."""
    from eagle3_runner.targets.load import resolve_device, resolve_dtype, target_config
    from eagle3_runner.targets.split import split_plan
    from eagle3_runner.runner import placement as P
    from eagle3_runner.runner.target_size import activation_bytes
    spec = ctx.spec
    gpus = P.replica_gpus(ctx.rank, ctx.world_size, torch.cuda.device_count()) \
        if torch.cuda.is_available() else []
    cfg = target_config(spec)
    tokens, T = P.batch_shape(spec, ctx.stage, ctx.world_size)
    act_bytes = resolve_dtype(spec.target.dtype, resolve_device(spec.target.device)).itemsize
    headroom = activation_bytes(cfg, tokens, T, act_bytes, spec.target.attn_implementation)
    reserve = P.drafter_state_bytes(spec, cfg) if ctx.stage == "train" else 0
    return split_plan(spec, gpus, headroom, reserve)


def capture_manifest(spec, td: TargetData) -> dict:
    """The manifest fields that say what was captured and from what (extract's features.json and
    the online train artifact's, targets/features.py): layer ids in both conventions, widths,
    dtype, the target's and tokenizer's hashes, template, sample and token counts, and the engine
    that captured them (hf, or sglang with its version)."""
    from eagle3_runner.targets.load import config_sha256, tokenizer_sha256
    aux_ids, H = list(spec.aux_ids), td.hidden_size
    engine = {"engine": td.engine}
    if td.server is not None:
        engine.update(sglang_version=td.server.info.get("version"),
                      transport=td.server.transport)
    return {"aux_layer_ids": aux_ids, "hf_hidden_indices": to_hf_indices(aux_ids),
            "hidden_size": H, "feature_width": len(aux_ids) * H,
            "dtype": str(td.dtype).removeprefix("torch."),
            "num_hidden_layers": td.num_layers,
            "target_path": spec.target.path, "target_config_sha256": config_sha256(td.cfg),
            "tokenizer_sha256": tokenizer_sha256(td.tok),
            "chat_template": td.tok_report["template"], "max_length": spec.data.max_length,
            "num_samples": len(td.samples), "num_tokens": td.tok_report["tokens"],
            "num_supervised_tokens": td.tok_report["supervised_tokens"], "capture": engine}


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True, default=str))


def target_head(model) -> dict[str, torch.Tensor]:
    """The target's frozen parts the drafter trains against, where the model keeps them (split:
    each on its own device, an offloaded one in CPU memory): embed_tokens [V, Ht], norm [Ht],
    lm_head [V, Ht] (= the embedding when tied). Views of the weights."""
    return {"embed_tokens": weight(model.get_input_embeddings()).detach(),
            "norm": weight(decoder_parts(model)[2]).detach(),
            "lm_head": weight(model.get_output_embeddings()).detach()}
