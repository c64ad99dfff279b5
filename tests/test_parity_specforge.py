"""Parity of our drafter with an independent implementation: SpecForge's LlamaForCausalLMEagle3
(and, for the training options of docs/training-options.md, SpecForge 0.2.0's fc_norm, its LK
losses and its target distributions; its norm_output differs from SGLang's, see below).

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


def _specforge_logits(sf, aux, ids, recycle_norm=False):
    """SpecForge's own TTT recipe (OnlineEagle3Model.forward, sdpa backend), step by step.
    recycle_norm: SGLang 0.5.14's norm_output rule instead, the recycled hidden is norm(out)
    (llama_eagle3.py returns hidden_states_to_logits as the aux output), logits =
    lm_head(norm(out)); SpecForge 0.2.0's own loop recycles the pre-norm out whatever the flag."""
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
        h = sf.norm(h) if recycle_norm else h
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


# ---------------------------------------------------------------------------------------------
# the training options (docs/training-options.md)


def test_fc_norm_matches_specforge(tmp_path):
    """drafter.fc_norm: our exported fc_norm.{i}.weight and config key load into SpecForge
    0.2.0's fc_norm (3 RMSNorms over the aux chunks before fc) and give its logits."""
    c = _tiny_config(fc_norm=True)
    d, embed = _export(tmp_path, c)  # random norm weights (not ones), fc_norm's included
    sf = _load_specforge(d, embed)
    assert sf.fc_norm is not None
    ours = load_exported(d, embed)
    aux, ids = _inputs(c)
    aux = aux * torch.tensor([0.1, 1.0, 10.0]).repeat_interleave(c.target_hidden_size)  # scales
    with torch.no_grad():
        a, b = _ours_logits(ours, aux, ids), _specforge_logits(sf, aux, ids)
        plain = DraftConfig(**{**c.as_dict(), "fc_norm": False})
        no_norm = Eagle3Draft(plain, embed)
        no_norm.load_state_dict({k: v for k, v in ours.state_dict().items()
                                 if not k.startswith("fc_norm")})
        off = _ours_logits(no_norm, aux, ids)
    for j in range(STEPS):
        assert (a[j] - b[j]).abs().max() < TOL, j
    assert (off[0] - b[0]).abs().max() > 1e-2  # fc_norm changes the forward: the check can fail


def test_norm_output_recycles_the_normed_hidden_as_sglang_does(tmp_path):
    """drafter.norm_output: our TTT logits equal SpecForge's pieces driven by SGLang 0.5.14's rule
    (recycle norm(out)); SpecForge 0.2.0's own loop (pre-norm recycled) differs from step 1 on:
    the train/serve mismatch of its eagle3.1 config (fixed upstream after 0.2.0)."""
    c = _tiny_config(fc_norm=True, norm_output=True)
    d, embed = _export(tmp_path, c)
    sf = _load_specforge(d, embed)
    ours = load_exported(d, embed)
    aux, ids = _inputs(c)
    with torch.no_grad():
        a = _ours_logits(ours, aux, ids)
        b = _specforge_logits(sf, aux, ids, recycle_norm=True)
        own = _specforge_logits(sf, aux, ids)
    for j in range(STEPS):
        assert (a[j] - b[j]).abs().max() < TOL, j
    assert (a[0] - own[0]).abs().max() < TOL  # step 0 reads fc(aux) in both
    assert (a[1] - own[1]).abs().max() > 1e-2


def _lk_inputs(B=2, T=9, V=40, Vd=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, T, V, generator=g) * 2
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:Vd]] = True
    logits = torch.randn(B, T, Vd, generator=g) * 2
    return target, t2d, logits


def test_target_distributions_match_specforge():
    """Our target_dist's p (softmax over the draft vocab) and p x cover (the full-vocab
    probabilities there, what alpha reads) equal SpecForge 0.2.0's target_p / target_p_on_draft."""
    _specforge()
    from specforge.algorithms.eagle3.model import _compute_target_p
    from eagle3_runner.trainer.objective import target_dist
    _, t2d, _ = _lk_inputs()
    g = torch.Generator().manual_seed(4)
    x, V = torch.randn(2, 9, 16, generator=g), t2d.numel()
    head = {"norm": torch.rand(16, generator=g) + 0.5, "lm_head": torch.randn(V, 16, generator=g)}
    ours = target_dist(x, head, t2d.nonzero().flatten(), t2d, 1e-6)
    target = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * head["norm"]) \
        @ head["lm_head"].T  # what SpecForge's TargetHead gets: the target's logits
    B, T = x.shape[:2]
    sf_p, sf_pd, sf_ids, _ = _compute_target_p(target, t2d, torch.ones(B, T, 1))
    assert torch.allclose(ours.p, sf_p, atol=1e-5)
    assert torch.allclose(ours.p * ours.cover[..., None], sf_pd, atol=1e-5)
    assert torch.equal(ours.target_ids, sf_ids)


@pytest.mark.parametrize("kind", ["alpha", "lambda"])
def test_lk_losses_match_specforge(kind):
    """stages.train.loss lk_alpha / lk_lambda against SpecForge 0.2.0's compute_lk_loss (with
    lk_eta = its kl_decay, kl_scale 1), on one TTT step with every position trained: there its
    denominators (B x T for the KL, the masked count for alpha) and ours (the trained count)
    agree."""
    _specforge()
    from specforge.algorithms.eagle3.model import _compute_target_p
    from specforge.core.lk_loss import compute_acceptance_rate, compute_lk_loss
    from specforge.core.loss import _compute_loss
    from eagle3_runner.trainer.objective import Loss, position_losses
    target, t2d, logits = _lk_inputs()
    B, T, _ = target.shape
    mask = torch.ones(B, T, 1)
    p, p_on_draft, _, _ = _compute_target_p(target, t2d, mask)
    kl = _compute_loss(logits, p, mask)
    acc, log_acc = compute_acceptance_rate(logits=logits, target_probs=p_on_draft,
                                           position_mask=mask)
    eta = 3.0
    sf = compute_lk_loss(kl_loss=kl, acceptance_rate=acc, log_acceptance_rate=log_acc,
                         lk_loss_type=kind, kl_scale=1.0, kl_decay=eta)
    cover = p_on_draft.sum(-1) / p.sum(-1)
    ours = position_losses(logits, p, cover, torch.ones(B, T, dtype=torch.bool),
                           Loss("lk_" + kind, eta)).mean()
    assert float(ours) == pytest.approx(float(sf), rel=1e-5)
    kl_ours = position_losses(logits, p, cover, torch.ones(B, T, dtype=torch.bool)).mean()
    assert abs(float(kl_ours) - float(sf)) > 1e-3  # the LK loss is not the KL: it can fail
