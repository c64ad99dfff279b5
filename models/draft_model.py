"""The EAGLE-3 draft model, named so that export IS the state dict (SGLang llama_eagle3.py names).

state_dict keys: fc.weight [H, 3*Ht]; midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v take 2H);
midlayer.mlp.{gate,up,down}_proj.weight; midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight [H]; norm.weight [H]; lm_head.weight [Vd, H]; d2t int64 [Vd]
(OFFSETS: target_id = i + d2t[i], SGLang llama_eagle3.py); t2d bool [V]; with fc_norm also
fc_norm.{i}.weight [Ht], one per aux state (SGLang 0.5.14 llama_eagle3.py names).
The target's embedding is held as a non-persistent buffer (frozen, never exported: SGLang swaps in
the target's own).

One draft step (docs/eagle3-format.md, "Forward of the draft layer"):
    x = cat(input_layernorm(embed(tok)), hidden_norm(h))            # [B, T, 2H]
    h' = h + o_proj(attn(x)); out = h' + mlp(post_attention_layernorm(h'))   # pre-norm
    logits = lm_head(norm(out))                                      # [B, T, Vd]
h = fc(aux) at the first step, then what the previous step returns: `out` (EAGLE-3), or
norm(out) with config norm_output (EAGLE 3.1; SGLang 0.5.14 llama_eagle3.py returns
`hidden_states_to_logits if self.norm_output else hidden_states_to_aux` as the recycled hidden).
With config fc_norm (EAGLE 3.1), fc reads cat(fc_norm[i](aux_i)): one RMSNorm per aux state
(SGLang 0.5.14: `fc_norm` or the legacy `use_aux_norm`). The steps (ttt_step, cached_step)
return the recycled hidden and `logits` maps it to the draft logits, so callers never branch.

Two attention paths share the projections and RoPE:
- `ttt_attention` (here, the reference; kernels/ttt_attention.py has its fast paths): training-time test (SpecForge
  convention): step j's query at position i attends causally to step-0 keys and to the keys of
  steps 1..j at position i only; RoPE position i + j.
- `cached_attention`: inference over a static KV cache with an explicit mask (bench engine).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from eagle3_runner.runner.drafts.forward import engine_unsupported, flag_on
from eagle3_runner.runner.drafts.layout import ARCH, FC_NORM_LEGACY, eagle_config, target_rope
from eagle3_runner.runner.errors import UnsupportedDraftError
from eagle3_runner.runner.spec.geometry import draft_geometry


def expand_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    return k if n_rep == 1 else k.repeat_interleave(n_rep, dim=1)


def ttt_attention(q, ks: list, vs: list, causal_mask: torch.Tensor) -> torch.Tensor:
    """TTT attention, the reference. q [B, nh, T, hd]; ks/vs: per-step keys/values
    [B, nkv, T, hd] (step 0 first, the current step last); causal_mask [B or 1, 1, T, T] bool
    (True = attend; kernels/ttt_attention.py `dense_mask` for packed rows). Step-0 keys are attended through the mask,
    later steps' keys only on the diagonal. -> [B, nh, T, hd]"""
    n_rep = q.shape[1] // ks[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = expand_kv(ks[0], n_rep), expand_kv(vs[0], n_rep)
    s0 = (q @ k0.transpose(-1, -2)).float() * scale  # [B, nh, T, T]
    s0 = s0.masked_fill(~causal_mask, float("-inf"))
    diag = [((q * expand_kv(k, n_rep)).sum(-1).float() * scale)[..., None] for k in ks[1:]]
    p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1).to(q.dtype)
    T = q.shape[2]
    o = p[..., :T] @ v0
    for j, v in enumerate(vs[1:]):
        o = o + p[..., T + j, None] * expand_kv(v, n_rep)
    return o


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocab
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # SGLang eagle_config convention (output of layer k)
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    hidden_act: str = "silu"
    target_num_hidden_layers: Optional[int] = None
    extra: dict = field(default_factory=dict)
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per aux state before fc
    norm_output: bool = False  # EAGLE 3.1: the normed output is the recycled hidden

    @classmethod
    def from_spec(cls, spec, target_config: dict) -> "DraftConfig":
        """Resolve the drafter geometry from the spec, defaulting to the target's config."""
        d, t = spec.drafter, target_config
        g, problems = draft_geometry(d, t, t["hidden_size"])  # validate has reported these
        if problems:
            raise ValueError("; ".join(f"{f}: {m}" for f, m in problems))
        rope = target_rope(t)  # transformers-5 configs nest rope_theta
        return cls(
            **g,
            vocab_size=t["vocab_size"], draft_vocab_size=d.draft_vocab_size,
            target_hidden_size=t["hidden_size"], aux_layer_ids=list(spec.aux_ids),
            max_position_embeddings=max(d.max_position_embeddings or 0,
                                        t.get("max_position_embeddings") or 0) or 8192,
            rms_norm_eps=d.rms_norm_eps or t.get("rms_norm_eps") or 1e-5,
            rope_theta=rope[0] or 10000.0, rope_scaling=rope[1],
            hidden_act=t.get("hidden_act") or "silu",
            target_num_hidden_layers=t.get("num_hidden_layers"),
            fc_norm=d.fc_norm, norm_output=d.norm_output)

    def to_sglang(self) -> dict:
        """config.json for SGLang's LlamaForCausalLMEagle3 (eagle_config nested). fc_norm /
        norm_output are written only when on (`true`, the keys SGLang 0.5.14 reads): an absent
        key is SGLang's default off, and SpecForge 0.2.0 reads an explicit norm_output: false as
        "logits without the final norm" (docs/training-options.md)."""
        cfg = {
            "architectures": [ARCH], "model_type": "llama",
            "num_hidden_layers": 1, "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bias": False,
            "eagle_config": eagle_config(self.aux_layer_ids),
        }
        if self.target_hidden_size != self.hidden_size:
            cfg["target_hidden_size"] = self.target_hidden_size
        cfg.update({k: True for k in ("fc_norm", "norm_output") if getattr(self, k)})
        return cfg

    @classmethod
    def from_sglang(cls, cfg: dict) -> "DraftConfig":
        """Inverse of to_sglang (reads an exported config.json). Raises UnsupportedDraftError when
        the config selects a forward this model does not implement (runner/drafts/forward.py
        engine_unsupported: norm_before_fc, biases, N layers, ...). fc_norm is on when
        config.json sets `fc_norm` or the legacy `use_aux_norm` (SGLang 0.5.14)."""
        unsupported = engine_unsupported(cfg)
        if unsupported:
            raise UnsupportedDraftError(
                f"config.json: {'; '.join(unsupported)}: the embedded engine implements SGLang's "
                "plain one-layer EAGLE-3 forward only, so it refuses this drafter rather than "
                "measure another model's tau. Bench it with stages.bench.backend: sglang.")
        H = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=H, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or H // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or H,
            aux_layer_ids=list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 1e4),
            rope_scaling=cfg.get("rope_scaling"), hidden_act=cfg.get("hidden_act", "silu"),
            fc_norm=flag_on(cfg, "fc_norm") or flag_on(cfg, "use_aux_norm"),
            norm_output=flag_on(cfg, "norm_output"))

    def as_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 rope_scaling: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] int -> cos, sin [..., T, head_dim] (HF rotate_half layout, float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    if rope_scaling:
        kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
        if kind == "linear":
            inv = inv / rope_scaling["factor"]
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, rope_scaling)
        elif kind not in (None, "default"):
            raise NotImplementedError(f"rope_scaling type {kind!r} is not supported by the "
                                      "draft model yet (supported: none, linear, llama3)")
    freqs = positions.float()[..., None] * inv  # [..., T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _llama3_inv_freq(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, hd]; cos/sin [B or 1, T, hd] -> rotated x (same dtype)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2H], positions [B, T] -> q [B, nh, T, hd], k/v [B, nkv, T, hd] (RoPE'd)."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, nh, T, hd] -> [B, T, H]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def cached_attention(q, k_cache, v_cache, mask: torch.Tensor) -> torch.Tensor:
    """q [B, nh, T, hd]; caches [B, nkv, S, hd]; mask [B or 1, 1, T, S] bool -> [B, nh, T, hd]."""
    n_rep = q.shape[1] // k_cache.shape[1]
    return F.scaled_dot_product_attention(q, expand_kv(k_cache, n_rep), expand_kv(v_cache, n_rep),
                                          attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [B, T, H] -> [B, T, 2H] (embedding first, as in SGLang)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual adds and MLP: hidden, attn_out [B, T, H] -> pre-norm output [B, T, H]."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The drafter. `state_dict()` is exactly the SGLang model.safetensors content."""

    def __init__(self, c: DraftConfig, embed_tokens: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = c
        n_aux = len(c.aux_layer_ids)
        self.fc_norm = (nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps)
                                      for _ in range(n_aux)) if c.fc_norm else None)
        self.fc = nn.Linear(n_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        emb = embed_tokens if embed_tokens is not None else torch.zeros(c.vocab_size, c.hidden_size)
        self.register_buffer("embed_tokens", emb.detach(), persistent=False)

    # -- pieces --
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, H] (the target's frozen embedding)."""
        return F.embedding(ids, self.embed_tokens)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n*Ht] (ascending layer order) -> [B, T, H]: fc(aux), or with fc_norm
        fc(cat(fc_norm[i](aux_i))) over the n chunks of Ht (SGLang 0.5.14 llama_eagle3.py)."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([n(x) for n, x in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def recycle(self, out: torch.Tensor) -> torch.Tensor:
        """A step's pre-norm output [B, T, H] -> the hidden the next step takes: out, or
        norm(out) with norm_output."""
        return self.norm(out) if self.config.norm_output else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """A step's recycled hidden (`recycle`) [B, T, H] -> draft-vocab logits [B, T, Vd] =
        lm_head(norm(out)) either way (with norm_output h is norm(out) already)."""
        return self.lm_head(h if self.config.norm_output else self.norm(h))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (d2t holds offsets)."""
        return draft_ids + self.d2t[draft_ids]

    # -- training: one TTT step --
    def ttt_qkv(self, ids, hidden, positions):
        """The layer up to attention: ids [B, T], hidden [B, T, H], positions [B, T] (RoPE) ->
        q [B, nh, T, hd], k, v [B, nkv, T, hd]."""
        x = self.midlayer.attn_input(self.embed(ids), hidden)
        return self.midlayer.self_attn.qkv(x, positions)

    def ttt_out(self, hidden, o):
        """The layer after attention: hidden [B, T, H], o [B, nh, T, hd] -> pre-norm out [B, T, H]."""
        return self.midlayer.finish(hidden, self.midlayer.self_attn.out(o))

    def ttt_step(self, ids, hidden, positions, cache: list, causal_mask,
                 attend=ttt_attention) -> torch.Tensor:
        """One TTT step. ids [B, T] (tokens fed at this step), hidden [B, T, H] (fc(aux) at step
        0, else the previous step's output), positions [B, T] (base positions; step j uses
        positions + j), cache: list of (k, v) of earlier steps, appended in place.
        attend(q, ks, vs, causal_mask): the TTT attention (kernels/ttt_attention.py; its fast
        paths take a Segments as the mask). Returns the recycled hidden [B, T, H] (`recycle`)."""
        q, k, v = self.ttt_qkv(ids, hidden, positions + len(cache))
        cache.append((k, v))
        o = attend(q, [c[0] for c in cache], [c[1] for c in cache], causal_mask)
        return self.recycle(self.ttt_out(hidden, o))

    # -- inference: one step over a static KV cache --
    def cached_step(self, ids, hidden, positions, k_cache, v_cache, slots, mask) -> torch.Tensor:
        """ids [B, T], hidden [B, T, H], positions [B, T] (RoPE), k/v_cache [B, nkv, S, hd]
        written at `slots` [T] (cache rows), mask [B or 1, 1, T, S] bool.
        Returns the recycled hidden [B, T, H] (`recycle`)."""
        x = self.midlayer.attn_input(self.embed(ids), hidden)
        q, k, v = self.midlayer.self_attn.qkv(x, positions)
        k_cache[:, :, slots] = k.to(k_cache.dtype)
        v_cache[:, :, slots] = v.to(v_cache.dtype)
        o = cached_attention(q, k_cache, v_cache, mask)
        return self.recycle(self.midlayer.finish(hidden, self.midlayer.self_attn.out(o)))


def load_exported(draft_dir, embed_tokens: torch.Tensor, device="cpu",
                  dtype=torch.float32) -> Eagle3Draft:
    """Load an SGLang draft directory (config.json + model.safetensors) into Eagle3Draft.

    Strict: a missing or unexpected tensor name raises (SGLang would silently drop it); the
    legacy fc_norm names aux_norm_low/mid/high are renamed as SGLang 0.5.14 load_weights does.
    embed_tokens [V, H] comes from the target (SGLang swaps it in the same way)."""
    import json
    from pathlib import Path
    from safetensors.torch import load_file
    d = Path(draft_dir)
    c = DraftConfig.from_sglang(json.loads((d / "config.json").read_text()))
    model = Eagle3Draft(c, embed_tokens.to(dtype))
    sd = load_file(str(d / "model.safetensors"))
    for old, new in FC_NORM_LEGACY.items():
        sd = {k.replace(old, new): v for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{d}: tensors missing {missing}, unexpected {unexpected}; run "
                         f"`runner inspect {d}`")
    return model.to(device=device, dtype=dtype).eval()
