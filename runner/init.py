"""`runner init`: a commented, validated spec for YOUR target (and data), from the target's own
files only: config.json or a GGUF header (geometry) and the tokenizer files (chat template).
No weights are read and torch is never imported.

What it decides, and from what:
- aux layer ids: SGLang's default for the target's layer-id family (runner/drafts/families.py
  `target_family`, runner/drafts/checks.py `default_aux_ids`; docs/eagle3-format.md section 3).
- bench configurations: the parameters SGLang auto-chooses for the target's architecture
  (runner/drafts/server.py `auto_speculative_params`, section 4), and for a tree a chain of the
  same depth to compare with (its draft tokens by runner/drafts/checks.py `chain_draft_tokens`).
- draft vocab size (`draft_vocab_size_for`): SpecForge's choice, 32000, for vocabularies of
  100k and more (Llama 3 128k, Qwen 152k, DeepSeek/Kimi 129k-164k, GPT-OSS 201k); 16000 for
  mid-size ones (32k-100k: SmolLM 49k, Mistral 33k-131k below 100k) and for small targets
  (hidden < 1024, e.g. Qwen2.5-0.5B: the draft head is Vd x hidden, the drafter's largest matrix
  and cost per draft step); the whole vocabulary when it is at most 16000. With --data, never
  more than the distinct supervised (assistant) tokens the data holds: a larger head is padded
  with ids no sample ever targets (trainer/vocab.py).
- the data (--data): targets/survey.py, run as a child process (it loads the target's tokenizer
  with transformers; this module stays torch-free), reads the file with the stages' own reader
  and cleaner and counts what they would drop, then tokenizes it with the target's chat
  template and loss mask. Its unusable records (malformed, truncated, ...) are reported, and
  data.max_bad_fraction is raised to cover them (up to MAX_BAD_RAISE; above, the spec keeps 1%
  and init warns that the first apply will stop), so the spec runs as written.
- the bench: backend sglang when `stages.bench.sglang.python` (python3) imports sglang here
  (jobs/bench.py check_backend, through the registry), else embedded for a Llama target (our
  engine runs it: runner/engines.py llama_target) and sglang with a warning otherwise;
  num_prompts all 80 of MT-bench when this machine shows a GPU (runner/placement.py
  gpu_visible), else 8 prompts of 64 tokens (a CPU decodes a 135M target at a few tokens per
  second per configuration); likewise data.max_samples CPU_MAX_SAMPLES without a GPU (2 CPU
  cores train ~100-150 tokens/s: 64 ShareGPT conversations ~90k tokens, ~15 min an epoch), all
  with a GPU.
- chat template: which `target.chat_template` value its template source names
  (runner/chat.py `template_family`); the stages render the template and check it.
- the offline feature size: runner/disk.py `estimate`, the one `runner plan` prints (the data
  file's head, decompressed, at 4 characters per token, capped at data.max_length); above
  LARGE_FEATURES, or above the free space, the spec trains online (stages.train.features:
  online, no stages.extract) and keeps the offline lines as a comment.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import sys
from pathlib import Path

from eagle3_runner.runner import disk
from eagle3_runner.runner.placement import gpu_visible
from eagle3_runner.runner.chat import KNOWN, template_family
from eagle3_runner.runner.drafts.checks import chain_draft_tokens, default_aux_ids
from eagle3_runner.runner.drafts.families import target_family
from eagle3_runner.runner.drafts.layout import AUX_COUNT, to_hf_indices
from eagle3_runner.runner.drafts.server import auto_speculative_params
from eagle3_runner.runner.engines import llama_target
from eagle3_runner.runner.errors import InitError, TargetConfigError
from eagle3_runner.runner.files import atomic_write, expand_path
from eagle3_runner.runner.spec.base import MAX_NAME, NAME_PATTERN
from eagle3_runner.runner.spec.geometry import draft_geometry
from eagle3_runner.runner.target_config import chat_template_source, read_target_config

LARGE_FEATURES = 200e9  # bytes of offline features above which the spec trains online
SHARD_BYTES = 2**30  # aim for ~1 GiB shards (stages.extract.shard_samples)
DEFAULT_BAD = 0.01  # data.max_bad_fraction's default (runner/spec/sections.py)
MAX_BAD_RAISE = 0.10  # init raises max_bad_fraction to the data's own rate up to this
CPU_MAX_SAMPLES = 64  # data.max_samples init writes on a machine without a GPU (docstring)

def draft_vocab_size_for(vocab: int, hidden: int) -> int:
    """The draft vocab size `runner init` proposes (module docstring: the rule and why)."""
    size = 32000 if vocab >= 100_000 else 16000
    if hidden < 1024:
        size = min(size, 16000)
    return min(size, vocab)


def _stem(path: Path, cut: int) -> str:
    """A file's stem without its data suffixes (.jsonl.gz, .gguf), or a folder's name, reduced
    to the spec's name alphabet and `cut` characters ('' when nothing is left)."""
    stem = path.name
    while Path(stem).suffix in (".gz", ".jsonl", ".json", ".gguf", ".yaml", ".yml"):
        stem = Path(stem).stem
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip(".-")[:cut].strip(".-").lower()


def spec_name(target: Path, data: Path | None = None, out: Path | None = None) -> str:
    """The spec's default name, which names its work_dir (runs/<name>) and its runs in the
    results: --out's file stem (as specs/<name>.yaml in this repository), else
    <target>-<data>-eagle3 (two specs for one target on different data never share runs/),
    reduced to the spec's name alphabet."""
    if out is not None and (stem := _stem(out, 60)):
        return stem
    parts = [_stem(target, 48) or "target"] + ([_stem(data, 24)] if data else [])
    return "-".join(p for p in parts if p) + "-eagle3"


def _q(s: str) -> str:
    """A YAML double-quoted scalar (JSON string syntax is valid YAML)."""
    return json.dumps(s)


def build(target: str, data: str | None = None, name: str | None = None,
          out: str | None = None) -> tuple[str, dict]:
    """(spec YAML text with comments, facts {name, family, aux_layer_ids, draft_vocab_size,
    chat_template, template_source, bench, estimate}). Raises InitError for an unreadable
    target, or a data file that is missing or holds no usable conversation."""
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
    geo, _problems = draft_geometry({}, cfg, H)  # the drafter's geometry = the target's
    ctx = cfg.get("max_position_embeddings")
    family = target_family(cfg)
    aux = default_aux_ids(cfg, family)
    steps, topk, ndt = auto_speculative_params(cfg)
    bench = [(steps, topk, ndt)] + ([(steps, 1, chain_draft_tokens(steps))] if topk != 1 else [])
    vd = draft_vocab_size_for(V, H)
    text, where = chat_template_source(tpath)
    tmpl = template_family(text)
    dpath = expand_path(data).resolve() if data else None
    if dpath is not None and not dpath.is_file():
        raise InitError(f"--data {data}: {'is a folder' if dpath.is_dir() else 'does not exist'}"
                        "; point it at a JSONL or JSON file (plain, .gz or .zst).")
    max_length = min(2048, ctx or 2048)
    gpu = gpu_visible()
    name = name or spec_name(tpath, expand_path(data) if data else None,
                             expand_path(out) if out else None)
    data_block = {"source": "jsonl", "path": str(dpath)} if dpath else {"source": "sharegpt"}
    probe = _load({"name": name, "target": {"path": str(tpath), "num_hidden_layers": L,
                                            "hidden_size": H, "vocab_size": V},
                   "drafter": {"aux_layer_ids": aux, "draft_vocab_size": vd},
                   "data": {**data_block, "max_length": max_length,
                            "max_samples": None if gpu else CPU_MAX_SAMPLES},
                   "stages": {"extract": {}, "bench": {"backend": "sglang"}}},
                  check_target=False)
    est = disk.estimate(probe)  # the plan's estimate (runner/disk.py)
    if dpath and ("error" in est or not est.get("samples")):
        raise InitError(f"--data {data}: " + (est.get("error") or "no usable conversation in "
                        "it") + "; point it at a JSONL or JSON file of conversations (docs/data.md"
                        " lists the formats), or leave --data out for ShareGPT.")
    seen = _survey(tpath, dpath, data, tmpl or "auto", max_length) if dpath else None
    if seen is not None and "distinct_supervised" in seen:
        vd = max(1, min(vd, seen["distinct_supervised"]))
    bad = seen["bad_fraction"] if seen else 0.0
    limit = DEFAULT_BAD if bad <= DEFAULT_BAD or bad > MAX_BAD_RAISE else \
        math.ceil(bad * 100) / 100
    sglang_ok = _sglang_here(probe)
    backend = "sglang" if sglang_ok or not llama_target(probe, cfg) else "embedded"
    free, _fs = disk.free_bytes(probe.resolved_work_dir())
    mean_len = max(256, max_length // 2)
    shard = max(1, min(256, SHARD_BYTES // (mean_len * est["bytes_per_token"])))
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    online = "bytes" in est and (est["bytes"] > LARGE_FEATURES or est["bytes"] > free)
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
        f"  aux_layer_ids: {aux}   # SGLang's default, {family} layer-id rule (L={L}) = HF "
        f"hidden_states {to_hf_indices(aux)}",
        f"  draft_vocab_size: {vd}     # {_vocab_reason(V, H, vd, seen)}",
        f"  # geometry = the target's: hidden {H}, {geo['num_attention_heads']} heads, "
        f"{geo['num_key_value_heads']} KV heads, head_dim {geo['head_dim']}, "
        f"intermediate {geo['intermediate_size']}",
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
        "  # max_samples: 10000        # conversations to train on (null = all)" if gpu
        else f"  max_samples: {CPU_MAX_SAMPLES:<14}# no GPU here: a CPU trains ~100-150 tokens/s "
        "(ShareGPT whole: days); null = all",
        "  holdout: 0                 # > 0: held out for the `sharegpt` bench prompt set",
        f"  max_bad_fraction: {limit:<9g}# {_bad_reason(seen, limit)}",
        *_data_comments(seen),
        "stages:",
        "  # regenerate: {max_new_tokens: 1024}   # EAGLE-3's recipe: train on the target's own "
        "answers",
    ]
    extract = ["extract:", "  batch_tokens: 16384",
               f"  shard_samples: {shard}         # ~1 GiB shards at {mean_len} tokens per sample"]
    if not online:
        lines += [f"  {x}" for x in extract]
    size = (f"~{est['tokens']:,} tokens -> ~{disk.gb(est['bytes'])} under work_dir"
            if "bytes" in est else f"({est['error']})")
    lines += [
        f"  # Offline features: ({AUX_COUNT} aux + 1 last) x {H} x 2 bytes + 9 (id, mask) = "
        f"{est['bytes_per_token']:,} B per token;",
        f"  # {size} (free there: {disk.gb(free)}).",
        f"  # {est['method']} (runner/disk.py; runner plan prints the same)."
        if "bytes" in est else "",
    ]
    if online:
        lines += [f"  # That is more than {disk.gb(LARGE_FEATURES)} or the free space: the train "
                  "stage runs the target online (nothing",
                  "  # written but checkpoints). Offline instead (one target pass, faster "
                  "epochs): cap",
                  "  # data.max_samples, set train.features: offline and add",
                  *[f"  #   {x}" for x in extract]]
    lines += [
        "  train:",
        "    ttt_steps: 7               # SpecForge / EAGLE-3: 7 unrolled draft steps",
        "    epochs: 1",
        "    batch_size: 4",
        "    lr: 1.0e-4",
        *_eval_line(seen),
        "    features: online           # the target runs in the train stage (no stages.extract)"
        if online else "    features: offline          # online = the target runs in the train "
        "stage: no features on disk, no stages.extract",
    ]
    lines += [
        "  export: {}",
        "  bench:",
        f"    backend: {backend:<18}# {_backend_reason(backend, sglang_ok)}",
        "    prompt_sets: [mtbench]",
        "    num_prompts: null          # all 80 MT-bench prompts (this machine has a GPU)" if gpu
        else "    num_prompts: 8             # of MT-bench's 80: no GPU here (null = all; hours on "
        "a CPU)",
        f"    max_new_tokens: [{256 if gpu else 64}]",
        "    configs:",
        f"      - {{num_steps: {steps}, eagle_topk: {topk}, num_draft_tokens: {ndt}}}  # SGLang's "
        f"auto choice for {arch}",
    ]
    lines += [f"      - {{num_steps: {s}, eagle_topk: {k}, num_draft_tokens: {n}}}  # a chain, "
              "for comparison" for s, k, n in bench[1:]]
    lines += [
        "executor: {kind: local}",
        "# Slurm: apply from a login node; work_dir and results on a shared filesystem:",
        "# executor: {kind: slurm, partition: gpu, gpus_per_node: 8, nproc_per_node: 8,",
        "#            cpus_per_task: 8, mem_gb: 512, timeout_min: 1440}",
        "# results: {path: runs/results.duckdb}",
    ]
    facts = {"name": name, "target": str(tpath), "family": family, "architecture": arch,
             "num_hidden_layers": L, "hidden_size": H, "vocab_size": V, "aux_layer_ids": aux,
             "draft_vocab_size": vd, "chat_template": tmpl or "auto",
             "template_source": where if text else None,
             "bench": {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": ndt},
             "estimate": est,
             "features": "online" if online else "offline", "data": str(dpath) if dpath else None,
             "survey": seen, "max_bad_fraction": limit, "backend": backend}
    return "\n".join(x for x in lines if x) + "\n", facts


def _survey(tpath: Path, dpath: Path, data: str, template: str, max_length: int) -> dict:
    """targets/survey.py's report of the data file (module docstring), run as a child process
    (it imports transformers; this module stays torch-free). Raises InitError for data that
    cannot be read or holds no usable conversation."""
    import subprocess
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.targets.survey", "--target",
                        str(tpath), "--data", str(dpath), "--template", template,
                        "--max-length", str(max_length)], capture_output=True, text=True)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise InitError(f"--data {data}: reading it failed ({tail}); please report this with "
                        "the file's first lines.") from None
    if "error" in out:
        raise InitError(f"--data {data}: {out['error']}")
    if not out.get("clean"):
        raise InitError(f"--data {data}: no usable conversation in its {out['records_seen']} "
                        f"records (dropped: {_counts(out['dropped'])}); records need user and "
                        "assistant turns (docs/data.md lists the formats).")
    return out


def _counts(d: dict, examples: dict | None = None) -> str:
    """'malformed 1 (first at chats.jsonl:16), empty 2' (largest first), or 'none'."""
    ex = examples or {}
    return ", ".join(f"{r} {n}" + (f" (first at {ex[r][0]})" if ex.get(r) else "")
                     for r, n in sorted(d.items(), key=lambda kv: -kv[1])) or "none"


def _where(seen: dict) -> str:
    """'the 30 conversations' / 'the first 4,000 of 17,000 conversations' the survey tokenized
    (of the file, or of its first 64 MiB)."""
    n, all_ = seen["tokenized"], seen["all_tokenized"] and seen["whole"]
    return (f"the {n:,} conversations" if all_ else f"the first {n:,} conversations") + \
        ("" if seen["whole"] else " of the file's first 64 MiB")


def _vocab_reason(V: int, H: int, vd: int, seen: dict | None) -> str:
    """The comment on draft_vocab_size (module docstring: the rule)."""
    rule = draft_vocab_size_for(V, H)
    why = f"{'32000 for V >= 100k' if rule == 32000 else '16000 for V < 100k or H < 1024'}"
    if seen is None:
        return f"most frequent assistant tokens of {V:,}: {why}"
    if "distinct_supervised" not in seen:
        return (f"most frequent assistant tokens of {V:,}: {why} (the data's tokens not counted: "
                f"{seen['tokenizer_error'][:80]})")
    d = seen["distinct_supervised"]
    if vd < rule:
        return (f"= the {d:,} distinct assistant tokens in {_where(seen)} (of {V:,}); a larger "
                f"head would be padded with ids no sample targets. More data: raise it (up to "
                f"{rule})")
    return f"most frequent of the {d:,} distinct assistant tokens in {_where(seen)}: {why}"


def _bad_reason(seen: dict | None, limit: float) -> str:
    """The comment on data.max_bad_fraction."""
    if not seen or not seen["unusable_records"]:
        return f"fail above {limit:.0%} unusable records (docs/data.md)" + (
            f"; none in {seen['records_seen']:,} records read" if seen else "")
    n, of, pct = seen["unusable_records"], seen["records_seen"], 100 * seen["bad_fraction"]
    what = _counts(seen["unusable"], seen["examples"])
    if limit > DEFAULT_BAD:
        return (f"raised from 1%: {n} of {of:,} records ({pct:.2f}%) are unusable: {what}; "
                "fix the file and lower it")
    return (f"{n} of {of:,} records ({pct:.2f}%) are unusable: {what}" +
            ("; the first apply stops there: fix the file" if seen["bad_fraction"] > limit
             else ""))


def _data_comments(seen: dict | None) -> list[str]:
    """The data block's comment lines on what the survey read and cleaned away."""
    if not seen:
        return []
    policy = {r: n for r, n in seen["dropped"].items() if r not in seen["unusable"]}
    part = "" if seen["whole"] else " (its first 64 MiB)"
    return [f"  # read{part}: {seen['records_seen']:,} records, {seen['clean']:,} conversations "
            f"kept; cleaned away (not counted as bad): {_counts(policy)}"]


EVAL_SAMPLES = 8  # stages.train.eval_samples' default (runner/spec/stage_blocks.py)


def _eval_line(seen: dict | None) -> list[str]:
    """stages.train.eval_samples for a small data set (fewer than 10 x the default's
    conversations): a tenth of them, so that the eval does not take most of the training set;
    nothing (the default) otherwise."""
    n = seen["clean"] if seen else None
    if n is None or n >= 10 * EVAL_SAMPLES:
        return []
    ev = max(1, n // 10) if n > 1 else 0
    return [f"    eval_samples: {ev:<17}# held out of the {n} conversations for the eval loss "
            f"(default {EVAL_SAMPLES}: most of this set)"]


def _sglang_here(probe) -> bool:
    """Whether the bench's sglang backend can start here (`probe` benches with it): the check
    `runner plan` makes, jobs/bench.py check_backend, reached through the stage registry (it
    imports no torch)."""
    from eagle3_runner.runner.errors import RunnerError
    from eagle3_runner.runner.stages import stage_module
    try:
        stage_module("bench").check_backend(probe)
    except RunnerError:
        return False
    return True


def _backend_reason(backend: str, sglang_ok: bool) -> str:
    if backend == "embedded":
        return ("SGLang is not installed here: our engine benches this Llama target (chains "
                "and trees); for real servers `pip install 'eagle3-runner[sglang]'` and set "
                "backend: sglang")
    if sglang_ok:
        return "real SGLang servers; embedded = our engine (Llama targets)"
    return ("needs SGLang (`pip install 'eagle3-runner[sglang]'`, or set stages.bench.sglang."
            "python): not importable here, so `runner plan` refuses it until it is")


def _survey_lines(facts: dict) -> list[str]:
    """init's stderr lines on what it read of the data and what it made of it."""
    seen = facts["survey"]
    if not seen:
        return []
    policy = {r: n for r, n in seen["dropped"].items() if r not in seen["unusable"]}
    out = [f"init: data: {seen['records_seen']:,} records read"
           + ("" if seen["whole"] else " (the file's first 64 MiB)")
           + f", {seen['clean']:,} conversations kept; unusable {seen['unusable_records']} "
           f"({100 * seen['bad_fraction']:.2f}%): {_counts(seen['unusable'], seen['examples'])}; "
           f"cleaned away: {_counts(policy)}"]
    if seen["bad_fraction"] > facts["max_bad_fraction"]:
        out.append(f"init: warning: {100 * seen['bad_fraction']:.1f}% of the records are "
                   f"unusable, more than {MAX_BAD_RAISE:.0%}: the spec keeps data."
                   "max_bad_fraction 0.01 and the first apply will stop; fix the file")
    elif facts["max_bad_fraction"] > DEFAULT_BAD:
        out.append(f"init: data.max_bad_fraction = {facts['max_bad_fraction']:g} so that the "
                   "spec runs on this file as it is; fix the file and lower it")
    if "distinct_supervised" in seen:
        out.append(f"init: {seen['distinct_supervised']:,} distinct assistant tokens in "
                   f"{_where(seen)}: draft vocab {facts['draft_vocab_size']}")
    else:
        out.append(f"init: warning: the data's tokens were not counted "
                   f"({seen['tokenizer_error']}); draft vocab by the vocabulary rule")
    if facts["backend"] == "embedded":
        out.append("init: SGLang is not installed here: the bench runs on the embedded engine")
    return out


def _load(data: dict, check_target: bool = True):
    """The Spec of what init writes; it must validate (a failure here is a bug in init: it
    says so)."""
    from eagle3_runner.runner.errors import SpecError
    from eagle3_runner.runner.spec.load import load_spec
    try:
        return load_spec(data=data, check_target=check_target)
    except SpecError as e:
        raise InitError("the spec init wrote does not validate (a bug in runner init; please "
                        f"report it): {e}") from None


def _check(text: str) -> None:
    import yaml
    _load(yaml.safe_load(text))


def init_cli(target: str, data: str | None, out: str | None, name: str | None,
             as_json: bool, force: bool) -> int:
    """`runner init`: write (or print) the spec; a summary goes to stderr. Returns 0."""
    if name is not None and not re.fullmatch(NAME_PATTERN, name) or len(name or "") > MAX_NAME:
        raise InitError(f"--name {name!r}: a spec name is letters, digits, _ . - (not starting "
                        f"with '.'), at most {MAX_NAME} characters: it names folders and files. "
                        f"E.g. --name {re.sub(r'[^A-Za-z0-9_.-]+', '-', name).strip('.-') or 'x'}")
    o = expand_path(out) if out else None
    if o is not None and o.is_dir():
        raise InitError(f"--out {out}: is a folder; give the spec's file name, e.g. "
                        f"{o / 'spec.yaml'}")
    if o is not None and o.exists() and not force:
        raise InitError(f"--out {out}: exists; pass --force to overwrite it, or choose "
                        "another name.")
    text, facts = build(target, data, name, out)
    _check(text)
    if o is not None:
        try:
            o.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(o, text)
        except OSError as e:
            raise InitError(f"--out {out}: cannot write it ({e.strerror or e}); choose a file "
                            "in a folder you can write to.") from None
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
    if "bytes" in est:
        msg.append(f"init: offline features ~{disk.gb(est['bytes'])} "
                   f"({est['bytes_per_token']:,} B per token x ~{est['tokens']:,} "
                   "tokens)")
    if not facts["template_source"]:
        msg.append("init: warning: no chat template found; extract (or online training) needs one")
    msg += _survey_lines(facts)
    if out:
        msg.append(f"init: wrote {out}; next: runner validate {out} && runner plan {out}")
    print("\n".join(msg), file=sys.stderr)
    return 0

