"""Parity of our drafter with an independent implementation: SpecForge's LlamaForCausalLMEagle3.

An exported-format drafter (config.json from DraftConfig.to_sglang + model.safetensors = our
state_dict) is loaded into SpecForge's module (only embed_tokens.weight missing: filled from ours),
and both are fed the same token ids and aux features for 3 TTT draft steps (cache_hidden,
positions, causal mask). Draft logits must agree to ~1e-4 in float32. Shapes cannot catch
concatenation-order, norm or recurrence mistakes; this does (the negative controls below prove
the comparison can fail).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft, load_exported

STEPS = 3
TOL = 1e-4


@pytest.fixture(autouse=True)
def _no_compile():
    """SpecForge decorates functions with @torch.compile (a first call compiles C++ for ~30 s):
    run them eagerly here, and give dynamo back to the rest of the suite afterwards (the engine's
    compile tests need it)."""
    import torch._dynamo
    old = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    yield
    torch._dynamo.config.disable = old


def _specforge():
    """Import SpecForge's draft module, or skip with the reason."""
    try:
        from specforge.modeling.draft.llama3_eagle import (LlamaForCausalLMEagle3,
                                                          prepare_decoder_attention_mask)
        from transformers import LlamaConfig
    except Exception as e:  # noqa: BLE001 - any import failure means: not installable here
        pytest.skip(f"specforge is not importable ({type(e).__name__}: {e}); install it with "
                    "`pip install --no-deps specforge==0.2.0` to run the parity test")
    return LlamaForCausalLMEagle3, prepare_decoder_attention_mask, LlamaConfig


def _tiny_config(**kw) -> DraftConfig:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, vocab_size=300, draft_vocab_size=48,
                target_hidden_size=64, aux_layer_ids=[1, 3, 5], max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_theta=100000.0)
    base.update(kw)
    return DraftConfig(**base)


def _export(tmp_path, c: DraftConfig, seed=0):
    """A random drafter written in the exported SGLang format; returns (dir, embed)."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    m = Eagle3Draft(c, embed)
    with torch.no_grad():
        for p in m.parameters():  # norms too: a ones-init norm hides norm mix-ups
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.2)
                    + (1.0 if p.dim() == 1 else 0.0))
        used = torch.randperm(c.vocab_size, generator=g)[:c.draft_vocab_size].sort().values
        m.d2t.copy_(used - torch.arange(c.draft_vocab_size))
        m.t2d.zero_()
        m.t2d[used] = True
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(c.to_sglang(), indent=1))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(d / "model.safetensors"))
    return d, embed


def _load_specforge(d, embed):
    LlamaForCausalLMEagle3, _, LlamaConfig = _specforge()
    from safetensors.torch import load_file
    cfg = LlamaConfig(**json.loads((d / "config.json").read_text()))
    sf = LlamaForCausalLMEagle3(cfg).float().eval()
    missing, unexpected = sf.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
    assert list(missing) == ["embed_tokens.weight"], missing
    assert list(unexpected) == [], unexpected
    with torch.no_grad():
        sf.embed_tokens.weight.copy_(embed)
    return sf


def _inputs(c: DraftConfig, B=2, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, len(c.aux_layer_ids) * c.target_hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (B, T + STEPS), generator=g)
    return aux, ids


def _ours_logits(m: Eagle3Draft, aux, ids):
    """Our TTT path: step j feeds tokens ids[:, j:j+T] and the previous step's output."""
    B, T, _ = aux.shape
    pos = torch.arange(T)[None].expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    h, cache, out = m.project(aux), [], []
    for j in range(STEPS):
        h = m.ttt_step(ids[:, j:j + T], h, pos, cache, causal)
        out.append(m.logits(h))
    return out


def _specforge_logits(sf, aux, ids):
    """SpecForge's own TTT recipe (OnlineEagle3Model.forward, sdpa backend), step by step."""
    _, prepare_decoder_attention_mask, _ = _specforge()
    B, T, _ = aux.shape
    h = sf.project_hidden_states(aux)
    mask = prepare_decoder_attention_mask(torch.ones(B, T, dtype=torch.bool), (B, T), h, 0)
    pos = torch.arange(T)[None].expand(B, T)
    cache_hidden, out = [[], []], []
    for j in range(STEPS):
        emb = sf.embed_input_ids(ids[:, j:j + T])
        h = sf.backbone(input_embeds=emb, hidden_states=h, cache_hidden=cache_hidden,
                        attention_mask=mask, position_ids=pos)
        out.append(sf.compute_logits(h))
    return out


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("cfg_kw", [{}, {"num_key_value_heads": 4, "rope_theta": 10000.0},
                                    {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}],
                         ids=["gqa", "mha", "llama3-rope"])
def test_draft_logits_match_specforge(tmp_path, cfg_kw):
    c = _tiny_config(**cfg_kw)
    d, embed = _export(tmp_path, c)
    sf = _load_specforge(d, embed)
    ours = load_exported(d, embed)  # through the exported directory, as the bench engine does
    aux, ids = _inputs(c)
    with torch.no_grad():
        a, b = _ours_logits(ours, aux, ids), _specforge_logits(sf, aux, ids)
    for j in range(STEPS):
        err = (a[j] - b[j]).abs().max().item()
        assert err < TOL, f"TTT step {j}: max |ours - specforge| = {err:.2e}"
    # the logits are not trivially small: the tolerance means something
    assert a[0].abs().max() > 0.1


def test_parity_detects_a_concat_order_bug(tmp_path):
    """Negative control: swapping embedding and hidden in the 2H input must break parity."""
    c = _tiny_config()
    d, embed = _export(tmp_path, c)
    sf = _load_specforge(d, embed)
    ours = load_exported(d, embed)
    mid = ours.midlayer
    mid.attn_input = lambda e, h: torch.cat([mid.hidden_norm(h), mid.input_layernorm(e)], -1)
    aux, ids = _inputs(c)
    with torch.no_grad():
        a, b = _ours_logits(ours, aux, ids), _specforge_logits(sf, aux, ids)
    assert (a[0] - b[0]).abs().max() > 1e-2


def test_parity_detects_a_recurrence_bug(tmp_path):
    """Negative control: feeding the normed output (not the pre-norm one) at step 1 must differ."""
    c = _tiny_config()
    d, embed = _export(tmp_path, c)
    sf = _load_specforge(d, embed)
    ours = load_exported(d, embed)
    aux, ids = _inputs(c)
    B, T, _ = aux.shape
    pos = torch.arange(T)[None].expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        cache = []
        h0 = ours.ttt_step(ids[:, :T], ours.project(aux), pos, cache, causal)
        h1 = ours.ttt_step(ids[:, 1:T + 1], ours.norm(h0), pos, cache, causal)
        b = _specforge_logits(sf, aux, ids)
    assert (ours.logits(h1) - b[1]).abs().max() > 1e-2


@pytest.mark.parametrize("scaling", [None, LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}],
                         ids=["default", "llama3", "linear"])
def test_rope_tables_match_specforge(tmp_path, scaling):
    """RoPE at long positions (where llama3/linear scaling matters), against SpecForge's table."""
    from eagle3_runner.models.draft_model import rope_cos_sin
    c = _tiny_config(rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=4096)
    d, embed = _export(tmp_path, c)
    rot = _load_specforge(d, embed).midlayer.self_attn.rotary_emb
    pos = torch.arange(4096)
    cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, c.rope_scaling)
    assert torch.allclose(cos, rot.cos_cached[0, 0, :4096].float(), atol=1e-4)
    assert torch.allclose(sin, rot.sin_cached[0, 0, :4096].float(), atol=1e-4)
    if scaling is not None:  # the scaling really changed the table (the check can fail)
        plain, _ = rope_cos_sin(pos, c.head_dim, c.rope_theta, None)
        assert (plain - cos).abs().max() > 1e-2
