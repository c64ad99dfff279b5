"""TTT (training-time test) attention of the EAGLE-3 drafter: the PyTorch reference and its fast
paths, with document masking for packed rows.

The mask (SpecForge 0.2.0 convention, specforge/modeling/draft/flex_attention.py
generate_eagle3_mask; docs/eagle3-format.md): at TTT step j the query at position i attends
- the keys of step 0 at positions p <= i of the SAME sample (causal; packed rows hold several
  samples, and a query never sees another sample's keys), and
- the keys of steps 1..j at position i only (the diagonal).
A packed row is described by `Segments`: start[b, i] / end[b, i] = the first position / one past
the last position of the sample that position i belongs to (samples are contiguous).

Paths (`attend(impl)` returns `f(q, ks, vs, seg) -> o`):
- "torch": `ttt_attention` of models/draft_model.py, the reference: the T x T float32 score matrix
  per step (the drafter's own attention; the kernels sit above the model they speed up).
- "flex":  torch flex_attention over the concatenated keys [K_0; K_1; ...; K_j] with a BlockMask
  (what SpecForge does); fast only inside torch.compile on CUDA. Its CPU path has no backward.
- "triton": kernels/ttt_attention_triton.py, a flash kernel (forward + backward) that walks the
  step-0 keys block by block and adds the diagonal keys per row; no score matrix, no mask object.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from eagle3_runner.models.draft_model import ttt_attention  # the reference: the model's own


class Segments(NamedTuple):
    """Sample boundaries of packed rows: start, end [B, T] int32 (see the module docstring)."""
    start: torch.Tensor
    end: torch.Tensor

    @classmethod
    def single(cls, B: int, T: int, device=None) -> "Segments":
        """One sample per row spanning all T positions (plain causal TTT attention)."""
        z = torch.zeros(B, T, dtype=torch.int32, device=device)
        return cls(z, z + T)


def dense_mask(seg: Segments) -> torch.Tensor:
    """[B, 1, T, T] bool (True = attend): causal within each sample, for `ttt_attention`."""
    T = seg.start.shape[1]
    p = torch.arange(T, device=seg.start.device)
    return ((p[None, None, :] <= p[None, :, None])
            & (p[None, None, :] >= seg.start[:, :, None]))[:, None]


def flex_block_mask(seg: Segments, steps: int):
    """The flex BlockMask of TTT step `steps - 1`: queries [T] x keys [steps * T] (key kv is
    position kv % T of step kv // T), causal within the sample for step 0, diagonal after."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = seg.start.shape
    start = seg.start

    def mask_mod(b, h, q, kv):
        s, p = kv // T, kv % T
        return ((s == 0) & (p <= q) & (p >= start[b, q])) | ((s > 0) & (p == q))

    return create_block_mask(mask_mod, B, None, T, steps * T, device=start.device)


def ttt_attention_flex(q, ks: list, vs: list, seg: Segments) -> torch.Tensor:
    """TTT attention through flex_attention (shapes as `ttt_attention`; seg: Segments [B, T]).
    Compile the caller on CUDA: eager flex materialises the scores, and on the CPU it has no
    backward (torch raises)."""
    from torch.nn.attention.flex_attention import flex_attention
    bm = flex_block_mask(seg, len(ks))
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])


def attend(impl: str) -> Callable:
    """The TTT attention f(q, ks, vs, seg: Segments) -> o of `impl` ("torch", "flex", "triton").
    Raises ValueError naming the choices for anything else."""
    if impl == "torch":
        return lambda q, ks, vs, seg: ttt_attention(q, ks, vs, dense_mask(seg))
    if impl == "flex":
        return ttt_attention_flex
    if impl == "triton":
        from eagle3_runner.kernels.ttt_attention_triton import ttt_attention_triton
        return ttt_attention_triton
    raise ValueError(f"attention impl {impl!r}: choose 'torch', 'flex' or 'triton'")
