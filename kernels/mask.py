"""The attention mask of new query rows over a static KV cache, as a dense boolean tensor: the
decode-attention contract (kernels/attention.py) for SDPA. No Triton: the torch paths (the
models' own forward, engine/tree.py's drafter tree steps) use it on machines without Triton.

    dense_mask(prefix_len [B] int, tree_mask [Q, R] bool or None, W, S) -> [B, 1, Q, S] bool

Query row q of batch row b attends every slot < prefix_len[b], plus slot prefix_len[b] + r iff
tree_mask[q, r] (r < R). None = causal over W rows (Q = R = W, row w attends new slots <= w:
decode and chain verify, models/llama.py's default mask). The verify and the fused kernels use
square masks (Q = R = W, the tree's own rows); the drafter's tree steps use Q = eagle_topk
frontier rows over the R = (num_steps - 1) * eagle_topk tree slots after the root.
"""

from __future__ import annotations

from typing import Optional

import torch


def dense_mask(prefix_len: torch.Tensor, tree_mask: Optional[torch.Tensor], W: int,
               S: int) -> torch.Tensor:
    """See the module docstring (True = attend). W is the row count of the causal case (ignored
    with a tree_mask); S the cache slots. Only tensor ops on device tensors: no host sync, one
    shape per (B, Q, R, S), so it sits inside compiled graphs."""
    dev = prefix_len.device
    rel = torch.arange(S, device=dev)[None, :] - prefix_len.long()[:, None]  # [B, S]; < 0: prefix
    if tree_mask is None:
        return (rel[:, None, :] <= torch.arange(W, device=dev)[None, :, None])[:, None]
    Q, R = tree_mask.shape
    tm = tree_mask.to(device=dev, dtype=torch.bool)
    hit = tm[None].expand(rel.shape[0], -1, -1).gather(
        2, rel.clamp(0, R - 1)[:, None, :].expand(-1, Q, -1))  # [B, Q, S]: tm[q, rel]
    return ((rel < 0)[:, None, :] | ((rel < R)[:, None, :] & hit))[:, None]
