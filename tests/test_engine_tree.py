"""Tree drafting in the embedded engine (engine/tree.py): the same tree as SGLang, the drafter's
tree attention, greedy losslessness (tiny and SmolLM2), tree sampling, static compiled steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import export_drafter, tiny_hf_llama  # noqa: E402
from test_engine import _chi2, _chi2_crit  # noqa: E402

from eagle3_runner.models.draft_model import load_exported  # noqa: E402
from eagle3_runner.engine.speculative import Engine  # noqa: E402
from eagle3_runner.engine.steps import draft_extend, draft_step  # noqa: E402
from eagle3_runner.models.llama import from_hf_model  # noqa: E402
from eagle3_runner.engine.tree import draft_tree  # noqa: E402
from eagle3_runner.runner.drafts.checks import check_draft_tokens  # noqa: E402
from eagle3_runner.targets.load import end_of_turn_ids  # noqa: E402

AUX = (0, 1, 2)
SHAPES = [(3, 4, 16), (5, 4, 8), (2, 2, 4)]  # num_steps / eagle_topk / num_draft_tokens


def _sharpen(m):
    m.lm_head.weight.mul_(20.0)  # peaked draft distributions: deep trees, no near-tied scores


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))


# ----------------------------------------------------------------------------------------------
# SGLang's selection rule, re-written from sglang 0.5.23 (independently of engine/tree.py)


def sglang_tree(root_logits, child_logits, K, k, N):
    """SGLang 0.5.23 at batch 1: the loop of eagle_worker_v2.py draft_forward over
    spec_utils.py select_top_k_tokens (first / later), eagle_utils.py organize_draft_results,
    then the parent lookup of sgl-kernel's build_tree_kernel_efficient (a node's parent is
    candidate parent_list[index // topk], the root when that is 0). root_logits [Vd];
    child_logits(paths) -> [k, Vd], the drafter's logits for k rows, each row's path of tokens
    from the root. Returns (tokens [N-1] of nodes 1..N-1, parents [N-1], 0 = the root)."""
    topk_p, topk_index = torch.softmax(root_logits[None], -1).topk(k, -1)  # (1, k)
    paths = [()]  # stands for the rows' hidden states
    score_list, token_list, parents_list, scores = [], [], [], None
    for i in range(K):
        if i == 0:
            input_ids = topk_index.flatten()
            paths = paths * k  # hidden_states.repeat_interleave(topk)
            scores = topk_p
            score_list.append(topk_p.unsqueeze(1))
            token_list.append(topk_index)
            parents_list.append(torch.arange(-1, k)[None])
        else:
            expand_scores = scores.unsqueeze(2) * topk_p.view(-1, k, k)  # (1, k, k)
            topk_cs_p, topk_cs_index = expand_scores.flatten(1).topk(k, -1)
            topk_index = topk_index.view(-1, k * k)
            input_ids = torch.gather(topk_index, 1, topk_cs_index).flatten()
            paths = [paths[c // k] for c in topk_cs_index[0].tolist()]  # hidden_states[sel]
            score_list.append(expand_scores)
            token_list.append(topk_index)
            parents_list.append(topk_cs_index + (k * k * (i - 1) + k))
            scores = topk_cs_p
        if i == K - 1:
            break
        paths = [p + (t,) for p, t in zip(paths, input_ids.tolist())]  # the draft forward
        topk_p, topk_index = torch.softmax(child_logits(paths), -1).topk(k, -1)  # (k, k)
    score = torch.cat(score_list, 1).flatten(1)
    tokens = torch.cat(token_list, 1)
    top = torch.sort(torch.topk(score, N - 1, -1).indices).values
    draft = torch.gather(tokens, 1, top)[0]
    parent_list = torch.cat(parents_list[:-1], 1)[0] if len(parents_list) > 1 else None
    top = top[0].tolist()
    parents = []
    for c in top:
        pidx = c // k
        parents.append(0 if pidx == 0 else 1 + top.index(int(parent_list[pidx])))
    return draft, torch.tensor(parents)


class PathDrafter:
    """A fake drafter whose 'hidden state' is a code of the row's path of tokens and whose
    logits are a fixed integer hash of that code: fixed draft logits per tree node, so the
    engine's draft_tree and sglang_tree see the same distributions at the same nodes."""

    def __init__(self, vocab: int):
        self.V = vocab

    def code(self, path) -> int:
        c = 0
        for t in path:
            c = c * (self.V + 1) + t + 1
        return c

    def hash_logits(self, code: torch.Tensor) -> torch.Tensor:
        j = torch.arange(self.V)
        h = (code[..., None] * 1103515245 + j * 12345 + (code[..., None] + 7) * j * j) % 1000003
        return h.float() / 1000003 * 8.0  # [..., V] in [0, 8)

    def cached_step(self, ids, hidden, positions, kc, vc, slots, mask):
        return hidden * (self.V + 1) + (ids[..., None] + 1).float()

    def logits(self, out):
        return self.hash_logits(out[..., 0].long())

    def to_target_ids(self, i):
        return i


@pytest.mark.parametrize("K,k,N", SHAPES + [(4, 3, 20), (1, 4, 5), (3, 2, 11), (2, 3, 13)])
def test_draft_tree_selects_the_same_tree_as_sglang(K, k, N):
    """On fixed draft logits, the engine's draft_tree picks SGLang 0.5.23's tokens and parents
    (also when N reaches SGLang's bound)."""
    V = 16
    d = PathDrafter(V)
    first = torch.tensor([5])
    root_logits = d.hash_logits(torch.tensor([0]))  # [1, V]
    kc = torch.zeros(1, 1, 64, 1)  # only its slot count (S = 64) is read
    toks, parent, tmask, depth = draft_tree(d, kc, kc, first, torch.zeros(1, 1, 1),
                                            root_logits, torch.tensor([10]), K, k, N, V)
    want_tok, want_par = sglang_tree(root_logits[0], lambda paths: d.hash_logits(
        torch.tensor([d.code(p) for p in paths])), K, k, N)
    assert toks[0].tolist() == [5] + want_tok.tolist()
    assert parent.tolist() == [-1] + want_par.tolist()
    # depth and the ancestor mask follow the parents
    for j in range(1, N):
        anc, p = {j}, int(parent[j])
        while p >= 0:
            anc.add(p)
            p = int(parent[p])
        assert set(torch.nonzero(tmask[j])[:, 0].tolist()) == anc
        assert int(depth[j]) == len(anc) - 1
    assert N <= check_draft_tokens(K, k, None).bound and check_draft_tokens(3, 4, None).bound == 37


def test_draft_tree_attention_equals_the_chain_along_each_path(tmp_path):
    """A real drafter: every tree node's distribution is what the drafter's chain (draft_step,
    the TTT semantics) gives along that node's path, so the tree equals sglang_tree fed with
    chain-recomputed logits. A tree step that attended the wrong keys (another branch's, or
    none) would change the logits and the selected tree."""
    hf = tiny_hf_llama(seed=3)
    t = from_hf_model(hf, AUX)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, AUX, seed=4, edit=_sharpen),
                      t.embed_tokens.weight)
    K, k, N, S, V = 4, 3, 12, 64, 64
    kc = torch.zeros(1, d.config.num_key_value_heads, S, d.config.head_dim)
    vc = torch.zeros_like(kc)
    slots = torch.arange(S)
    g = torch.Generator().manual_seed(0)
    T = 9
    aux = torch.randn(1, T, 3 * hf.config.hidden_size, generator=g)
    nxt = torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        root, rlog, _ = draft_extend(d, kc, vc, aux, nxt, slots[:T], slots[T - 1:T])
        toks, parent, _, _ = draft_tree(d, kc, vc, nxt[0, -1:], root, rlog, slots[T - 1:T], K, k,
                                        N, V)

        def chain_logits(paths):
            rows = []
            for p in paths:
                h = root
                for j, tok in enumerate(p):
                    h, lg = draft_step(d, kc, vc, torch.tensor([[tok]]), h,
                                       slots[T + j:T + j + 1])
                rows.append(lg[0, -1])
            return torch.stack(rows)
        want_tok, want_par = sglang_tree(rlog[0], chain_logits, K, k, N)
    assert toks[0, 1:].tolist() == want_tok.tolist()
    assert parent[1:].tolist() == want_par.tolist()
    assert int(parent.max()) > 0  # the tree goes deeper than the root's children


# ----------------------------------------------------------------------------------------------
# losslessness


def _tiny(tmp_path, seed=2):
    """A tiny random target and a sharpened random drafter (its trees reach full depth)."""
    hf = tiny_hf_llama(seed=seed)
    t = from_hf_model(hf, AUX)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, AUX, edit=_sharpen),
                      t.embed_tokens.weight)
    return hf, t, d


def tree_oracle(base, calls, V, period):
    """draft_fn for trees: the known continuation `base` on the path to the last of the
    deepest nodes, every other node wrong; one path node corrupted at a depth that varies per
    call (or none), so rounds accept 0..D drafts through non-first children."""
    def fn(out, parents):
        calls[0] += 1
        par, depth = [-1] + list(parents), [0]
        for j in range(1, len(par)):
            depth.append(depth[par[j]] + 1 if par[j] >= 0 else 0)
        on, j = set(), max(range(len(par)), key=lambda i: (depth[i], i))
        while j > 0:
            on.add(j)
            j = par[j]
        bad = calls[0] % period + 1  # a depth 1..period; > the tree's depth: none
        res = []
        for j in range(1, len(par)):
            i = len(out) + depth[j] - 1
            right = base[i] if 0 <= i < len(base) else 0
            res.append(right if j in on and depth[j] != bad else (right + 1 + j) % V)
        return res
    return fn


@pytest.mark.parametrize("K,k,N", SHAPES + [(5, 2, 3)])
def test_tiny_tree_greedy_lossless(tmp_path, K, k, N):
    """Greedy trees equal the engine's greedy decode and HF generate, with the drafter's own
    (random) trees and with oracle tokens accepted 0..D at a time through non-first children."""
    hf, t, d = _tiny(tmp_path)
    e = Engine(t, d, num_steps=K, eagle_topk=k, num_draft_tokens=N, max_seq=160)
    g = torch.Generator().manual_seed(1)
    accepted = set()
    for p in range(2):
        ids = torch.randint(0, 64, (1, 7 + p), generator=g)
        base, _ = e.generate_baseline(ids, 40)
        ref = hf.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
        own, _ = e.generate(ids, 40)
        orc, st = e.generate(ids, 40, draft_fn=tree_oracle(base, [p], 64, e.D + 1))
        assert own == orc == base == ref, p
        accepted |= set(st.accepted)
    assert accepted == set(range(e.D + 1))  # every accept length, the full depth included


def test_tree_engine_rejects_inconsistent_shapes(tmp_path):
    _, t, d = _tiny(tmp_path)
    with pytest.raises(ValueError, match="required when eagle_topk > 1"):
        Engine(t, d, num_steps=3, eagle_topk=4, max_seq=64)
    with pytest.raises(ValueError, match="= 37 .SGLang.s candidate list"):
        Engine(t, d, num_steps=3, eagle_topk=4, num_draft_tokens=38, max_seq=64)
    with pytest.raises(ValueError, match="must equal num_steps"):
        Engine(t, d, num_steps=3, num_draft_tokens=5, max_seq=64)
    with pytest.raises(ValueError, match="width"):
        Engine(t, d, num_steps=3, eagle_topk=4, num_draft_tokens=16, width=8, max_seq=64)
    e = Engine(t, d, num_steps=2, eagle_topk=2, num_draft_tokens=4, max_seq=64)
    with pytest.raises(ValueError, match="draft_fn returned 2 drafts"):
        e.generate(torch.tensor([[1, 2, 3]]), 8, draft_fn=lambda out, parents: [0, 0])
    with pytest.raises(ValueError, match="max_seq"):
        e.generate(torch.tensor([[1, 2, 3]]), 60)


def test_tree_sampling_matches_target_distribution(tmp_path):
    """The whole tree engine at temperature 1 (tiny random target + drafter, V = 6, tree 2/3/6):
    the first three sampled tokens follow the target's exact marginals (chi-square, 0.1%). The
    second and third come from tree rows (mask, positions) or, after a round, committed KV."""
    V, R = 6, 300
    hf = tiny_hf_llama(vocab=V, hidden=32, layers=3, heads=2, kv=1, seed=7)
    t = from_hf_model(hf, AUX)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, AUX, seed=3),
                      t.embed_tokens.weight)
    e = Engine(t, d, num_steps=2, eagle_topk=3, num_draft_tokens=6, max_seq=24)
    ids = torch.tensor([[1, 4, 2, 0, 3]])

    def nxt(prefix):  # the target's next-token distribution after ids + prefix
        x = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], 1)
        return torch.softmax(hf(x).logits[0, -1], -1)
    with torch.no_grad():
        p1 = nxt([])
        p12 = torch.stack([p1[a] * nxt([a]) for a in range(V)])  # [V, V]
        p3 = sum(p12[a, b] * nxt([a, b]) for a in range(V) for b in range(V))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3, V)
    rounds = acc = 0
    for _ in range(R):
        out, st = e.generate(ids, 3, temperature=1.0, gen=g)
        for i in range(3):
            counts[i, out[i]] += 1
        rounds += st.rounds
        acc += sum(st.accepted)
    for i, p in enumerate([p1, p12.sum(0), p3]):
        assert _chi2(counts[i], p) < _chi2_crit(V - 1), i
    assert 0 < acc < rounds * e.D  # some drafts accepted, some rejected


@pytest.mark.parametrize("mode", ["aot_eager", pytest.param("cuda_graph", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_compiled_tree_steps_stay_static(tmp_path, mode):
    """The compiled tree path (CPU: aot_eager, the same dynamo guards as CUDA graphs; gpu: the
    real mode="reduce-overhead") over 6 prompt lengths, accept lengths 0..D and padded verify
    rows: one graph per step, outputs equal to the eager greedy baseline; the sampling verify
    runs through its own graph."""
    dev = "cuda" if mode == "cuda_graph" else "cpu"
    hf = tiny_hf_llama(seed=2)
    t = from_hf_model(hf, AUX, device=dev)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, AUX, edit=_sharpen),
                      t.embed_tokens.weight, dev)
    K, k, N = 3, 2, 6
    kw = dict(cuda_graph=True) if mode == "cuda_graph" else dict(compile_backend=mode)
    eager = Engine(t, None, num_steps=K, max_seq=128, width=N + 1)
    e = Engine(t, d, num_steps=K, eagle_topk=k, num_draft_tokens=N, max_seq=128, width=N + 1,
               sampling=True, **kw)
    graphs = dict(decode=1, tree=1, tree_round=1, tree_verify=1, tree_verify_sample=1)
    assert e.graph_counts() == dict.fromkeys(graphs, 0)  # built on first use
    accepted, g = set(), torch.Generator().manual_seed(0)
    for p in range(6):
        ids = torch.randint(0, 64, (1, 4 + p), generator=g).to(dev)
        base, _ = eager.generate_baseline(ids, 30)
        spec, st = e.generate(ids, 30, draft_fn=tree_oracle(base, [p], 64, e.D + 1))
        own, _ = e.generate(ids, 30)
        assert spec == own == base == e.generate_baseline(ids, 30)[0], p
        accepted |= set(st.accepted)
        e.generate(ids, 12, temperature=0.8, gen=torch.Generator(dev).manual_seed(p))
    assert accepted == set(range(e.D + 1))
    assert e.graph_counts() == graphs


@pytest.mark.slow
def test_smollm2_tree_greedy_lossless(smollm2, smollm2_path, tmp_path):
    """Real SmolLM2 (float32, CPU), a random drafter, trees 3/4/16, 5/4/8 and 2/2/4: the output
    equals the engine's greedy decode and HF generate; oracle tokens on the first prompt make
    rounds accept deep paths (KV commit of non-contiguous nodes)."""
    hf, tok, cfg = smollm2
    aux = (1, 14, 26)
    t = from_hf_model(hf, aux)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, aux, draft_vocab=2048),
                      t.embed_tokens.weight)
    engines = [Engine(t, d, num_steps=K, eagle_topk=k, num_draft_tokens=N, max_seq=256)
               for K, k, N in SHAPES]
    stop = end_of_turn_ids(smollm2_path, tok)
    for i, p in enumerate(["What is the capital of France?", "def fibonacci(n):"]):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        base, _ = engines[0].generate_baseline(ids, 16, stop_ids=stop)
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        assert base == ref
        for e in engines:
            own, _ = e.generate(ids, 16, stop_ids=stop)
            assert own == base, (p, e.K, e.topk, e.N)
            if i == 0:
                orc, st = e.generate(ids, 16, stop_ids=stop, draft_fn=tree_oracle(
                    base, [0], cfg["vocab_size"], e.D + 1))
                assert orc == base and st.tau > 1.5, (e.K, e.topk, e.N, st.accepted)
