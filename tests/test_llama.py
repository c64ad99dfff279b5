"""models/llama.py: per-row positions and slots (batched generation, tree verify) against the
shared-position forward it generalises."""

import torch

from eagle3_runner.models.llama import Llama, LlamaConfig


def _tiny(seed=0) -> Llama:
    torch.manual_seed(seed)
    c = LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=64)
    m = Llama(c, (0, 1)).eval().requires_grad_(False)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_rows_at_different_lengths_match_separate_runs():
    """Row b decodes from its own length: 2-D positions/slots give each row's own logits."""
    m = _tiny()
    ids = torch.randint(0, 97, (2, 8))
    lens = [3, 6]
    want = []
    for b, n in enumerate(lens):  # reference: each row alone, shared positions
        m.setup_cache(1, 32)
        m(ids[b:b + 1, :n], torch.arange(n))
        want.append(m(ids[b:b + 1, n:n + 1], torch.tensor([n]))[0][0, 0])
    m.setup_cache(2, 32)
    # prefill both rows to their lengths with per-row slots: row 0 writes 0..2, row 1 0..5
    pos = torch.tensor([[0, 1, 2, 2, 2, 2], [0, 1, 2, 3, 4, 5]])
    toks = torch.stack([torch.cat([ids[0, :3], ids[0, 2:3].repeat(3)]), ids[1, :6]])
    m(toks, pos)  # row 0 rewrites slot 2 with the same token at the same position: harmless
    got = m(torch.stack([ids[0, 3:4], ids[1, 6:7]]), torch.tensor([[3], [6]]))[0][:, 0]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_explicit_slots_and_mask_equal_the_default():
    """slots == positions and the causal mask given explicitly reproduce the default path."""
    m = _tiny(1)
    ids = torch.randint(0, 97, (1, 5))
    m.setup_cache(1, 16)
    a, _ = m(ids, torch.arange(5))
    m.setup_cache(1, 16)
    pos = torch.arange(5)
    mask = (torch.arange(16)[None, :] <= pos[:, None])[None, None]
    b, _ = m(ids, pos, slots=pos, mask=mask)
    torch.testing.assert_close(a, b)
