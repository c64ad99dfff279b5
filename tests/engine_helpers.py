"""Tiny targets and exported drafters for the engine/bench tests (random weights, fixed seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tiny_hf_llama(vocab=64, hidden=64, layers=4, heads=4, kv=2, seed=0):
    """A random HF LlamaForCausalLM (float32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=2 * hidden,
                      max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits -> peaky, non-degenerate distributions
        m.lm_head.weight.mul_(4.0)
    return m


def export_drafter(out: Path, target_cfg, aux_ids, draft_vocab=None, seed=1, d2t=None,
                   edit=None, **options) -> Path:
    """Write an SGLang draft dir (config.json + model.safetensors) with random weights.
    d2t: offsets over a draft vocab = the first `draft_vocab` target ids (default all).
    edit(model) may change weights before saving. options: DraftConfig's forward options
    (fc_norm, norm_output)."""
    from safetensors.torch import save_file
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    V, H = target_cfg.vocab_size, target_cfg.hidden_size
    Vd = draft_vocab or V
    c = DraftConfig(hidden_size=H, num_attention_heads=target_cfg.num_attention_heads,
                    num_key_value_heads=target_cfg.num_key_value_heads,
                    head_dim=getattr(target_cfg, "head_dim", None) or H // target_cfg.num_attention_heads,
                    intermediate_size=target_cfg.intermediate_size, vocab_size=V,
                    draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=list(aux_ids),
                    max_position_embeddings=4096, rms_norm_eps=target_cfg.rms_norm_eps,
                    rope_theta=getattr(target_cfg, "rope_theta", None) or 10000.0, **options)
    torch.manual_seed(seed)
    m = Eagle3Draft(c)
    used = torch.arange(Vd) if d2t is None else None
    with torch.no_grad():
        m.d2t.copy_(d2t if d2t is not None else used - torch.arange(Vd))
        m.t2d.zero_()
        m.t2d[(torch.arange(Vd) + m.d2t).clamp(0, V - 1)] = True
        if edit:
            edit(m)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c.to_sglang(), indent=1))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(out / "model.safetensors"))
    return out
