"""`runner inspect`: find the known silent failures of an EAGLE-3 draft directory served by SGLang,
for one SGLang version (`--sglang-version`; default: the installed sglang's version, read from
its package metadata without importing it, else the newest version the rules table knows).

Reads config.json, the safetensors HEADER(s) and bounded parts of the values (d2t/t2d, a sample of
the weights for NaN/Inf: runner/inspect_tensors.py), numpy only. Never imports torch and never
loads the target's weights: the target is read through runner.target_config (HF folder,
config.json or GGUF header). The rules per version are stated once in runner/drafts/ (rules.py
holds the version table, rules_for(version) what a version is checked against); the checks are in
runner/inspect_checks.py (config), runner/inspect_tensors.py (tensors) and runner/drafts/server.py
(the server line; its environment is read from leading `VAR=value` words of --server-args).

Never raises for any input: every problem is a finding. Findings carry a stable code: E_* are
errors (exit 1), W_* are warnings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3_runner.runner.drafts.layout import config_view
from eagle3_runner.runner.drafts.rules import RuleSet, default_version, rules_for
from eagle3_runner.runner.drafts.safetensors import scan_draft
from eagle3_runner.runner.drafts.server import server_findings
from eagle3_runner.runner.errors import TargetConfigError
from eagle3_runner.runner.inspect_checks import Finding, Findings, check_config, typed_target
from eagle3_runner.runner.inspect_tensors import check_tensors
from eagle3_runner.runner.target_config import read_target_config

MAX_JSON = 16 << 20  # config.json / provenance.json larger than this are not read


def read_small_json(p: Path):
    """(object, error) of a small JSON file; never raises."""
    try:
        if p.stat().st_size > MAX_JSON:
            return None, f"{p.stat().st_size} bytes, larger than {MAX_JSON >> 20} MiB"
        return json.loads(p.read_text(encoding="utf-8")), None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        return None, f"{type(e).__name__}: {e}"


def resolve_version(sglang_version: str | None) -> tuple[RuleSet | None, dict, str | None]:
    """(rules, report dict, error) for the --sglang-version value (None = default_version())."""
    v, source = (sglang_version, "--sglang-version") if sglang_version else default_version()
    try:
        rs = rules_for(v)
    except ValueError as e:
        return None, {"asked": v, "source": source}, str(e)
    return rs, {"asked": v, "source": source, "rules": [r.read for r in rs.rows],
                "note": rs.note}, None


def inspect_draft(draft_dir, target=None, server_args: str | None = None,
                  sglang_version: str | None = None) -> Findings:
    """All findings for an SGLang EAGLE-3 draft directory, checked for SGLang `sglang_version`
    (None: default_version(); `.sglang` of the result says what was checked, `.notes` how).

    draft_dir: config.json + *.safetensors (+ optional provenance.json from our export, whose
    recorded capture layers catch the HF-vs-SGLang off-by-one). target: HF folder, config.json or
    GGUF file, or a config dict; None = use provenance.json's target_config if present.
    server_args: an sglang.launch_server command line (shlex-split; leading VAR=value words are
    its environment). Never raises: problems are findings."""
    out = Findings()
    rules, out.sglang, err = resolve_version(sglang_version)
    if err:
        out.error("E_SGLANG_VERSION", f"--sglang-version {sglang_version}: {err}.")
        return out
    if not rules.supported:
        out.warning("W_SGLANG_VERSION", rules.note)
    try:
        _inspect(Path(draft_dir), target, server_args, rules, out)
    except Exception as e:  # noqa: BLE001 - the inspector never raises; a bug becomes a finding
        out.error("E_INSPECT_INTERNAL", f"the inspector failed ({type(e).__name__}: {e}); "
                  "this is a bug in runner inspect, please report it with the directory.")
    return out


def _inspect(d: Path, target, server_args, rules: RuleSet, out: Findings) -> None:
    if not d.is_dir():
        out.error("E_NO_DRAFT_DIR", f"{d}: not a directory; pass the SGLang draft directory "
                  "(config.json + model.safetensors).")
        return
    cfg, why = read_small_json(d / "config.json")
    if why:
        inner = sorted(q.parent for q in d.glob("*/config.json"))[:3]  # runs/x/export/<key>
        out.error("E_NO_CONFIG", f"{d}/config.json: missing or not JSON ({why})."
                  + (f" Its subfolders hold drafts: inspect one of {[str(q) for q in inner]}."
                     if not (d / "config.json").exists() and inner else ""))
        return
    if not isinstance(cfg, dict):
        out.error("E_NO_CONFIG", f"{d}/config.json: must be a JSON object, got a "
                  f"{type(cfg).__name__}. Re-export the draft.")
        return
    prov = None
    if (d / "provenance.json").exists():
        prov, _ = read_small_json(d / "provenance.json")
        if not isinstance(prov, dict):
            prov = None
            out.warning("W_PROVENANCE", f"{d}/provenance.json is not a JSON object; ignored.")
    tgt = None
    if isinstance(target, dict):
        tgt = target
    elif target is not None:
        try:
            tgt = read_target_config(Path(target).expanduser())
        except (OSError, TargetConfigError) as e:
            out.error("E_TARGET_UNREADABLE", f"--target {target}: cannot read the target's "
                      f"config ({e or 'not found'}).")
    elif isinstance((prov or {}).get("target_config"), dict):
        tgt = prov["target_config"]
    else:
        out.warning("W_NO_TARGET", "no --target given: widths, vocab size, aux id range, the "
                    "target's family and max_position_embeddings were not checked against it.")
    view = cfg
    if isinstance(cfg.get("transformer_layer_config"), dict):  # speculators: geometry is nested
        view = {**cfg["transformer_layer_config"], **{k: v for k, v in cfg.items()
                                                      if k != "transformer_layer_config"}}
    out += check_config(view, tgt, prov, rules)
    typed, _ = config_view(view)
    scan = scan_draft(d)
    if not scan.files and not scan.problems:
        out.error("E_NO_WEIGHTS", f"{d}: no *.safetensors file. Export model.safetensors (SGLang "
                  "names: midlayer.*, fc, norm, lm_head, d2t, t2d).")
    else:
        out += check_tensors(typed, scan, typed_target(tgt)[0], rules)
    if server_args is not None:
        out.add(server_findings(server_args, d, typed, rules))


def render(findings: list[Finding], draft_dir, target) -> str:
    lines = [f"draft {draft_dir}" + (f"  (target {target})" if target else "")]
    s = getattr(findings, "sglang", None) or {}
    if s.get("rules"):
        lines.append(f"sglang {s['asked']} ({s['source']}); rules of "
                     f"{', '.join(s['rules'])}" + (f". {s['note']}" if s.get("note") else ""))
    for n in getattr(findings, "notes", []):
        lines.append(f"note: {n}")
    for f in findings:
        lines.append(f"{f.severity:<7}  {f.code:<26}  {f.message}")
    ne = sum(f.severity == "error" for f in findings)
    lines.append(f"{ne} error(s), {len(findings) - ne} warning(s)" if findings else "clean: no findings")
    return "\n".join(lines)


def inspect_cli(draft_dir, target=None, server_args=None, as_json=False,
                sglang_version=None) -> int:
    """`runner inspect`: print the findings; exit code 1 on any error, else 0.
    --json prints {"ok": bool, "sglang": {asked, source, rules, note}, "notes": [...],
    "findings": [{"severity", "code", "message"}]}."""
    findings = inspect_draft(draft_dir, target, server_args, sglang_version)
    ok = not any(f.severity == "error" for f in findings)
    if as_json:
        print(json.dumps({"ok": ok, "sglang": getattr(findings, "sglang", {}),
                          "notes": findings.notes,
                          "findings": [f.as_dict() for f in findings]}, indent=1))
    else:
        print(render(findings, draft_dir, target), file=sys.stdout)
    return 0 if ok else 1
