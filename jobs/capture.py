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

from jobs import dist as D
from runner.drafts.families import target_family
from runner.drafts.layout import to_hf_indices
from runner.drafts.rules import model_aux_problem
from runner.errors import StageError
from runner.files import atomic_write
from runner.stage import StageContext


def decoder_parts(model) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(base model, decoder layers, final norm) of a transformers *ForCausalLM."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or model.model
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if layers is None or norm is None:
        raise StageError(f"target architecture {type(model).__name__}: no `layers`/`norm` on its "
                         "base model; only Llama-style decoders are supported")
    return base, layers, norm


def check_aux_ids(model, aux_ids: list[int]) -> None:
    """Run-time check against the real model: ids distinct, ascending and in SGLang's range
    (runner/drafts/rules.py), read as the loaded target's family does (families.py). Raises
    StageError."""
    cfg = model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else None
    problem = model_aux_problem(aux_ids, len(decoder_parts(model)[1]), target_family(cfg))
    if problem:
        raise StageError(problem)


@torch.inference_mode()
def capture(model, batch: list[list[int]], aux_ids: list[int],
            pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target's decoder (no LM head) on one right-padded batch of token lists.

    Returns (aux [n, T, len(aux_ids)*H], last [n, T, H]) on the model's device and dtype,
    T = longest sample (inference tensors: copy them before autograd saves them). aux = concat
    of decoder layer k outputs (= HF hidden_states[k+1]) for k ascending; last = the input of
    the final norm (pre-norm last hidden). Rows past a sample's length are padding."""
    base, layers, norm = decoder_parts(model)
    dev = next(model.parameters()).device
    n, T = len(batch), max(len(x) for x in batch)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    att = torch.zeros((n, T), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        att[i, :len(x)] = 1
    got: dict = {}

    def keep(k):
        def hook(_m, _inp, out):
            got[k] = out[0] if isinstance(out, tuple) else out
        return hook

    def keep_last(_m, inp):
        got["last"] = inp[0]

    hooks = [layers[k].register_forward_hook(keep(k)) for k in aux_ids]
    hooks.append(norm.register_forward_pre_hook(keep_last))
    try:
        base(input_ids=ids.to(dev, non_blocking=True), attention_mask=att.to(dev, non_blocking=True),
             use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[k] for k in sorted(aux_ids)], dim=-1), got["last"]


# ----------------------------------------------------------------------------------------------
# the training data and the target, as a stage loads them


class TargetData(NamedTuple):
    """The loaded target and its tokenised training samples (dataset order): model (eval, no
    grad), tok, cfg (HF config dict), samples [(input_ids, loss_mask)] (lists of ints),
    data_report / tok_report (jobs/data.py), pad (the padding id)."""
    model: Any
    tok: Any
    cfg: dict
    samples: list
    data_report: dict
    tok_report: dict
    pad: int


def conversations(ctx: StageContext) -> tuple[list, dict]:
    """The training conversations: the regenerate artifact's when that stage is an input (its
    shards, jobs/regen_store.py), else data (jobs/data.py) without any conversation that holds a
    bench prompt (jobs/contamination.py). Returns (conversations, report). Raises StageError for
    an unreadable regenerate artifact or when nothing is left."""
    from jobs.data import clean_records, load_conversations
    if "regenerate" in ctx.inputs:
        from jobs.regen_store import read_conversations
        try:
            records, info = read_conversations(Path(ctx.inputs["regenerate"]))
        except (OSError, ValueError) as e:
            raise StageError(f"the regenerate artifact is unreadable ({e}); rerun with "
                             "--force regenerate")
        convs, rep = clean_records(records)
        return convs, {"source": "regenerate", **info, **rep, "train": len(convs)}
    from jobs.contamination import bench_guard
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
    tokenised samples, with the aux ids and hidden size checked against the real model.
    Raises StageError for bad data, a tokenizer without chat template, aux ids out of range
    or a hidden-size mismatch."""
    from jobs.data import tokenize_dataset
    from jobs.target import hf_folder, load_target
    spec = ctx.spec
    rank, world = D.check(ctx)
    convs, data_report = conversations(ctx)
    if world > 1:
        D.rank0_first(rank, lambda: hf_folder(spec.target))
    model, tok, cfg = load_target(spec)
    samples, tok_report = tokenize_dataset(tok, convs, spec.target.chat_template,
                                           spec.data.max_length)
    check_aux_ids(model, list(spec.aux_ids))
    H = model.config.hidden_size
    if spec.target.hidden_size and spec.target.hidden_size != H:
        raise StageError(f"target.hidden_size = {spec.target.hidden_size}, but the loaded model "
                         f"has hidden_size {H}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return TargetData(model, tok, cfg, samples, data_report, tok_report, pad)


def capture_manifest(spec, td: TargetData) -> dict:
    """The manifest fields that say what was captured and from what (extract's features.json and
    the online train artifact's, jobs/features.py): layer ids in both conventions, widths,
    dtype, the target's and tokenizer's hashes, template, sample and token counts."""
    from jobs.target import config_sha256, tokenizer_sha256
    aux_ids, H = list(spec.aux_ids), td.model.config.hidden_size
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
    """The target's frozen parts the drafter trains against, on the model's device: embed_tokens
    [V, Ht], norm [Ht], lm_head [V, Ht] (= the embedding when tied). Views of the weights."""
    return {"embed_tokens": model.get_input_embeddings().weight.detach(),
            "norm": decoder_parts(model)[2].weight.detach(),
            "lm_head": model.get_output_embeddings().weight.detach()}
