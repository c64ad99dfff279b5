"""The embedded speculative engine: our Llama forward, losslessness, sampling, broken exports."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import export_drafter, tiny_hf_llama  # noqa: E402

from jobs.draft_model import load_exported  # noqa: E402
from jobs.engine import Engine, accept_greedy  # noqa: E402
from jobs.llama import from_hf_model  # noqa: E402

AUX = (0, 1, 2)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))


def _engine(hf, draft_dir, K=3, max_seq=256):
    t = from_hf_model(hf, AUX)
    d = load_exported(draft_dir, t.embed_tokens.weight) if draft_dir else None
    return Engine(t, d, num_steps=K, max_seq=max_seq)


def test_llama_forward_matches_hf_logits_and_aux():
    hf = tiny_hf_llama()
    t = from_hf_model(hf, AUX)
    t.setup_cache(1, 64)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        # prefill 8, then 4 more tokens incrementally through the static cache
        lg1, ax1 = t(ids[:, :8], torch.arange(8))
        lg2, ax2 = t(ids[:, 8:], torch.arange(8, 12))
    lg, ax = torch.cat([lg1, lg2], 1), torch.cat([ax1, ax2], 1)
    want_aux = torch.cat([ref.hidden_states[k + 1] for k in AUX], -1)  # SGLang id k = HF k+1
    assert torch.allclose(lg, ref.logits, atol=1e-4)
    assert torch.allclose(ax, want_aux, atol=1e-5)


def test_tiny_greedy_lossless_vs_baseline_and_hf(tmp_path):
    hf = tiny_hf_llama()
    e = _engine(hf, export_drafter(tmp_path / "d", hf.config, AUX), K=4)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (1, 9), generator=g)
        base, _ = e.generate_baseline(ids, 30)
        spec, st = e.generate(ids, 30)
        ref = hf.generate(ids, max_new_tokens=30, do_sample=False)[0, 9:].tolist()
        assert spec == base == ref
        assert st.rounds >= 1 and 1.0 <= st.tau <= 5.0


@pytest.mark.parametrize("K", [1, 3, 5])
def test_oracle_drafts_with_errors_stay_lossless(tmp_path, K):
    """Inject drafts that are partly right (the known greedy continuation with every third
    position corrupted): exercises every accept length and the cache rollback."""
    hf = tiny_hf_llama(seed=2)
    e = _engine(hf, None, K=K)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    base, _ = e.generate_baseline(ids, 40)
    calls = [0]

    def oracle(out, k):
        calls[0] += 1
        n = len(out)
        d = [base[n + j] if n + j < len(base) else 0 for j in range(k)]
        bad = calls[0] % (k + 2)  # corrupt a varying position (or none)
        if bad < k:
            d[bad] = (d[bad] + 1) % 64
        return d

    spec, st = e.generate(ids, 40, draft_fn=oracle)
    assert spec == base
    assert max(st.accepted) == K  # full acceptance happened
    assert sum(st.accepted) > 0 and len(set(st.accepted)) > 1
    assert abs(sum(st.accept_per_pos(K)) - (st.tau - 1)) < 1e-9


def test_accept_greedy_counts_prefix():
    logits = torch.full((4, 10), -1.0)
    for j, t in enumerate([3, 5, 7, 9]):
        logits[j, t] = 1.0
    assert accept_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)
    assert accept_greedy(torch.tensor([3, 6, 7]), logits) == (1, 5)
    assert accept_greedy(torch.tensor([0, 5, 7]), logits) == (0, 3)


def _bigram_target_and_drafter(tmp_path, broken: bool):
    """A target whose layers are identities (o_proj = down_proj = 0), so next = f(current), and a
    drafter built to predict f(f(t_i)) from aux at i: its first draft is always right (tau 2).
    `broken` writes d2t as absolute ids (a known export bug) instead of offsets."""
    V, H = 32, 64
    hf = tiny_hf_llama(vocab=V, hidden=H, layers=4, heads=4, kv=2, seed=5)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        q, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(6)))
        hf.model.embed_tokens.weight.copy_(q[:V] * 3.0)  # orthogonal rows
        E = hf.model.embed_tokens.weight
        nE = E * torch.rsqrt(E.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps)
        f = hf.lm_head(hf.model.norm(E)).argmax(-1)  # next token of each token [V]
        ff = f[f]

    def edit(m):
        m.fc.weight.zero_()
        m.fc.weight[:, :H] = torch.eye(H)  # hidden = aux of layer 0 = E[t_i]
        m.midlayer.self_attn.o_proj.weight.zero_()
        m.midlayer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.zero_()
        m.lm_head.weight.index_add_(0, ff, nE)  # row v = sum of n(E[t]) with f(f(t)) = v
        if broken:
            m.d2t.copy_(torch.arange(V))  # absolute ids: target = 2i

    d = export_drafter(tmp_path / ("broken" if broken else "good"), hf.config, AUX, edit=edit)
    return hf, d


@pytest.mark.parametrize("broken", [False, True])
def test_broken_d2t_export_gives_tau_one(tmp_path, broken):
    hf, d = _bigram_target_and_drafter(tmp_path, broken)
    e = _engine(hf, d, K=3)
    ids = torch.tensor([[1, 2, 3]])
    base, _ = e.generate_baseline(ids, 40)
    spec, st = e.generate(ids, 40)
    assert spec == base
    if broken:
        assert st.tau < 1.3
    else:
        assert st.tau >= 1.95  # every first draft is right


def test_speculative_sampling_matches_target_distribution(tmp_path):
    """Joint distribution of the first two sampled tokens (V = 6, 36 cells) from speculative
    sampling vs the exact target joint; chi-square at the 0.1% level (fixed seed)."""
    V, N = 6, 1500
    hf = tiny_hf_llama(vocab=V, hidden=32, layers=3, heads=2, kv=1, seed=7)
    d = export_drafter(tmp_path / "d", hf.config, AUX, seed=3)
    e = _engine(hf, d, K=3, max_seq=64)
    ids = torch.tensor([[1, 4, 2, 0, 3]])
    with torch.no_grad():
        p1 = torch.softmax(hf(ids).logits[0, -1], -1)
        joint = torch.stack([p1[a] * torch.softmax(hf(torch.cat([ids, torch.tensor([[a]])], 1))
                                                   .logits[0, -1], -1) for a in range(V)])
    g = torch.Generator().manual_seed(0)
    counts, rounds, acc = Counter(), 0, 0
    for _ in range(N):
        out, st = e.generate(ids, 2, temperature=1.0, gen=g)
        counts[tuple(out[:2])] += 1
        rounds += st.rounds
        acc += sum(st.accepted)
    obs = torch.zeros(V, V)
    for (a, b), n in counts.items():
        obs[a, b] = n
    exp = joint * N
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = V * V - 1
    z = 3.09  # 99.9% quantile (Wilson-Hilferty approximation of chi-square)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit)
    assert 0 < acc < rounds * 3  # some drafts accepted, some rejected: the rule had work to do


@pytest.mark.slow
def test_smollm2_greedy_lossless_vs_baseline_and_hf(smollm2, tmp_path):
    """Real SmolLM2 (float32, CPU), an exported random drafter and an oracle drafter with errors:
    the speculative output equals the engine's greedy decode and HF generate greedy."""
    hf, tok, cfg = smollm2
    aux = (1, 14, 26)  # SGLang default for L = 30
    t = from_hf_model(hf, aux)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, aux, draft_vocab=2048),
                      t.embed_tokens.weight)
    e = Engine(t, d, num_steps=3, max_seq=512)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "def fibonacci(n):"]
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        base, _ = e.generate_baseline(ids, 24)
        spec, st = e.generate(ids, 24)
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        assert spec == base == ref[:len(base)], (p, spec, base, ref)
        if i == 0:  # oracle drafts, one wrong token per round at a varying place
            calls = [0]

            def oracle(out, k):
                calls[0] += 1
                d = [base[len(out) + j] if len(out) + j < len(base) else 0 for j in range(k)]
                if calls[0] % 4 < k:
                    d[calls[0] % 4] = 0
                return d
            spec2, st2 = e.generate(ids, 24, draft_fn=oracle)
            assert spec2 == base and st2.tau > 1.5
