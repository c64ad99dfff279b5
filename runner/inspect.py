"""`runner inspect`: find the known silent failures of an EAGLE-3 draft directory served by SGLang.

Reads config.json, the safetensors HEADER(s) and the d2t/t2d values only (numpy, from the byte
offsets in the header: runner/drafts/safetensors.py). Never imports torch and never loads the
target's weights: the target is read through runner.target_config (HF folder, config.json or GGUF
header).

Every rule comes from docs/eagle3-format.md and SGLang's llama_eagle3.py (load_weights: names are
tried as-is and with a `model.` prefix, anything else is dropped without a word; `d2t` holds
OFFSETS, hot_token_id = d2t + arange; `draft_vocab_size: null` loads the target's head instead of
the trained one; fc is built as `3 * (target_hidden_size or hidden_size)` wide). Layer ids: SGLang
eagle_config id k = output of 0-based layer k = HF hidden_states[k + 1]. The layout and rules are
stated once in runner/drafts/; the checks themselves are in runner/inspect_checks.py.

Findings carry a stable code: E_* are errors (exit 1), W_* are warnings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from runner.drafts.safetensors import draft_tensors
from runner.errors import InspectError, TargetConfigError
from runner.inspect_checks import (Finding, Findings, check_config, check_server_args,
                                   check_tensors)
from runner.target_config import read_target_config


# ----------------------------------------------------------------------------------------------
# entry points


def inspect_draft(draft_dir, target=None, server_args: str | None = None) -> list[Finding]:
    """All findings for an SGLang EAGLE-3 draft directory.

    draft_dir: config.json + *.safetensors (+ optional provenance.json from our export, whose
    recorded capture layers catch the HF-vs-SGLang off-by-one). target: HF folder, config.json or
    GGUF file, or a config dict; None = use provenance.json's target_config if present.
    server_args: an sglang.launch_server command line (shlex-parsed). Never raises for a bad
    draft: problems are findings."""
    d = Path(draft_dir)
    out = Findings()
    if not d.is_dir():
        out.error("E_NO_DRAFT_DIR", f"{d}: not a directory; pass the SGLang draft directory "
                  "(config.json + model.safetensors).")
        return out
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        out.error("E_NO_CONFIG", f"{d}/config.json: missing or not JSON ({e}).")
        return out
    if not isinstance(cfg, dict):
        out.error("E_NO_CONFIG", f"{d}/config.json: must be a JSON object, got a "
                  f"{type(cfg).__name__}. Re-export the draft.")
        return out
    prov = None
    if (d / "provenance.json").exists():
        try:
            prov = json.loads((d / "provenance.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            pass
        if not isinstance(prov, dict):
            prov = None
            out.warning("W_PROVENANCE", f"{d}/provenance.json is not a JSON object; ignored.")
    tgt = None
    if isinstance(target, dict):
        tgt = target
    elif target is not None:
        try:
            tgt = read_target_config(Path(target).expanduser())
        except (FileNotFoundError, TargetConfigError) as e:
            out.error("E_TARGET_UNREADABLE", f"--target {target}: cannot read the target's "
                      f"config ({e or 'not found'}).")
    elif isinstance((prov or {}).get("target_config"), dict):
        tgt = prov["target_config"]
    else:
        out.warning("W_NO_TARGET", "no --target given: widths, vocab size, aux id range and "
                    "max_position_embeddings were not checked against it.")
    view = cfg
    if isinstance(cfg.get("transformer_layer_config"), dict):  # speculators: geometry is nested
        view = {**cfg["transformer_layer_config"], **{k: v for k, v in cfg.items()
                                                      if k != "transformer_layer_config"}}
    out += check_config(view, tgt, prov)
    try:
        tensors = draft_tensors(d)
    except InspectError as e:
        out.error("E_SAFETENSORS", str(e))
        return out
    if not tensors:
        out.error("E_NO_WEIGHTS", f"{d}: no *.safetensors file. Export model.safetensors (SGLang "
                  "names: midlayer.*, fc, norm, lm_head, d2t, t2d).")
    else:
        for p in {t["file"] for t in tensors.values()}:
            end = max(t["start"] + t["data_offsets"][1] for t in tensors.values() if t["file"] == p)
            if os.path.getsize(p) < end:
                out.error("E_TRUNCATED", f"{p} is {os.path.getsize(p)} bytes, its header needs "
                          f"{end}: the file is truncated. Re-export it.")
        if "E_TRUNCATED" not in [f.code for f in out]:
            out += check_tensors(view, tensors, tgt)
    if server_args:
        out += check_server_args(server_args, d, view)
    return out


def render(findings: list[Finding], draft_dir, target) -> str:
    lines = [f"draft {draft_dir}" + (f"  (target {target})" if target else "")]
    for f in findings:
        lines.append(f"{f.severity:<7}  {f.code:<26}  {f.message}")
    ne = sum(f.severity == "error" for f in findings)
    lines.append(f"{ne} error(s), {len(findings) - ne} warning(s)" if findings else "clean: no findings")
    return "\n".join(lines)


def inspect_cli(draft_dir, target=None, server_args=None, as_json=False) -> int:
    """`runner inspect`: print the findings; exit code 1 on any error, else 0.
    --json prints {"ok": bool, "findings": [{"severity", "code", "message"}]}."""
    findings = inspect_draft(draft_dir, target, server_args)
    ok = not any(f.severity == "error" for f in findings)
    if as_json:
        print(json.dumps({"ok": ok, "findings": [f.as_dict() for f in findings]}, indent=1))
    else:
        print(render(findings, draft_dir, target), file=sys.stdout)
    return 0 if ok else 1
