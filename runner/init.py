"""`runner init`: a commented, validated spec for YOUR target (and data), from the target's own
files only: config.json or a GGUF header (geometry) and the tokenizer files (chat template).
No weights are read and torch is never imported.

What it decides, and from what:
- aux layer ids and bench configurations: SGLang's defaults for the target's family
  (`family_defaults`, docs/eagle3-format.md sections 3 and 4).
- draft vocab size (`draft_vocab_size_for`): SpecForge's choice, 32000, for vocabularies of
  100k and more (Llama 3 128k, Qwen 152k, DeepSeek/Kimi 129k-164k, GPT-OSS 201k); 16000 for
  mid-size ones (32k-100k: SmolLM 49k, Mistral 33k-131k below 100k) and for small targets
  (hidden < 1024, e.g. Qwen2.5-0.5B: the draft head is Vd x hidden, the drafter's largest matrix
  and cost per draft step); the whole vocabulary when it is at most 16000.
- chat template: which `target.chat_template` value its template source names
  (runner/chat.py `template_family`); the stages render the template and check it.
- the offline feature size (`feature_estimate`): (3 aux + 1 last hidden) x hidden x 2 bytes
  (bf16) per token, times the tokens of the data file estimated as its uncompressed bytes / 4
  (an upper bound: JSON keys count too, long samples are cut at data.max_length).
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import sys
from pathlib import Path

from runner.chat import KNOWN, template_family
from runner.drafts.layout import AUX_COUNT, default_aux_ids, to_hf_indices
from runner.errors import InitError, TargetConfigError
from runner.files import atomic_write, expand_path
from runner.target_config import chat_template_source, read_target_config

BYTES_PER_TOKEN_CHARS = 4  # ~4 bytes of JSON text per token (ShareGPT + SmolLM2: 4.3)
LARGE_FEATURES = 200 * 2**30  # above this the spec suggests online training
SHARD_BYTES = 2**30  # aim for ~1 GiB shards (stages.extract.shard_samples)

# SGLang's auto speculative parameters (steps, topk, draft tokens) when none are given
# (server_args.py auto_choose_speculative_params, docs/eagle3-format.md section 4): (3, 1, 4)
# for the DeepSeek family (DeepSeek-V2/V3/V3.2, Kimi-K2), GLM-MoE and GPT-OSS; (5, 4, 8) for
# Llama and, as its fallback branch, every other architecture.
_CHAIN_FAMILIES = ("deepseek", "kimi", "glm4_moe", "glm4moe", "gpt_oss", "gptoss")


def family_defaults(cfg: dict) -> dict:
    """SGLang's defaults for the target's family: {"family", "aux_layer_ids", "bench":
    (num_steps, eagle_topk, num_draft_tokens)}. The one place init asks for SGLang family rules:
    aux ids come from runner/drafts/layout.py default_aux_ids (the same [1, L//2-1, L-4] for
    every family SGLang 0.5.x knows)."""
    arch = " ".join([str(cfg.get("model_type") or ""), *(cfg.get("architectures") or [])]).lower()
    chain = any(k in arch.replace("-", "_") for k in _CHAIN_FAMILIES)
    family = next((k for k in ("deepseek", "kimi", "glm4_moe", "gpt_oss", "qwen", "llama",
                               "mistral", "gemma") if k in arch), cfg.get("model_type") or "?")
    return {"family": family, "aux_layer_ids": default_aux_ids(cfg["num_hidden_layers"]),
            "bench": (3, 1, 4) if chain else (5, 4, 8)}


def draft_vocab_size_for(vocab: int, hidden: int) -> int:
    """The draft vocab size `runner init` proposes (module docstring: the rule and why)."""
    size = 32000 if vocab >= 100_000 else 16000
    if hidden < 1024:
        size = min(size, 16000)
    return min(size, vocab)


def _data_bytes(path: Path) -> tuple[int, str]:
    """(uncompressed bytes, how known) of a data file: gzip's size trailer, x4 for zstd."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == b"\x1f\x8b":
        with open(path, "rb") as f:
            f.seek(-4, 2)
            return max(int.from_bytes(f.read(4), "little"), size), "gzip size trailer"
    if head == b"\x28\xb5\x2f\xfd":
        return size * 4, "zstd file x 4 (ratio guessed)"
    return size, "file size"


def feature_estimate(hidden: int, data_path: Path | None, max_samples: int | None = None,
                     max_length: int = 2048) -> dict:
    """Offline extract size: {"bytes_per_token" ((3+1) x hidden x 2), "tokens" (data bytes /
    4, capped at max_samples x max_length), "bytes", "basis"}; tokens/bytes None when the
    data file is unknown or missing."""
    per_token = (AUX_COUNT + 1) * hidden * 2
    if data_path is None or not Path(data_path).is_file():
        return {"bytes_per_token": per_token, "tokens": None, "bytes": None,
                "basis": "no data file to measure"}
    nbytes, how = _data_bytes(Path(data_path))
    tokens = nbytes // BYTES_PER_TOKEN_CHARS
    if max_samples is not None:
        tokens = min(tokens, max_samples * max_length)
    return {"bytes_per_token": per_token, "tokens": tokens, "bytes": tokens * per_token,
            "basis": f"{Path(data_path).name}: {nbytes:,} bytes ({how}) / "
                     f"{BYTES_PER_TOKEN_CHARS} per token"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def plan_disk_note(spec) -> str | None:
    """One line for `runner plan`: the estimated offline feature size of the spec's extract
    (feature_estimate on data.path or the fetched ShareGPT), or None without an extract stage.
    Stats files only (no reading), so plan stays fast."""
    if spec.stages.extract is None:
        return None
    path = expand_path(spec.data.path) if spec.data.path else None
    if path is None and spec.data.source == "sharegpt":
        from runner.files import cache_dir
        path = next(cache_dir().glob("sharegpt/*.json"), None)
    est = feature_estimate(spec.target.hidden_size, path, spec.data.max_samples,
                           spec.data.max_length)
    per = human_bytes(est["bytes_per_token"])
    if est["bytes"] is None:
        return f"extract: {per} of features per token ({est['basis']})"
    work = spec.resolved_work_dir()
    probe = next((p for p in (work, *work.parents) if p.exists()), Path.cwd()).resolve()
    return (f"extract: ~{human_bytes(est['bytes'])} of offline features ({per} per token x "
            f"~{est['tokens']:,} tokens, from {est['basis']}); free at {probe}: "
            f"{human_bytes(shutil.disk_usage(probe).free)}")


def spec_name(target: Path) -> str:
    """<folder or file stem>-eagle3, reduced to the spec's name alphabet."""
    stem = target.stem if target.suffix == ".gguf" else target.name
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip(".-")[:48] or "target"
    return f"{stem.lower()}-eagle3"


def _q(s: str) -> str:
    """A YAML double-quoted scalar (JSON string syntax is valid YAML)."""
    return json.dumps(s)


def build(target: str, data: str | None = None, name: str | None = None) -> tuple[str, dict]:
    """(spec YAML text with comments, facts {name, family, aux_layer_ids, draft_vocab_size,
    chat_template, template_source, bench, estimate}). Raises InitError for an unreadable
    target or a missing data file."""
    tpath = expand_path(target).resolve()
    try:
        cfg = read_target_config(tpath)
    except FileNotFoundError:
        raise InitError(f"--target {target}: does not exist. Point it at the model's HF folder "
                        "(config.json + tokenizer files) or a .gguf file.") from None
    except TargetConfigError as e:
        raise InitError(f"--target {target}: {e}") from None
    need = ("num_hidden_layers", "hidden_size", "vocab_size")
    bad = [k for k in need if not isinstance(cfg.get(k), int) or cfg[k] < 1]
    if bad:
        raise InitError(f"--target {target}: its config has no usable {', '.join(bad)}, so no "
                        "drafter can be sized. Is it a decoder-only LLM's config.json?")
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    if L < 5:
        raise InitError(f"--target {target}: {L} layers; EAGLE-3 needs at least 5 (aux ids "
                        "[1, L//2-1, L-4] must be distinct).")
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or (H // heads if heads else None)
    ctx = cfg.get("max_position_embeddings")
    fam = family_defaults(cfg)
    aux = fam["aux_layer_ids"]
    vd = draft_vocab_size_for(V, H)
    text, where = chat_template_source(tpath)
    tmpl = template_family(text)
    dpath = expand_path(data).resolve() if data else None
    if dpath is not None and not dpath.is_file():
        raise InitError(f"--data {data}: {'is a folder' if dpath.is_dir() else 'does not exist'}"
                        "; point it at a JSONL or JSON file (plain, .gz or .zst).")
    if dpath is None:  # the fetched ShareGPT, when present
        from runner.files import cache_dir
        dfile = next(cache_dir().glob("sharegpt/*.json"), None)
    else:
        dfile = dpath
    max_length = min(2048, ctx or 2048)
    est = feature_estimate(H, dfile, None, max_length)
    name = name or spec_name(tpath)
    steps, topk, ndt = fam["bench"]
    mean_len = max(256, max_length // 2)
    shard = max(1, min(256, SHARD_BYTES // (mean_len * est["bytes_per_token"])))
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    from runner.stages import TrainStage
    has_online = "features" in TrainStage.model_fields
    large = est["bytes"] is not None and est["bytes"] > LARGE_FEATURES
    free = shutil.disk_usage(Path.cwd()).free
    lines = [
        f"# EAGLE-3 drafter for {tpath.name}, written by `runner init` on "
        f"{datetime.date.today().isoformat()}.",
        "# Check it: runner validate THIS.yaml; runner plan THIS.yaml. Every field: "
        "docs/spec-reference.md;",
        "# data formats and loss masks: docs/data.md.",
        f"name: {name}",
        "# work_dir: runs/${name}            # artifacts (extract features, checkpoints, the "
        "draft)",
        "target:",
        f"  path: {_q(str(tpath))}",
        f"  # its config: {arch}, {L} layers, hidden {H}, vocab {V:,}, context {ctx}",
    ]
    src = where.removeprefix(str(tpath) + "/")
    if tmpl:
        lines.append(f"  chat_template: {tmpl:<11} # {src}: assistant turns open with "
                     f"{KNOWN[tmpl][0]!r}")
    elif text:
        lines.append(f"  chat_template: auto        # {src}: not a known convention; the "
                     "stages derive it")
    else:
        lines.append(f"  chat_template: auto        # NO chat template ({src}): extract will "
                     "refuse; add one")
    lines += [
        "  dtype: auto                # bfloat16 on CUDA, float32 on CPU",
        "drafter:",
        "  algorithm: EAGLE3          # exactly this string: 'EAGLE' disables aux capture",
        f"  aux_layer_ids: {aux}   # SGLang's default for {fam['family']} (L={L}) = HF "
        f"hidden_states {to_hf_indices(aux)}",
        f"  draft_vocab_size: {vd}     # most frequent assistant tokens of {V:,}: 32000 for "
        "V >= 100k, else 16000",
        f"  # geometry = the target's: hidden {H}, {heads} heads, {kv} KV heads, head_dim {hd}, "
        f"intermediate {cfg.get('intermediate_size')}",
        f"  # -> fc [{H}, {AUX_COUNT * H}], lm_head [{vd}, {H}]; override any of them here",
        "data:",
    ]
    if dpath:
        lines += ["  source: jsonl              # JSONL or a JSON array, plain/.gz/.zst; ShareGPT "
                  "or OpenAI messages", f"  path: {_q(str(dpath))}"]
    else:
        lines += ["  source: sharegpt           # `runner fetch sharegpt`; yours: source: jsonl "
                  "+ path: FILE"]
    lines += [
        f"  max_length: {max_length}           # tokens per sample (longer ones are cut)",
        "  # max_samples: 10000        # conversations to train on (null = all)",
        "  holdout: 0                 # > 0: held out for the `sharegpt` bench prompt set",
        "  max_bad_fraction: 0.01     # fail above 1% unusable records (docs/data.md)",
        "stages:",
        "  # regenerate: {max_new_tokens: 1024}   # EAGLE-3's recipe: train on the target's own "
        "answers",
        "  extract:",
        "    batch_tokens: 16384",
        f"    shard_samples: {shard}         # ~1 GiB shards at {mean_len} tokens per sample",
    ]
    size = (f"~{est['tokens']:,} tokens -> ~{human_bytes(est['bytes'])} under work_dir"
            if est["bytes"] is not None else f"({est['basis']})")
    lines += [
        f"  # Offline features: (3 aux + 1 last) x {H} x 2 bytes = "
        f"{human_bytes(est['bytes_per_token'])} per token;",
        f"  # {size} (free here: {human_bytes(free)}).",
        f"  # Tokens estimated from {est['basis']}." if est["bytes"] is not None else "",
    ]
    if large and has_online:
        lines.append("  # That is large: train online instead (features computed on the fly).")
    elif large:
        lines.append("  # That is large: cap data.max_samples, or train online once the spec "
                     "has it (stages.train.features: online).")
    lines += [
        "  train:",
        "    ttt_steps: 7               # SpecForge / EAGLE-3: 7 unrolled draft steps",
        "    epochs: 1",
        "    batch_size: 4",
        "    lr: 1.0e-4",
    ]
    if has_online:
        lines.append(f"    features: {'online' if large else 'offline'}")
    lines += [
        "  export: {}",
        "  bench:",
        "    backend: sglang            # real servers; embedded = our engine (Llama, chains)",
        "    prompt_sets: [mtbench]",
        "    max_new_tokens: [256]",
        "    configs:",
        f"      - {{num_steps: {steps}, eagle_topk: {topk}, num_draft_tokens: {ndt}}}  # SGLang's "
        f"auto choice for {arch}",
    ]
    if topk != 1:
        lines.append(f"      - {{num_steps: {steps}, eagle_topk: 1}}   # a chain, for comparison")
    lines += [
        "executor: {kind: local}",
        "# Slurm: apply from a login node; work_dir and results on a shared filesystem:",
        "# executor: {kind: slurm, partition: gpu, gpus_per_node: 8, nproc_per_node: 8,",
        "#            cpus_per_task: 8, mem_gb: 512, timeout_min: 1440}",
        "# results: {path: runs/results.duckdb}",
    ]
    facts = {"name": name, "target": str(tpath), "family": fam["family"], "architecture": arch,
             "num_hidden_layers": L, "hidden_size": H, "vocab_size": V, "aux_layer_ids": aux,
             "draft_vocab_size": vd, "chat_template": tmpl or "auto",
             "template_source": where if text else None,
             "bench": {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": ndt},
             "estimate": est, "data": str(dpath) if dpath else None}
    return "\n".join(x for x in lines if x) + "\n", facts


def _check(text: str) -> None:
    """The written spec must validate (a failure here is a bug in init: it says so)."""
    import yaml

    from runner.errors import SpecError
    from runner.spec.load import load_spec
    try:
        load_spec(data=yaml.safe_load(text))
    except SpecError as e:
        raise InitError("the spec init wrote does not validate (a bug in runner init; please "
                        f"report it): {e}") from None


def init_cli(target: str, data: str | None, out: str | None, name: str | None,
             as_json: bool, force: bool) -> int:
    """`runner init`: write (or print) the spec; a summary goes to stderr. Returns 0."""
    text, facts = build(target, data, name)
    _check(text)
    if out:
        o = expand_path(out)
        if o.exists() and not force:
            raise InitError(f"--out {out}: exists; pass --force to overwrite it, or choose "
                            "another name.")
        o.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(o, text)
        facts["spec"] = str(o)
    if as_json:
        print(json.dumps({**facts, "spec_text": text if not out else None}, indent=1))
    elif not out:
        print(text, end="")
    est = facts["estimate"]
    msg = [f"init: {facts['architecture']} ({facts['family']}), L={facts['num_hidden_layers']}, "
           f"H={facts['hidden_size']}, V={facts['vocab_size']:,}: aux ids "
           f"{facts['aux_layer_ids']}, draft vocab {facts['draft_vocab_size']}, chat template "
           f"{facts['chat_template']}, bench {facts['bench']}"]
    if est["bytes"] is not None:
        msg.append(f"init: offline features ~{human_bytes(est['bytes'])} "
                   f"({human_bytes(est['bytes_per_token'])} per token x ~{est['tokens']:,} "
                   "tokens)")
    if not facts["template_source"]:
        msg.append("init: warning: no chat template found; extract needs one")
    if out:
        msg.append(f"init: wrote {out}; next: runner validate {out} && runner plan {out}")
    print("\n".join(msg), file=sys.stderr)
    return 0

