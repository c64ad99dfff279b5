"""The optional regenerate stage: replace assistant turns with the target's own responses.

EAGLE-3's recipe: a drafter trained on what the target itself says is accepted more often than
one trained on another model's answers. For every training conversation (jobs.data; the holdout
is never touched), turn by turn, the prompt is the conversation so far (with the already
regenerated replies) rendered by the tokenizer's chat template with the generation prompt; the
target's reply (greedy when temperature is 0, else temperature/top-p sampling, seeded) replaces
the original assistant turn. Conversations at the same turn are batched (left padding), sorted
by prompt length so that a batch pads little.

A conversation stops at the turn where its prompt alone exceeds data.max_length (extraction
would truncate everything after it anyway) or where the target answers with nothing; the
remaining turns are dropped and counted. Output: ctx.out_dir/conversations.jsonl
({"messages": [{"role", "content"}]} per line, read by the extract stage) and report.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from runner.errors import StageError
from runner.files import atomic_path, atomic_write
from runner.stage import StageContext


@torch.inference_mode()
def generate_batch(model, tok, prompts: list[list[dict]], max_new_tokens: int,
                   temperature: float, top_p: float) -> tuple[list[str], int]:
    """One reply per prompt conversation. Returns (texts, generated token count)."""
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts]
    side, pad = tok.padding_side, tok.pad_token
    tok.padding_side = "left"
    if pad is None:  # e.g. a GGUF tokenizer: pad with EOS (masked out by the attention mask)
        tok.pad_token = tok.eos_token
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        pad_id = tok.pad_token_id
    finally:
        tok.padding_side, tok.pad_token = side, pad
    dev = next(model.parameters()).device
    enc = {k: v.to(dev) for k, v in enc.items()}
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
              eos_token_id=tok.eos_token_id)
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(**enc, **kw)[:, enc["input_ids"].shape[1]:]  # [B, new]
    replies, n = [], 0
    for row in out.tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id) + 1]
        n += len(row)
        replies.append(tok.decode(row, skip_special_tokens=True).strip())
    return replies, n


def regenerate(model, tok, convs: list[list[dict]], params, max_length: int,
               progress: bool = True) -> tuple[list[list[dict]], dict]:
    """Regenerate every assistant turn of `convs` (batched across conversations per turn).

    Returns (new conversations, report {"turns", "tokens_generated", "cut_prompt_too_long",
    "cut_empty_reply", "cut_max_turns" (user turns dropped by params.max_turns),
    "dropped_conversations", "seconds"})."""
    from tqdm import tqdm
    if not getattr(tok, "chat_template", None):
        raise StageError("the target tokenizer has no chat template; regenerate needs one")
    torch.manual_seed(params.seed)
    out = [[t for t in c if t["role"] == "system"][:1] for c in convs]
    user_turns = [[t for t in c if t["role"] == "user"] for c in convs]
    rep = {"turns": 0, "tokens_generated": 0, "cut_prompt_too_long": 0, "cut_empty_reply": 0,
           "cut_max_turns": 0}
    if params.max_turns is not None:
        rep["cut_max_turns"] = sum(max(0, len(u) - params.max_turns) for u in user_turns)
        user_turns = [u[:params.max_turns] for u in user_turns]
    alive = [True] * len(convs)
    bar = tqdm(total=sum(len(u) for u in user_turns), unit="turn", desc="regenerate",
               disable=not progress)
    t0 = time.perf_counter()
    for turn in range(max((len(u) for u in user_turns), default=0)):
        todo = []
        for i, u in enumerate(user_turns):
            if not alive[i] or turn >= len(u):
                continue
            prompt = out[i] + [u[turn]]
            n = len(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"])
            if n >= max_length:
                alive[i] = False
                rep["cut_prompt_too_long"] += 1
                bar.update(len(u) - turn)
                continue
            todo.append((n, i))
        todo = [i for _n, i in sorted(todo)]  # batch similar prompt lengths: less left padding
        for b in range(0, len(todo), params.batch_size):
            idx = todo[b:b + params.batch_size]
            replies, n = generate_batch(model, tok, [out[i] + [user_turns[i][turn]] for i in idx],
                                        params.max_new_tokens, params.temperature, params.top_p)
            rep["tokens_generated"] += n
            for i, r in zip(idx, replies):
                if not r:
                    alive[i] = False
                    rep["cut_empty_reply"] += 1
                    bar.update(len(user_turns[i]) - turn)
                    continue
                out[i] += [user_turns[i][turn], {"role": "assistant", "content": r}]
                rep["turns"] += 1
                bar.update(1)
    bar.close()
    rep["seconds"] = time.perf_counter() - t0
    kept = [c for c in out if any(t["role"] == "assistant" for t in c)]
    rep["dropped_conversations"] = len(out) - len(kept)
    return kept, rep


def run(ctx: StageContext) -> dict:
    """Regenerate the spec's training conversations into ctx.out_dir/conversations.jsonl."""
    from jobs.data import load_conversations, show_data_report
    from jobs.target import load_target
    spec, p, out = ctx.spec, ctx.params, Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, _holdout, data_report = load_conversations(spec.data)
    model, tok, _cfg = load_target(spec)
    convs, rep = regenerate(model, tok, train, p, spec.data.max_length)
    if not convs:
        raise StageError(f"regenerate: no conversation kept ({rep}); raise data.max_length "
                         "(prompts longer than it are cut) or check the target")
    with atomic_path(out / "conversations.jsonl") as tmp, open(tmp, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
    atomic_write(out / "report.json",
                      json.dumps({"data": data_report, "regenerate": rep}, indent=1, default=str))
    secs = max(rep["seconds"], 1e-9)
    show_data_report(ctx, data_report)
    return {"conversations": len(convs), "turns": rep["turns"],
            "tokens_generated": (rep["tokens_generated"], "tok"),
            "tokens_per_s": (rep["tokens_generated"] / secs, "tok/s"),
            "cut_prompt_too_long": rep["cut_prompt_too_long"],
            "cut_empty_reply": rep["cut_empty_reply"], "cut_max_turns": rep["cut_max_turns"]}
