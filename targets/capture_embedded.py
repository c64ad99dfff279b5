"""The online capture on our own Llama (models/llama.py) instead of the HF forward: the same
features as targets/capture.py `capture`, for a Llama-architecture target on one device
(stages.train.online_capture: embedded).

How it differs from `capture` (why it is faster on a GPU):
- no padding: the batch's samples are packed end to end into ONE row of N = sum of their
  lengths; RoPE positions restart at each sample and attention is causal within each sample
  (kernels/ttt_attention.py's segment mask, with one step: `Segments` start/end per position),
  where `capture` runs right-padded groups (trainer/sources.py length_groups);
- each decoder layer is one torch.compile graph, and all layers share it (regional
  compilation: the layers have the same code and shapes, and torch >= 2.5 inlines nn.Module
  calls with their parameters as graph inputs), symbolic in N from the first batch on
  (dynamic=True), so RMSNorm, RoPE, SiLU and the residual adds are fused kernels instead of
  HF's ~20 eager kernels per layer;
- the host inputs (ids, positions, segment bounds) travel as one pinned copy, without a host
  sync (targets/capture.py `h2d`);
- nothing but the aux layers' outputs and the last layer's output is kept (no final norm, no
  LM head, as `capture`).

Values: aux = the outputs of decoder layers `aux_ids` (ascending, concatenated), last = the last
decoder layer's output before the final norm (SGLang convention, targets/capture.py docstring),
per sample equal to `capture`'s up to float summation order (tests/test_capture_embedded.py).
Attention on CUDA: the Triton kernel (kernels/ttt_attention_triton.py, forward only); on the
CPU: the PyTorch reference, which holds an N x N score matrix (tests and small batches only).
"""

from __future__ import annotations

import torch

from eagle3_runner.kernels.ttt_attention import Segments, attend
from eagle3_runner.models.draft_model import rope_cos_sin
from eagle3_runner.models.llama import from_hf_model
from eagle3_runner.runner.errors import StageError
from eagle3_runner.targets.capture import h2d, pin_for

FIELD = "stages.train.online_capture"


_SEGMENT_ATTENTION: dict = {}


def segment_attention(impl: str):
    """Causal attention within each sample of a packed row, f(q [1, nh, N, hd], k/v [1, nkv, N,
    hd], seg: Segments start/end [1, N] int32) -> [1, nh, N, hd]: kernels/ttt_attention.py's TTT
    attention of `impl` ("triton" | "torch") with its step 0 only. One function object per impl
    (the compiled layer's guard on its attn argument holds across captures)."""
    if impl not in _SEGMENT_ATTENTION:
        fn = attend(impl)
        _SEGMENT_ATTENTION[impl] = lambda q, k, v, seg: fn(q, [k], [v], seg)
    return _SEGMENT_ATTENTION[impl]


def _layer(layer, x, cos, sin, seg, attn):
    """One decoder layer (models/llama.py Block) without a KV cache: x [1, N, H] -> [1, N, H]."""
    return layer(x, cos, sin, seg, None, attn=attn)


class EmbeddedCapture:
    """The target's decoder as our Llama, sharing the HF model's weights (no copy), ready to
    capture packed batches. compile: the torch.compile backend of the layer ("auto" = inductor
    on CUDA, eager on the CPU; None = eager); attn: "triton" or "torch" ("auto" = triton on
    CUDA, the reference on the CPU).
    Raises StageError (naming stages.train.online_capture) for a target that is not a plain
    Llama or not on one device."""

    def __init__(self, model, aux_ids: list[int], compile: str | None = "auto",
                 attn: str = "auto"):
        devs = {p.device for p in model.parameters()}
        if len(devs) != 1 or next(iter(devs)).type == "meta":
            raise StageError(f"{FIELD} = embedded needs the whole target on one device; it is "
                             f"on {sorted(map(str, devs))} (target.device_map). Set {FIELD}: "
                             "hf for a split target.")
        try:
            self.llama = from_hf_model(model, aux_ids)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise StageError(f"{FIELD} = embedded runs the target as a plain Llama, and this one "
                             f"is not ({e}). Set {FIELD}: hf.") from None
        self.device = next(iter(devs))
        self.aux_ids = self.llama.aux_ids
        cuda = self.device.type == "cuda"
        if compile == "auto":
            compile = "inductor" if cuda else None
        self.attn = segment_attention(("triton" if cuda else "torch") if attn == "auto"
                                      else attn)
        self.layer = torch.compile(_layer, backend=compile, dynamic=True) if compile else _layer

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """batch: n token lists (each >= 1 token). Returns (aux [N, len(aux_ids)*H],
        last [N, H], offsets [n+1]): sample i's features are rows offsets[i]:offsets[i+1], in
        the model's dtype on its device (inference tensors: copy them before autograd saves
        them). Raises ValueError for an empty sample."""
        lens = [len(x) for x in batch]
        if min(lens, default=0) < 1:
            raise ValueError("capture_embedded: every sample needs at least one token")
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        host = torch.empty(4, offs[-1], dtype=torch.int64,  # ids, positions, start, end
                           pin_memory=pin_for(self.device))
        host[0] = torch.tensor([t for x in batch for t in x], dtype=torch.int64)
        host[1] = torch.cat([torch.arange(n) for n in lens])
        host[2] = torch.repeat_interleave(torch.tensor(offs[:-1]), torch.tensor(lens))
        host[3] = host[2] + torch.repeat_interleave(torch.tensor(lens), torch.tensor(lens))
        ids, pos, start, end = h2d(host, self.device)
        c = self.llama.config
        seg = Segments(start[None].int(), end[None].int())
        cos, sin = rope_cos_sin(pos[None], c.head_dim, c.rope_theta, c.rope_scaling)
        x = self.llama.embed_tokens(ids[None])  # [1, N, H]
        aux = []
        for i, layer in enumerate(self.llama.layers):
            x = self.layer(layer, x, cos, sin, seg, self.attn)
            if i in self.aux_ids:
                aux.append(x)
        return torch.cat(aux, dim=-1)[0], x[0], offs
