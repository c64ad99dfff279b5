"""The target as our own Llama forward (gpt-fast style), for the bench engine.

Why not HF's forward: the engine needs a static KV cache that it rolls back by moving a length
pointer, a fixed-shape step that torch.compile / CUDA graphs can capture, and the aux hidden
states of chosen layers at every position it runs. Weights come from an HF `LlamaForCausalLM`
state dict (`model.layers.{i}.self_attn.q_proj.weight`, ...), so any HF-loadable Llama target
works (SmolLM2 GGUF via targets.load.load_target).

Aux hidden states follow SGLang's eagle_config convention (docs/eagle3-format.md):
id k = OUTPUT of 0-based decoder layer k (pre-final-norm residual) = HF hidden_states[k+1],
concatenated in ascending layer order -> [B, T, len(ids)*H].

Static cache: k/v [B, nkv, S, hd] per layer, written at `input_pos`; query at position p attends
to cache slots <= p. Entries past the current length are stale but never attended, and are
overwritten by the next write at those positions (that is the rollback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from eagle3_runner.models.draft_model import MLP, RMSNorm, apply_rope, rope_cos_sin
from eagle3_runner.runner.drafts.layout import target_rope


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, cfg) -> "LlamaConfig":
        """From an HF LlamaConfig (object or dict). Raises ValueError for non-Llama biases."""
        g = cfg if isinstance(cfg, dict) else cfg.to_dict()
        if g.get("attention_bias") or g.get("mlp_bias"):
            raise ValueError("target: attention_bias/mlp_bias Llama variants are not supported by "
                             "the embedded engine; use backend: sglang")
        theta, rs = target_rope(g)  # top-level or transformers-5 rope_parameters
        heads = g["num_attention_heads"]
        return cls(vocab_size=g["vocab_size"], hidden_size=g["hidden_size"],
                   num_hidden_layers=g["num_hidden_layers"], num_attention_heads=heads,
                   num_key_value_heads=g.get("num_key_value_heads") or heads,
                   head_dim=g.get("head_dim") or g["hidden_size"] // heads,
                   intermediate_size=g["intermediate_size"],
                   rms_norm_eps=g.get("rms_norm_eps", 1e-5), rope_theta=theta or 10000.0,
                   rope_scaling=rs, tie_word_embeddings=bool(g.get("tie_word_embeddings")))


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.k_cache: Optional[torch.Tensor] = None  # [B, nkv, S, hd]
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, x, cos, sin, mask, slots, kv_len=None, attn=None, rows=None):
        """x [B, T, H]; cos/sin [1 or B, T, hd]; mask [1 or B, 1, T, S'] bool (True = attend;
        S' = kv_len or S); slots [T] or [B, T] int64: the cache rows the T new keys/values are
        written to (per batch row when 2-D). kv_len: attend only cache slots < kv_len (cost
        follows the live lengths, not S). attn(q [B, nh, T, hd], k [B, nkv, S', hd], v, mask)
        -> [B, nh, T, hd] replaces SDPA (a decode kernel). rows [B] int64: the cache batch rows
        these inputs use (default 0..B-1; batched prefill into freed rows).
        Without a cache (setup_cache never called: targets/capture_embedded.py) the T new keys
        and values are all there is: attn(q, k, v, mask) (or SDPA with mask) over them, slots,
        kv_len and rows unused. -> [B, T, H]"""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.k_cache is None:
            kc, vc, kv_len, rows = k, v, None, None
        else:
            write_cache(self.k_cache, k, slots, rows)  # static cache write
            write_cache(self.v_cache, v, slots, rows)
            kc, vc = self.k_cache, self.v_cache
        if kv_len is not None:
            kc, vc = kc[:, :, :kv_len], vc[:, :, :kv_len]
        if rows is not None:
            kc, vc = kc.index_select(0, rows), vc.index_select(0, rows)
        if attn is not None:
            o = attn(q, kc, vc, mask)
        else:
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask,
                                               enable_gqa=c.num_attention_heads != c.num_key_value_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def write_cache(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> None:
    """cache [Bc, nkv, S, hd] <- new [B, nkv, T, hd] at rows `slots`: [T] (the same rows for every
    batch row: one index_copy_) or [B, T] (row b writes its own slots[b]). rows [B]: the cache
    batch rows written (default 0..B-1, B = Bc). In place."""
    new = new.to(cache.dtype)
    if rows is None and slots.dim() == 1:
        cache.index_copy_(2, slots, new)
        return
    B, nkv, T, _ = new.shape
    b = torch.arange(B, device=cache.device) if rows is None else rows
    if slots.dim() == 1:
        slots = slots[None].expand(B, -1)
    h = torch.arange(nkv, device=cache.device)
    # one index_put_ on the cache itself, indices broadcast to [B, nkv, T]. Not an assignment
    # through cache.transpose(1, 2): under inductor a write through a view of a graph input
    # became a copy of the WHOLE cache per layer and step (on the H200 at 512 rows, 2 x 36 us
    # per layer, ~40% of the Generator's decode step; BENCHMARKS.md)
    cache.index_put_((b[:, None, None], h[None, :, None], slots[:, None, :]), new)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, slots, kv_len=None, attn=None, rows=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, slots, kv_len, attn, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Llama decoder with a static KV cache. Parameter names = HF's without the `model.` prefix."""

    def __init__(self, c: LlamaConfig, aux_ids: tuple[int, ...] = ()):
        super().__init__()
        self.config = c
        self.aux_ids = tuple(sorted(aux_ids))  # SGLang: ascending layer order
        bad = [k for k in self.aux_ids if not 0 <= k < c.num_hidden_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for {c.num_hidden_layers} layers")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.max_seq = 0

    def setup_cache(self, max_batch: int, max_seq: int, dtype=None, device=None) -> None:
        """Allocate k/v caches [max_batch, nkv, max_seq, hd] and the RoPE table [max_seq, hd]."""
        c = self.config
        p = self.lm_head.weight
        dtype, device = dtype or p.dtype, device or p.device
        for layer in self.layers:
            a = layer.self_attn
            a.k_cache = torch.zeros(max_batch, c.num_key_value_heads, max_seq, c.head_dim,
                                    dtype=dtype, device=device)
            a.v_cache = torch.zeros_like(a.k_cache)
        cos, sin = rope_cos_sin(torch.arange(max_seq, device=device), c.head_dim, c.rope_theta,
                                c.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(dtype), sin.to(dtype)  # [S, hd]
        self.slots = torch.arange(max_seq, device=device)
        self.max_seq = max_seq

    def caches(self) -> list[torch.Tensor]:
        return [t for l in self.layers for t in (l.self_attn.k_cache, l.self_attn.v_cache)]

    def forward(self, ids: torch.Tensor, input_pos: torch.Tensor, last_only: bool = False,
                slots: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                kv_len: Optional[int] = None, attn=None, rows: Optional[torch.Tensor] = None,
                select: Optional[torch.Tensor] = None):
        """ids [B, T] int64; input_pos [T] or [B, T] int64: the RoPE positions of these tokens
        (2-D: per batch row, e.g. batched generation where rows have different lengths).
        slots: the cache rows they are written to, same shape as input_pos; default input_pos.
        mask [1 or B, 1, T, S'] bool (True = attend); default: cache row <= position (causal
        over the static cache; right only when slots == input_pos). A tree verify passes its
        own slots (node order) and mask (ancestors), its positions being prefix + depth.
        Batched generation (engine/generate.py) also passes kv_len (attend slots < kv_len only;
        S' = kv_len), attn (a decode-attention function, see Attention), rows [B] (the cache
        batch rows used) and select [B] (logits only at column select[b] of row b: the last
        real token of a right-padded row).
        Returns (logits [B, T or 1, V] float32, aux [B, T, len(aux_ids)*H] or None)."""
        x = self.embed_tokens(ids)  # [B, T, H]
        pos = input_pos if input_pos.dim() == 2 else input_pos[None]  # [1 or B, T]
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [1 or B, T, hd]
        if mask is None:
            ar = self.slots if kv_len is None else self.slots[:kv_len]
            mask = (ar <= pos[..., None])[:, None]  # [1 or B, 1, T, S']
        slots = input_pos if slots is None else slots
        aux = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, slots, kv_len, attn, rows)
            if i in self.aux_ids:
                aux.append(x)
        if select is not None:
            x = x[torch.arange(x.shape[0], device=x.device), select][:, None]  # [B, 1, H]
        elif last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x)).float()
        return logits, (torch.cat(aux, dim=-1) if aux else None)


def from_hf_model(hf_model, aux_ids=(), dtype=None, device=None) -> Llama:
    """Build our Llama from an HF LlamaForCausalLM (weights copied, HF model untouched).

    Raises ValueError when a tensor name is missing or unexpected (non-Llama architecture)."""
    c = LlamaConfig.from_hf(hf_model.config)
    sd = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()
          if "rotary_emb" not in k}
    if "lm_head.weight" not in sd or c.tie_word_embeddings:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    with torch.device("meta"):
        m = Llama(c, aux_ids)
    missing, unexpected = m.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"target state dict does not match a Llama: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    p = next(iter(sd.values()))
    m = m.to(dtype=dtype or p.dtype, device=device or p.device).eval()
    return m.requires_grad_(False)
