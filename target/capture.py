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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from eagle3_runner.runner import dist as D
from eagle3_runner.target.load import decoder_parts, input_device, text_config, weight
from eagle3_runner.runner.drafts.families import target_family
from eagle3_runner.runner.drafts.layout import to_hf_indices
from eagle3_runner.runner.drafts.rules import model_aux_problem
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.runner.stage import StageContext


def check_aux_ids(model, aux_ids: list[int]) -> None:
    """Run-time check against the real model: ids distinct, ascending and in SGLang's range
    (runner/drafts/rules.py), read as the loaded target's family does (families.py). Raises
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


@torch.inference_mode()
def capture(model, batch: list[list[int]], aux_ids: list[int], pad_id: int = 0,
            device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target's decoder (no LM head) on one right-padded batch of token lists.

    Returns (aux [n, T, len(aux_ids)*H], last [n, T, H]) in the model's dtype on `device`
    (default: input_device(model), where the forward starts), T = longest sample (inference
    tensors: copy them before autograd saves them). aux = concat of decoder layer k outputs
    (= HF hidden_states[k+1]) for k ascending; last = the input of the final norm (pre-norm last
    hidden). Rows past a sample's length are padding. A target split over devices (accelerate,
    target/load.py split_plan) hands each hook its layer's output on that layer's device; the
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
    """The loaded target and its tokenised training samples (dataset order): model (eval, no
    grad), tok, cfg (HF config dict), samples [(input_ids, loss_mask)] (lists of ints),
    data_report / tok_report (data/conversations.py), pad (the padding id)."""
    model: Any
    tok: Any
    cfg: dict
    samples: list
    data_report: dict
    tok_report: dict
    pad: int


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


def load_target_data(ctx: StageContext) -> TargetData:
    """Conversations, target (a GGUF converted once, by rank 0 first when data parallel) and
    tokenised samples, with the aux ids and hidden size checked against the real model; the
    drop report is printed and recorded (data/conversations.py show_data_report: dropped/<reason>,
    bad_fraction) before any capture. Raises StageError for bad data, a tokenizer without chat
    template, aux ids out of range or a hidden-size mismatch."""
    from eagle3_runner.data.conversations import show_data_report, tokenize_dataset
    from eagle3_runner.target.load import hf_folder, load_target
    spec = ctx.spec
    rank, world = D.check(ctx)
    convs, data_report = conversations(ctx)
    if world > 1:
        D.rank0_first(rank, lambda: hf_folder(spec.target))
    model, tok, cfg = load_target(spec, split=_split(ctx) if spec.target.device_map else None)
    samples, tok_report = tokenize_dataset(tok, convs, spec.target.chat_template,
                                           spec.data.max_length)
    check_aux_ids(model, list(spec.aux_ids))
    H = text_config(model).hidden_size
    if spec.target.hidden_size and spec.target.hidden_size != H:
        raise StageError(f"target.hidden_size = {spec.target.hidden_size}, but the loaded model "
                         f"has hidden_size {H}")
    show_data_report(ctx, data_report, tok_report)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return TargetData(model, tok, cfg, samples, data_report, tok_report, pad)


def _split(ctx: StageContext) -> dict:
    """from_pretrained's device-map kwargs for this rank (target/load.py split_plan): its GPU
    group (runner/placement.py replica_gpus), the activation headroom of this stage's batch and,
    online, the drafter's state on the group's first GPU, sized from the target's config."""
    from eagle3_runner.target.load import resolve_device, resolve_dtype, split_plan, target_config
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
    the online train artifact's, target/features.py): layer ids in both conventions, widths,
    dtype, the target's and tokenizer's hashes, template, sample and token counts."""
    from eagle3_runner.target.load import config_sha256, tokenizer_sha256
    aux_ids, H = list(spec.aux_ids), text_config(td.model).hidden_size
    return {"aux_layer_ids": aux_ids, "hf_hidden_indices": to_hf_indices(aux_ids),
            "hidden_size": H, "feature_width": len(aux_ids) * H,
            "dtype": str(next(td.model.parameters()).dtype).removeprefix("torch."),
            "num_hidden_layers": len(decoder_parts(td.model)[1]),
            "target_path": spec.target.path, "target_config_sha256": config_sha256(td.cfg),
            "tokenizer_sha256": tokenizer_sha256(td.tok),
            "chat_template": td.tok_report["template"], "max_length": spec.data.max_length,
            "num_samples": len(td.samples), "num_tokens": td.tok_report["tokens"],
            "num_supervised_tokens": td.tok_report["supervised_tokens"]}


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True, default=str))


def target_head(model) -> dict[str, torch.Tensor]:
    """The target's frozen parts the drafter trains against, where the model keeps them (split:
    each on its own device, an offloaded one in CPU memory): embed_tokens [V, Ht], norm [Ht],
    lm_head [V, Ht] (= the embedding when tied). Views of the weights."""
    return {"embed_tokens": weight(model.get_input_embeddings()).detach(),
            "norm": weight(decoder_parts(model)[2]).detach(),
            "lm_head": weight(model.get_output_embeddings()).detach()}
