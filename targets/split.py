"""A target split over devices (target.device_map; runner/placement.py says which GPUs and whether
it fits), and reading a loaded target whichever way it was placed:

    split_plan(target, gpus, headroom, first_gpu_reserve=0) -> from_pretrained kwargs (device map)
    decoder_parts(model) -> (base, layers, norm)   # a *ForCausalLM or a multimodal wrapper of one
    text_config(model) -> the language model's config (a multimodal wrapper's text_config)
    input_device(model) -> where input ids go (the embedding's execution device under a map)
    weight(module) -> module.weight as a real tensor (an offloaded module keeps it in its hook)

targets/load.py load_target loads with split_plan's kwargs (and checks that nothing spilled
where nobody asked); targets/capture.py reads the loaded model through decoder_parts,
text_config, input_device and weight. `target` is what targets/load.py takes (a Spec, a Target or
a path). torch, accelerate and transformers are imported inside the functions that use them.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from eagle3_runner.runner.errors import StageError
from eagle3_runner.targets.load import hf_folder, target_option


def decoder_parts(model) -> tuple[Any, Any, Any]:
    """(base model, decoder layers, final norm) of a transformers *ForCausalLM or of a multimodal
    wrapper of one (Kimi-K2.5: model.language_model / language_model.model). Raises StageError
    when no module below the model has both `layers` and `norm`."""
    seen, todo = set(), [model]
    prefix = getattr(model, "base_model_prefix", "model")
    while todo:
        m = todo.pop(0)
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m is not model and getattr(m, "layers", None) is not None and \
                getattr(m, "norm", None) is not None:
            return m, m.layers, m.norm
        todo += [c for name in (prefix, "model", "language_model", "text_model", "decoder")
                 if (c := getattr(m, name, None)) is not None and len(seen) < 16]
    raise StageError(f"target architecture {type(model).__name__}: no `layers`/`norm` on its "
                     "base model; only Llama-style decoders are supported")


def text_config(model):
    """The config of the target's language model: model.config, or its text_config for a
    multimodal wrapper (Kimi-K2.5). Has hidden_size, vocab_size, num_hidden_layers."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def input_device(model):
    """The device the target's forward starts on (its embedding's execution device under an
    accelerate device map, else its parameters' device): where input ids go and, by default,
    where capture gathers the hidden states."""
    emb = model.get_input_embeddings()
    hook = getattr(emb, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        import torch
        return torch.device(hook.execution_device if not isinstance(hook.execution_device, int)
                            else f"cuda:{hook.execution_device}")
    return emb.weight.device


def weight(module):
    """module.weight as a real tensor: an offloaded module (accelerate, cpu/disk) keeps it on the
    meta device and the real one in its hook's weights_map."""
    w = module.weight
    if w.device.type == "meta":
        hook = getattr(module, "_hf_hook", None)
        wm = getattr(hook, "weights_map", None)
        if wm is None:
            raise StageError(f"{type(module).__name__}.weight is on the meta device and no "
                             "offload hook holds it; map that module to a device "
                             "(target.device_map)")
        return wm["weight"]
    return w


def _names(model) -> tuple[str, list[tuple[str, bool]]]:
    """(the decoder layers' qualified name, [(module, registered after the layers' branch)] for
    every other child on the way from the model to them: what a layer map must also place."""
    _, layers, _ = decoder_parts(model)
    qual = {id(m): n for n, m in model.named_modules()}[id(layers)]
    path, others, node = qual.split("."), [], model
    for depth, part in enumerate(path):
        after = False
        for name, _child in node.named_children():
            if name == part:
                after = True
            else:
                others.append((".".join(path[:depth] + [name]), after))
        node = getattr(node, part)
    return qual, others


def split_plan(target: Any, gpus: list[int], headroom: int = 0,
               first_gpu_reserve: int = 0) -> dict:
    """from_pretrained kwargs that split the target over the GPUs `gpus` (this rank's group,
    runner/placement.py replica_gpus) per target.device_map:
    - "auto": device_map "auto" (balanced; decoder layers never split) with max_memory per GPU =
      target.max_memory (gpu / group index, GiB) or min(free, total x USABLE) - headroom (the
      activations, runner/target_size.py) - first_gpu_reserve on gpus[0] (the drafter, online);
      CPU memory only if target.max_memory.cpu. Without CUDA: the CPU.
    - {layers: device}: decoder layers -> gpus[i] / cpu / disk (placement.layer_devices); the
      modules before the layers (embedding) go with layer 0, those after (norm, lm_head) with
      the last layer (a tied lm_head stays with the embedding it shares).
    An offload_folder (a temp dir, made last: a refused plan leaves none) is always given, so
    disk entries work; load_target removes it with the model, or when the load fails. Raises
    StageError for a GPU index outside the group or GPUs asked for without CUDA."""
    import torch
    from eagle3_runner.runner.placement import GIB, USABLE, layer_devices
    dm, mm = target_option(target, "device_map"), target_option(target, "max_memory") or {}
    cuda = torch.cuda.is_available()
    if dm == "auto":
        budget: dict = {}
        for j, g in enumerate(gpus if cuda else []):
            want = mm.get(str(j), mm.get("gpu"))
            if want is not None:
                budget[g] = int(want * GIB)
            else:
                free, total = torch.cuda.mem_get_info(g)
                budget[g] = max(0, int(min(free, total * USABLE)) - headroom
                                - (first_gpu_reserve if j == 0 else 0))
        if "cpu" in mm or not cuda:
            budget["cpu"] = int(mm["cpu"] * GIB) if "cpu" in mm else _ram()
        return {"device_map": "auto", "max_memory": budget, **_offload_folder()}
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    trust = bool(target_option(target, "trust_remote_code"))
    cfg = AutoConfig.from_pretrained(str(hf_folder(target)), trust_remote_code=trust)
    with init_empty_weights():
        try:
            meta = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust)
        except ValueError:
            from transformers import AutoModelForImageTextToText
            meta = AutoModelForImageTextToText.from_config(cfg, trust_remote_code=trust)
    qual, others = _names(meta)
    per_layer = layer_devices(dm, len(decoder_parts(meta)[1]))

    def place(d):
        if isinstance(d, str):
            return d
        if not cuda:
            raise StageError(f"target.device_map maps layers to GPU {d}, but CUDA is not "
                             "available here; map them to cpu or run on a GPU machine")
        if d >= len(gpus):
            raise StageError(f"target.device_map maps layers to GPU {d} of this rank's group, "
                             f"which has {len(gpus)} GPU(s) ({gpus}); use 0..{len(gpus) - 1}")
        return gpus[d]
    out = {f"{qual}.{i}": place(d) for i, d in per_layer.items()}
    first, last = place(per_layer[0]), place(per_layer[max(per_layer)])
    out.update({name: last if after else first for name, after in others})
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    head = meta.get_output_embeddings()
    if getattr(text_cfg, "tie_word_embeddings", False) and head is not None:  # one tensor: keep
        names = {id(m): n for n, m in meta.named_modules()}       # it where the embedding is
        out[names[id(head)]] = first
    return {"device_map": out, **_offload_folder()}


def _offload_folder() -> dict:
    return {"offload_folder": tempfile.mkdtemp(prefix="eagle3-offload-")}


def _ram() -> int:
    """This machine's RAM in bytes (64 GiB when it cannot tell)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 << 30
