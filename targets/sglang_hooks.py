"""The capture inside an SGLang server process: forward hooks on SGLang's own model object, so a
plain (non-speculative) server returns, per prompt position, the drafter's aux hidden states AND
the last decoder layer's output before the final norm, without an edit of SGLang. Imported only by
targets/sglang_models/capture.py, which runs in the server (torch, no sglang import here, so the
hooks are testable on their own: tests/test_sglang_target.py).

How (SGLang 0.5.14, read in sglang/srt/models/llama.py, deepseek_v2.py, kimi_k25.py and
layers/logits_processor.py):
- aux: `set_eagle3_layers_to_capture(ids)`, the method SGLang itself calls on the target when it
  serves an EAGLE-3 drafter with these eagle_config ids, so each family's id rule applies as in
  serving (runner/drafts/rules.py): the model then hands `aux_hidden_states`, a list of the
  residual streams entering layers ids+1 (= the outputs of layers ids, HF hidden_states[k+1]), to
  its logits processor, as its 5th positional argument (after input_ids, hidden_states, lm_head,
  forward_batch).
- last: the final norm is called as norm(hidden, residual) and returns (normed, hidden +
  residual): the second item is the last layer's output before the norm, which our features
  store as `last_hidden` (targets/capture.py: training applies the target's norm and lm_head to
  it). Called without a residual, the input itself is it. A forward hook on the norm keeps it; a
  forward pre-hook on the logits processor appends it to the aux list.
- the logits processor concatenates that list along the hidden dimension for a request that asked
  for hidden states (`_get_hidden_states_to_store`, FULL capture mode): [aux_0 | .. | last] rows;
  logits are still computed from the normed hidden, so the generated token is unchanged.
- the file transport (`Sink`): in a prefill (extend) forward, the rows of each request whose rid
  starts with RID_PREFIX (ForwardBatch.rids, extend_seq_lens_cpu) are copied to pinned host memory
  without a sync and written by a thread as SINK/<rid>.bin (raw bf16 [tokens, width]; written
  to .tmp-<rid> and renamed), by one rank (tensor-parallel rank 0: every rank holds the whole
  hidden state under plain tensor parallelism). A request whose prefill is not whole (a prefix
  cache hit, a chunked prefill) gets SINK/<rid>.err instead of wrong rows.
Kimi-K2.5 / DeepSeek-V3 (deepseek_v2.py): the same calls, `logits_processor` and `model.norm` on
the DeepseekV3ForCausalLM inside KimiK25ForConditionalGeneration (found by `logits_owner`); under
DP attention or context parallelism the final hidden state is scattered over ranks and these
rows would be one rank's share: those modes are not supported (plain tp/ep only).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3_runner.targets.sglang_target import RID_PREFIX


def logits_owner(model):
    """The module that calls the logits processor and owns the decoder (`.logits_processor` and
    `.model.norm`): the model itself (Llama, DeepSeek), or the language model of a multimodal
    wrapper (Kimi-K2.5's `language_model`). Raises ValueError when there is none."""
    todo, seen = [model], set()
    while todo:
        m = todo.pop(0)
        if id(m) in seen:
            continue
        seen.add(id(m))
        if hasattr(m, "logits_processor") and hasattr(getattr(m, "model", None), "norm"):
            return m
        todo += [c for c in (getattr(m, "language_model", None), getattr(m, "model", None))
                 if c is not None]
    raise ValueError(f"{type(model).__name__}: no submodule with logits_processor and "
                     "model.norm; the capture hooks support Llama- and DeepSeek-style SGLang "
                     "models")


class Sink:
    """The file transport's writer (module docstring): `put(forward_batch, rows)` in the
    forward, files written by `workers` threads. folder: where the files go."""

    def __init__(self, folder: str | Path, workers: int = 4):
        self.folder = Path(folder)
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.lock = threading.Lock()

    @staticmethod
    def wants(fb) -> bool:
        """Whether forward batch `fb` is a prefill (extend) holding a capture request."""
        mode = getattr(fb, "forward_mode", None)
        return mode is not None and mode.is_extend() and any(
            str(r).startswith(RID_PREFIX) for r in getattr(fb, "rids", None) or [])

    def put(self, fb, rows: torch.Tensor) -> None:
        """rows [tokens of the forward, width] of a forward that `wants`: split per request."""
        rids = fb.rids
        lens = list(fb.extend_seq_lens_cpu)
        starts = list(getattr(fb, "extend_prefix_lens_cpu", None) or [0] * len(lens))
        off = 0
        for rid, n, start in zip(rids, lens, starts):
            n, start = int(n), int(start)
            if str(rid).startswith(RID_PREFIX):
                if start:
                    self._error(rid, f"its prefill starts at position {start}, not 0 (a prefix "
                                     "cache hit or a chunked prefill): start the server with "
                                     "--disable-radix-cache --chunked-prefill-size -1")
                else:
                    self._write(rid, rows[off:off + n])
            off += n

    def _write(self, rid: str, rows: torch.Tensor) -> None:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
        host.copy_(rows, non_blocking=rows.is_cuda)  # ordered before any later reuse of `rows`
        ready = None
        if rows.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.pool.submit(self._flush, rid, host, ready)

    def _flush(self, rid: str, host: torch.Tensor, ready) -> None:
        if ready is not None:
            ready.synchronize()
        tmp, dest = self.folder / f".tmp-{rid}", self.folder / f"{rid}.bin"
        host.view(torch.int16).numpy().tofile(tmp)
        os.replace(tmp, dest)

    def _error(self, rid: str, message: str) -> None:
        (self.folder / f"{rid}.err").write_text(message)


def install_capture(model, layer_ids: list[int] | None, sink: Sink | None = None) -> None:
    """Make `model` (an SGLang *ForCausalLM, built, before CUDA-graph capture) capture
    [aux at `layer_ids` (eagle_config convention) | last before the final norm] rows (module
    docstring); `sink`: also write them for the file transport (give it on one rank only).
    Raises ValueError when the model lacks the parts the hooks need."""
    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise ValueError(f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang "
                         "cannot capture its aux layers")
    model.set_eagle3_layers_to_capture(layer_ids)
    owner = logits_owner(model)
    stash: dict = {}

    def keep_last(_m, args, out):
        stash["last"] = out[1] if isinstance(out, tuple) else args[0]

    def add_last(_m, args, kwargs):
        in_kw = "aux_hidden_states" in kwargs
        aux = kwargs["aux_hidden_states"] if in_kw else (args[4] if len(args) > 4 else None)
        last = stash.pop("last", None)
        if aux is None or last is None:
            return None
        rows = list(aux) + [last]
        fb = kwargs.get("logits_metadata", args[3] if len(args) > 3 else None)
        if sink is not None and sink.wants(fb):
            sink.put(fb, torch.cat(rows, dim=-1))
        if in_kw:
            return args, {**kwargs, "aux_hidden_states": rows}
        return args[:4] + (rows,) + args[5:], kwargs

    owner.model.norm.register_forward_hook(keep_last)
    owner.logits_processor.register_forward_pre_hook(add_last, with_kwargs=True)
