"""engine/generate.py: batched continuous generation on the embedded target."""

import pytest
import torch

from engine_helpers import tiny_hf_llama
from eagle3_runner.engine.generate import Generator, Request, pick
from eagle3_runner.models.llama import from_hf_model


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_llama(vocab=64, layers=2)
    return hf, from_hf_model(hf)


def _hf_greedy(hf, ids, n):
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          do_sample=False, temperature=None, top_p=None, top_k=None,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _run(gen, reqs, **kw):
    got = {}
    st = gen.run(reqs, lambda rs: got.update((r.key, r) for r in rs), **kw)
    return got, st


PROMPTS = [[5, 9, 1], [3, 3, 8, 41, 0, 2, 7, 7, 19], [60, 1, 2, 3, 4], [8] * 12, [1, 2], [33] * 7]


def test_greedy_equals_hf_generate_smollm2(smollm2):
    """Real SmolLM2, float32 CPU: 3 chat prompts through 2 rows (the third enters a freed row,
    batched prefill with right padding) give HF generate's greedy tokens, each prompt alone."""
    hf, tok, _ = smollm2
    target = from_hf_model(hf)
    qs = ["What is the capital of France?", "Write a haiku about rain.",
          "List three prime numbers and explain why they are prime."]
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"] for q in qs]
    want = [_hf_greedy(hf, i, 16) for i in ids]
    gen = Generator(target, rows=2, max_seq=128, max_new=16, sync_every=4)
    got, st = _run(gen, [Request(k, i, 16) for k, i in enumerate(ids)])
    assert [got[k].tokens for k in range(3)] == want
    assert st["new_tokens"] == 48 and st["prefills"] == 2  # the third prompt refilled a row


def test_compiled_step_is_one_graph_across_kv_buckets(tiny):
    """Compiled (CPU, backend eager) = eager, token for token, and the decode step is ONE
    graph although kv_len took several bucket values (a dynamic dimension)."""
    hf, target = tiny
    reqs = lambda: [Request(k, p, 40) for k, p in enumerate(PROMPTS)]  # noqa: E731
    eager, _ = _run(Generator(target, rows=2, max_seq=128, max_new=40, kv_bucket=16), reqs())
    gen = Generator(target, rows=2, max_seq=128, max_new=40, kv_bucket=16,
                    compile_backend="eager")
    comp, st = _run(gen, reqs())
    assert {k: r.tokens for k, r in comp.items()} == {k: r.tokens for k, r in eager.items()}
    assert eager[1].tokens == _hf_greedy(hf, PROMPTS[1], 40)
    assert len(st["kv_lens"]) >= 3 and gen.graph_counts() == 1  # several buckets, one graph
    sampled, _ = _run(gen, reqs(), temperature=0.9)  # greedy and sampled: the same graph
    assert gen.graph_counts() == 1
    assert {k: r.tokens for k, r in sampled.items()} != {k: r.tokens for k, r in eager.items()}


def test_pick_at_temperature_zero_is_the_argmax():
    """The shared greedy/sampled graph: at temperature 0 every row takes the plain argmax (no
    noise), whatever its seed; at temperature > 0 the noise moves some rows off it."""
    from eagle3_runner.engine.generate import _mix
    g = torch.Generator().manual_seed(0)
    z = torch.randn(256, 50, generator=g)
    seed, step, vh = torch.arange(256), torch.zeros(256, dtype=torch.long), _mix(torch.arange(50))
    got = pick(z, "sample", torch.zeros(1), torch.ones(1), seed, step, vh)
    assert torch.equal(got, z.argmax(-1))
    assert not torch.equal(pick(z, "sample", torch.ones(1), torch.ones(1), seed, step, vh),
                           z.argmax(-1))
    # the eager Generator's greedy mode (no noise computed) picks the same tokens
    assert torch.equal(pick(z, "greedy", torch.zeros(1), torch.ones(1), seed, step, vh), got)
    with pytest.raises(ValueError, match="expected 'greedy', 'sample' or 'top_p'"):
        pick(z, "beam", torch.zeros(1), torch.ones(1), seed, step, vh)


def test_sampling_is_per_sequence_not_per_batch(tiny):
    """Sampled (temperature + top-p) tokens depend on the request's seed, not on the number of
    rows or its neighbours; another seed gives other tokens."""
    _, target = tiny
    outs = []
    for rows in (1, 4):
        gen = Generator(target, rows=rows, max_seq=64, max_new=12, sync_every=3)
        got, _ = _run(gen, [Request(k, p, 12, seed=100 + k) for k, p in enumerate(PROMPTS)],
                      temperature=1.0, top_p=0.9)
        outs.append({k: r.tokens for k, r in got.items()})
    assert outs[0] == outs[1]
    gen = Generator(target, rows=4, max_seq=64, max_new=12)
    other, _ = _run(gen, [Request(k, p, 12, seed=7) for k, p in enumerate(PROMPTS)],
                    temperature=1.0, top_p=0.9)
    assert {k: r.tokens for k, r in other.items()} != outs[0]


def test_pick_samples_the_softmax_and_respects_top_p():
    """Gumbel-max over the hash noise: empirical frequencies over 20k seeds match softmax(z/T);
    top-p never picks outside the nucleus."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    seed, step = torch.arange(n), torch.zeros(n, dtype=torch.long)
    from eagle3_runner.engine.generate import _mix
    vh = _mix(torch.arange(5))
    T = torch.tensor([0.8])
    got = pick(z.repeat(n, 1), "sample", T, torch.ones(1), seed, step, vh)
    freq = torch.bincount(got, minlength=5).float() / n
    torch.testing.assert_close(freq, torch.softmax(z / 0.8, -1), atol=0.015, rtol=0)
    nuc = pick(z.repeat(n, 1), "top_p", T, torch.tensor([0.8]), seed, step, vh)
    p = torch.softmax(z / 0.8, -1)  # 0.66, 0.19, 0.10, ...: the 0.8 nucleus = tokens 0 and 1
    assert set(nuc.tolist()) == {0, 1}
    assert abs((nuc == 0).float().mean() - p[0] / (p[0] + p[1])) < 0.015
    assert pick(z[None], "sample", torch.zeros(1), T, seed[:1], step[:1], vh).tolist() == [0]


def test_stops_caps_and_continuations(tiny):
    """A row stops at a stop id (kept as its last token) or its cap (max_new or the cache end);
    a follow-up from on_done continues in the same row on the cached prefix and equals a fresh
    run of the whole prompt."""
    hf, target = tiny
    ref = _hf_greedy(hf, PROMPTS[1], 20)
    stop = ref[5]
    gen = Generator(target, rows=2, max_seq=24, max_new=20)
    got, _ = _run(gen, [Request("a", PROMPTS[1], 20)], stop_ids=[stop])
    assert got["a"].tokens == ref[:ref.index(stop) + 1] and got["a"].finish == "stop"
    got, _ = _run(gen, [Request("a", PROMPTS[1], 3), Request("b", [1] * 20, 20)])
    assert got["a"].tokens == ref[:3] and got["a"].finish == "length"  # its max_new
    assert got["b"].finish == "length" and len(got["b"].tokens) == 24 - 20  # the cache end
    first = {}

    def follow(r):
        if r.key == "t1":
            first["t"] = r.tokens
            return Request("t2", PROMPTS[1] + r.tokens + [4, 5], 6)
        return None
    gen = Generator(target, rows=1, max_seq=64, max_new=8)
    res = {}
    st = gen.run([Request("t1", PROMPTS[1], 8)],
                 lambda rs: [(res.__setitem__(r.key, r), follow(r))[1] for r in rs])
    assert st["reused_tokens"] == len(PROMPTS[1]) + 7  # all but the last generated token
    fresh, _ = _run(Generator(target, rows=1, max_seq=64, max_new=8),
                    [Request("x", PROMPTS[1] + first["t"] + [4, 5], 6)])
    assert res["t2"].tokens == fresh["x"].tokens


def test_bad_requests_are_refused(tiny):
    _, target = tiny
    gen = Generator(target, rows=1, max_seq=16, max_new=4)
    with pytest.raises(ValueError, match="prompt of 16 tokens"):
        gen.run([Request("long", [1] * 16, 4)], lambda rs: None)
    with pytest.raises(ValueError, match="max_new 5"):
        gen.run([Request("wide", [1], 5)], lambda rs: None)
    with pytest.raises(ValueError, match="kernels"):
        Generator(target, rows=1, max_seq=16, max_new=4, kernels="flash")


def test_triton_decode_attention_switch_gives_the_same_tokens(tiny):
    """kernels="triton": the decode step's attention through kernels.attention.decode_attention
    (Triton's interpreter on CPU) makes the same greedy tokens as SDPA."""
    import os
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    _, target = tiny
    reqs = lambda: [Request(k, p, 6) for k, p in enumerate(PROMPTS[:3])]  # noqa: E731
    ref, _ = _run(Generator(target, rows=2, max_seq=32, max_new=6), reqs())
    got, _ = _run(Generator(target, rows=2, max_seq=32, max_new=6, kernels="triton"), reqs())
    assert {k: r.tokens for k, r in got.items()} == {k: r.tokens for k, r in ref.items()}


@pytest.mark.gpu
def test_cuda_graph_generator_matches_eager_on_gpu():
    """CUDA graphs (mode reduce-overhead, kv_len dynamic): the same greedy tokens as the eager
    generator, one dynamo graph per sampling mode whatever the buckets; sampled mode captures."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = from_hf_model(tiny_hf_llama(vocab=64, layers=2)).cuda()
    reqs = lambda: [Request(k, p, 40, seed=k) for k, p in enumerate(PROMPTS * 3)]  # noqa: E731
    eager, _ = _run(Generator(target, rows=4, max_seq=128, max_new=40, kv_bucket=16), reqs())
    gen = Generator(target, rows=4, max_seq=128, max_new=40, kv_bucket=16, cuda_graph=True)
    got, st = _run(gen, reqs())
    assert {k: r.tokens for k, r in got.items()} == {k: r.tokens for k, r in eager.items()}
    assert len(st["kv_lens"]) >= 3 and gen.graph_counts() == 1
    a, _ = _run(gen, reqs(), temperature=0.8, top_p=0.9)
    b, _ = _run(Generator(target, rows=4, max_seq=128, max_new=40, kv_bucket=16), reqs(),
                temperature=0.8, top_p=0.9)
    same = sum(a[k].tokens == b[k].tokens for k in a)
    assert same >= len(a) - 2 and gen.graph_counts() == 2  # greedy + top_p
    tri = Generator(target, rows=4, max_seq=128, max_new=40, kv_bucket=16, cuda_graph=True,
                    kernels="triton")  # TF32 dots on CUDA: allow a rare near-tie flip
    got, st = _run(tri, reqs())
    assert sum(got[k].tokens == eager[k].tokens for k in got) >= len(got) - 2
    assert st["kv_lens"] == [129] and tri.graph_counts() == 1  # the whole cache, one shape


def test_sdpa_prefill_equals_grouped_query_sdpa():
    """sdpa_prefill (K/V repeated to the query heads) = SDPA's own GQA with the same mask."""
    import torch.nn.functional as F
    from eagle3_runner.engine.generate import sdpa_prefill
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 5, 8, generator=g)
    k, v = torch.randn(3, 2, 12, 8, generator=g), torch.randn(3, 2, 12, 8, generator=g)
    mask = torch.rand(3, 1, 5, 12, generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(sdpa_prefill(q, k, v, mask), want)
    # heads are grouped as HF's repeat_kv groups them: query head h reads KV head h // 3
    k2 = k.clone()
    k2[:, 1] = torch.randn(3, 12, 8, generator=g)
    out = sdpa_prefill(q, k2, v, mask)
    torch.testing.assert_close(out[:, :3], want[:, :3])
    assert not torch.allclose(out[:, 3:], want[:, 3:])


@pytest.mark.gpu
def test_prefill_enqueues_without_a_stream_sync():
    """A refill prefill must not synchronise the stream (a pageable host-to-device copy does):
    the host has to enqueue it behind the decode steps it launched and go on with its own work.
    torch.cuda.set_sync_debug_mode("error") raises on any synchronising call inside _prefill."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = from_hf_model(tiny_hf_llama(vocab=64, layers=2)).cuda()
    gen = Generator(target, rows=4, max_seq=128, max_new=40, kv_bucket=16)
    gen.temperature.fill_(0.0)  # greedy, as run(temperature=0) sets it (the default is 1.0)
    entries = [(row, Request(row, p, 8, seed=row)) for row, p in enumerate(PROMPTS[:4])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        n = gen._prefill([(row, r, 0) for row, r in entries], "sample")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert n == sum(len(r.ids) for _, r in entries)
    want = {r.key: _hf_greedy(tiny_hf_llama(vocab=64, layers=2), r.ids, 1) for _, r in entries}
    assert gen.out[:4, 0].tolist() == [want[row][0] for row, _ in entries]


def test_on_done_gets_the_rows_of_a_sync_in_one_call_and_one_follow_up_each(tiny):
    """The rows finished at one host sync reach on_done together (the regenerate stage decodes and
    tokenises their next turns in one batched call), and a follow-up list of another length is
    refused."""
    _, target = tiny
    calls = []
    gen = Generator(target, rows=4, max_seq=64, max_new=4, sync_every=8)
    gen.run([Request(k, p, 4) for k, p in enumerate(PROMPTS[:4])],
            lambda rs: calls.append([r.key for r in rs]))
    assert sorted(calls[0]) == [0, 1, 2, 3]  # all four finish within the first 8 steps
    with pytest.raises(ValueError, match="one \\(a Request or None\\) per result"):
        gen.run([Request(k, p, 4) for k, p in enumerate(PROMPTS[:2])], lambda rs: [None])
