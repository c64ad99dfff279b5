"""The embedded speculative engine: our Llama forward, losslessness, sampling, broken exports."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import export_drafter, tiny_hf_llama  # noqa: E402

from eagle3_runner.models.draft_model import load_exported  # noqa: E402
from eagle3_runner.engine.speculative import Engine, accept_greedy  # noqa: E402
from eagle3_runner.models.llama import from_hf_model  # noqa: E402

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


def _chi2_crit(df: int, z: float = 3.09) -> float:
    """Upper 99.9% quantile of chi-square(df), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(obs: torch.Tensor, p: torch.Tensor) -> float:
    exp = p * obs.sum()
    return float(((obs - exp) ** 2 / exp).sum())


def test_accept_sample_rule_preserves_target_distribution():
    """One round, K = 2, fixed p/q over V = 5: the first output token ~ p1, and the second
    (when d_1 was accepted) ~ p2. A rule that just accepted drafts would give q instead."""
    from eagle3_runner.engine.speculative import accept_sample
    g = torch.Generator().manual_seed(0)
    V, N = 5, 6000
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        d = torch.multinomial(q, 1, generator=g)[:, 0]
        m, bonus = accept_sample(d, q, p, g)
        toks = d[:m].tolist() + [bonus]
        first[toks[0]] += 1
        if m >= 1:
            second[toks[1]] += 1
    assert _chi2(first, p[0]) < _chi2_crit(V - 1)
    assert _chi2(second, p[1]) < _chi2_crit(V - 1)
    assert _chi2(first, q[0]) > _chi2_crit(V - 1)  # the test can fail: q differs from p


def test_speculative_sampling_matches_target_distribution(tmp_path):
    """The whole engine at temperature 1 (tiny random target + exported random drafter, V = 6):
    the first and second sampled tokens follow the target's exact marginals (chi-square, 0.1%)."""
    V, N = 6, 400
    hf = tiny_hf_llama(vocab=V, hidden=32, layers=3, heads=2, kv=1, seed=7)
    d = export_drafter(tmp_path / "d", hf.config, AUX, seed=3)
    e = _engine(hf, d, K=2, max_seq=16)
    ids = torch.tensor([[1, 4, 2, 0, 3]])
    with torch.no_grad():
        p1 = torch.softmax(hf(ids).logits[0, -1], -1)
        joint = torch.stack([p1[a] * torch.softmax(hf(torch.cat([ids, torch.tensor([[a]])], 1))
                                                   .logits[0, -1], -1) for a in range(V)])
    g = torch.Generator().manual_seed(0)
    first, second, rounds, acc = torch.zeros(V), torch.zeros(V), 0, 0
    for _ in range(N):
        out, st = e.generate(ids, 2, temperature=1.0, gen=g)
        first[out[0]] += 1
        second[out[1]] += 1
        rounds += st.rounds
        acc += sum(st.accepted)
    assert _chi2(first, joint.sum(1)) < _chi2_crit(V - 1)
    assert _chi2(second, joint.sum(0)) < _chi2_crit(V - 1)
    assert 0 < acc < rounds * 2  # some drafts accepted, some rejected: the rule had work to do


@pytest.mark.slow
def test_smollm2_greedy_lossless_vs_baseline_and_hf(smollm2, smollm2_path, tmp_path):
    """Real SmolLM2 (float32, CPU), an exported random drafter and an oracle drafter with errors:
    the speculative output equals the engine's greedy decode and HF generate greedy (both stop
    at the model's end of turn)."""
    from eagle3_runner.targets.load import end_of_turn_ids
    hf, tok, cfg = smollm2
    stop = end_of_turn_ids(smollm2_path, tok)
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
        base, _ = e.generate_baseline(ids, 24, stop_ids=stop)
        spec, st = e.generate(ids, 24, stop_ids=stop)
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        assert spec == base == ref, (p, spec, base, ref)
        if i == 0:  # oracle drafts, one wrong token per round at a varying place
            calls = [0]

            def oracle(out, k):
                calls[0] += 1
                d = [base[len(out) + j] if len(out) + j < len(base) else 0 for j in range(k)]
                if calls[0] % 4 < k:
                    d[calls[0] % 4] = 0
                return d
            spec2, st2 = e.generate(ids, 24, draft_fn=oracle, stop_ids=stop)
            assert spec2 == base and st2.tau > 1.5


@pytest.mark.parametrize("mode", ["aot_eager", pytest.param("cuda_graph", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_compiled_steps_stay_static_under_varying_accept_lengths(tmp_path, mode):
    """Regression (H200 bench, cuda_graph + a trained drafter: FailOnRecompileLimitHit in
    draft_step). The compiled path on CPU (backend aot_eager: the same dynamo guards as CUDA
    graphs) over 10 prompt lengths, with forced drafts through the real drafter chain whose accept
    length varies 0..K across rounds: each compiled step keeps ONE graph (the old engine passed a
    sliced root hidden state whose stride changed with the prompt length and recompiled until the
    limit of 8), and every output equals the eager engine's greedy baseline. The gpu variant runs
    the real mode="reduce-overhead" (CUDA graphs)."""
    hf = tiny_hf_llama(seed=2)
    dev = "cuda" if mode == "cuda_graph" else "cpu"
    t = from_hf_model(hf, AUX, device=dev)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, AUX), t.embed_tokens.weight, dev)
    K = 3
    eager = Engine(t, d, num_steps=K, max_seq=128, width=K + 2)  # padded verify rows too
    kw = dict(cuda_graph=True) if mode == "cuda_graph" else dict(compile_backend=mode)
    kw["width"] = K + 2
    e = Engine(t, d, num_steps=K, max_seq=128, **kw)
    greedy_graphs = dict(decode=1, verify=1, chain=1, round=1)
    # nothing is built before its generate path first runs (a bench engine never pays for a
    # graph it does not use)
    assert e.compiled and e.graph_counts() == dict.fromkeys(greedy_graphs, 0)
    accepted, g = set(), torch.Generator().manual_seed(0)
    for p in range(10):
        ids = torch.randint(0, 64, (1, 4 + p), generator=g).to(dev)
        base, _ = eager.generate_baseline(ids, 30)
        calls = [0]

        def oracle(out, k):  # the known continuation with a varying corrupted position (or none)
            calls[0] += 1
            dr = [base[len(out) + j] if len(out) + j < len(base) else 0 for j in range(k)]
            bad = (calls[0] + p) % (k + 2)
            if bad < k:
                dr[bad] = (dr[bad] + 1) % 64
            return dr

        spec, st = e.generate(ids, 30, draft_fn=oracle)
        own, _ = e.generate(ids, 30)  # the drafter's own (random) drafts
        assert spec == own == base, p
        assert e.generate_baseline(ids, 30)[0] == base
        accepted |= set(st.accepted)
    assert accepted == set(range(K + 1))  # every accept length occurred
    assert e.graph_counts() == greedy_graphs
    with pytest.raises(ValueError, match="sampling=True"):
        e.generate(ids, 12, temperature=1.0)
    # the sampling engine's step-by-step graphs: greedy and sampled rounds through one graph each
    es = Engine(t, d, num_steps=K, max_seq=128, sampling=True, **kw)
    for p in range(3):
        ids = torch.randint(0, 64, (1, 5 + p), generator=g).to(dev)
        assert es.generate(ids, 30)[0] == eager.generate_baseline(ids, 30)[0]
        es.generate(ids, 12, temperature=1.0, gen=torch.Generator(dev).manual_seed(p))
    assert es.graph_counts() == dict(decode=0, verify=1, extend=1, step=1)  # no baseline run
    # a new shape after warm-up raises instead of silently recompiling or falling back
    with pytest.raises(RuntimeError, match="new input shape"), torch.inference_mode():
        with e._sealed():
            e.steps["verify"](t, torch.zeros(1, K + 2, dtype=torch.long, device=dev),
                              e.slots[:K + 3])
    with torch._dynamo.config.patch(suppress_errors=True), pytest.raises(ValueError,
                                                                         match="suppress_errors"):
        Engine(t, d, num_steps=K, max_seq=128, compile_backend="eager")


@pytest.mark.slow
def test_smollm2_bf16_lossless_with_a_shared_width(smollm2, tmp_path):
    """bf16 (the H200 bench dtype) on CPU: a 1-row decode and a (K+1)-row verify round
    differently, so a plain greedy decode and speculative rounds drift apart (the H200 bench:
    24 of 80 MT-bench prompts identical over 256 tokens). With one `width` for every target
    forward, the baseline and engines of different K give identical tokens, with the drafter's
    own drafts, with all-wrong drafts, and with oracle drafts that are accepted 0..K at a time."""
    import copy
    hf, tok, cfg = smollm2
    aux = (1, 14, 26)
    t = from_hf_model(copy.deepcopy(hf).to(torch.bfloat16), aux)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, aux, draft_vocab=2048),
                      t.embed_tokens.weight, dtype=torch.bfloat16)
    W = 6
    base_engine = Engine(t, None, num_steps=5, max_seq=256, width=W)
    engines = [Engine(t, d, num_steps=K, max_seq=256, width=W) for K in (3, 5)]
    with pytest.raises(ValueError, match="width"):
        Engine(t, d, num_steps=6, max_seq=256, width=W)
    for p in ["Describe a sunset over the ocean in detail.", "Explain how a bicycle works."]:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        base, _ = base_engine.generate_baseline(ids, 48)
        for e in engines:
            calls = [0]

            def oracle(out, k):
                calls[0] += 1
                dr = [base[len(out) + j] if len(out) + j < len(base) else 0 for j in range(k)]
                if calls[0] % (k + 2) < k:
                    dr[calls[0] % (k + 2)] = 0
                return dr
            own, _ = e.generate(ids, 48)
            wrong, _ = e.generate(ids, 48, draft_fn=lambda out, k: [0] * k)
            orc, st = e.generate(ids, 48, draft_fn=oracle)
            assert own == wrong == orc == base, (p, e.K)
            assert st.tau > 1.5


def test_stop_token_mid_round_ends_generation(tmp_path):
    """A stop token among the accepted drafts (not the round's last token) ends generation at
    once: the rounds past it were once timed and counted (tau, tok/s) though their tokens were
    cut. Forced drafts: a wrong count is refused."""
    hf = tiny_hf_llama(seed=2)
    e = _engine(hf, None, K=3)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(3))
    base, _ = e.generate_baseline(ids, 40)
    i = next(j for j in range(2, 30) if base[j] not in base[:j])  # first occurrence at j >= 2
    stop = (base[i],)
    want, _ = e.generate_baseline(ids, 40, stop_ids=stop)
    assert want == base[:i + 1]
    oracle = lambda out, k: [base[len(out) + j] if len(out) + j < len(base) else 0
                             for j in range(k)]
    out, st = e.generate(ids, 40, stop_ids=stop, draft_fn=oracle)
    assert out == want
    assert st.rounds == -(-i // 4) and st.new_tokens == i + 1  # every round accepts all 3
    with pytest.raises(ValueError, match="draft_fn returned 4 drafts"):
        e.generate(ids, 10, draft_fn=lambda out, k: [0] * (k + 1))
