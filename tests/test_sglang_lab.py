"""The conformance lab (runner/drafts/lab.py cases, targets/sglang_lab.py): every claim of the
rules table has a row (or says why none), every broken variant is written as described and our
checks before any server say what the lab expects of SGLang (an error for every harmful case,
none for a harmless one), outcomes and verdicts in numbers, and a small lab served by replayed
servers (tests/sglang_replay.py) fills the table."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from draft_fixtures import TINY, make_draft  # noqa: E402
from sglang_replay import HAND, fake_sglang  # noqa: E402

from eagle3_runner.runner.drafts.checks import default_aux_ids  # noqa: E402
from eagle3_runner.runner.drafts.lab import (BY_NAME, CASES, CLAIMS, NO_ROW, OUTCOMES,  # noqa: E402
                                             RULE_FIELDS, claims_map, outcome, verdict)
from eagle3_runner.runner.drafts.safetensors import draft_tensors, tensor_values  # noqa: E402
from eagle3_runner.targets.sglang_lab import LabSettings, judge, markdown, prepare, serve  # noqa: E402

G = {**TINY, "ids": default_aux_ids(TINY["L"])}  # SGLang's default ids: no_eagle_config = same


def test_every_rule_of_the_row_and_every_claim_has_a_lab_row():
    assert {f"rules.{f}" for f in RULE_FIELDS} <= set(CLAIMS)
    tested = {c for case in CASES for c in case.claims}
    assert tested <= set(CLAIMS)
    assert set(CLAIMS) - tested == set(NO_ROW), set(CLAIMS) - tested - set(NO_ROW)
    for case in CASES:
        assert case.expect and set(case.expect) <= set(OUTCOMES), case.name
    assert len(BY_NAME) == len(CASES) and CASES[0].name == "good"


def test_outcome_and_verdict_in_numbers():
    assert outcome(False, "error: x", False, None, 1.6) == "refuses"
    assert outcome(False, "not ready", False, None, 1.6, hung=True) == "hangs"
    assert outcome(True, "HTTP 500", False, None, 1.6) == "crashes"
    assert outcome(True, None, True, 1.60, 1.6) == "same"
    assert outcome(True, None, True, 1.63, 1.6) == "same"  # 0.05 x 0.6 + 0.02 = 0.05
    assert outcome(True, None, True, 1.66, 1.6) == "inflated"
    assert outcome(True, None, True, 1.40, 1.6) == "lower"
    assert outcome(True, None, True, 1.15, 1.6) == "collapses"  # <= 1 + 0.25 x 0.6
    assert outcome(True, None, True, 1.40, None) is None
    eagle = BY_NAME["algorithm_eagle"]
    assert verdict(eagle, "collapses", True) == {"verdict": "confirmed", "caught": "caught"}
    assert verdict(eagle, "same", True) == {"verdict": "corrected", "caught": "false alarm"}
    assert verdict(BY_NAME["keys_layers0"], "collapses", False) == \
        {"verdict": "corrected", "caught": "missed"}
    assert verdict(BY_NAME["chain_draft_tokens"], "same", True)["caught"] == "caught"  # harm
    rows = [{"case": "algorithm_eagle", "verdict": "confirmed", "observed": "collapses"},
            {"case": "keys_layers0", "verdict": "corrected", "observed": "collapses"}]
    m = {c["claim"]: c for c in claims_map(rows)}
    assert m["E_ALGORITHM_NOT_EAGLE3"]["status"] == "confirmed"
    assert m["rules.multi_layer"]["status"] == "corrected"
    # a blind case (tau too weak to judge) served as well as the good draft: unknown, never a
    # correction nor a false alarm; what tau does show still judges it
    off = BY_NAME["aux_ids_off_by_one"]
    assert verdict(off, "same", True) == {"verdict": "unknown", "caught": "unjudged"}
    assert verdict(off, "lower", True) == {"verdict": "confirmed", "caught": "caught"}
    assert verdict(off, "refuses", True)["verdict"] == "corrected"
    assert verdict(BY_NAME["num_layers_2"], "same", False) == \
        {"verdict": "confirmed", "caught": "clean"}
    blind = {c["claim"]: c["status"] for c in claims_map(
        [{"case": "aux_ids_off_by_one", "verdict": "unknown", "observed": "same"}])}
    assert blind["rules.capture"] == "unknown"
    assert m["rules.deepseek_first_id_rule"]["status"].startswith("no row")
    assert m["E_FC_WIDTH"]["status"] == "not run"


def _settings(root: Path, prompts=(("mtbench-81", [1, 2, 3]),), **kw) -> LabSettings:
    tdir = root / "target"
    return LabSettings(python=sys.executable, model=str(tdir),
                       target=json.loads((tdir / "config.json").read_text()),
                       prompts=list(prompts), max_new=16, timeout_s=30, **kw)


@pytest.fixture
def good(tmp_path) -> Path:
    """A dense TINY draft as our export writes it, with the capture layers in provenance."""
    return make_draft(tmp_path, G, dense=True, name="export",
                      provenance={"features": {"hf_hidden_indices": [k + 1 for k in G["ids"]]}})


def test_variants_are_written_as_described_and_our_checks_expect_what_the_lab_does(good,
                                                                                    tmp_path):
    """Before any server: every harmful case gets an error from inspect or the spec rules, every
    harmless one none; the variants hold the defect they name."""
    rows = prepare(good, tmp_path / "lab", _settings(tmp_path))
    by = {r["case"]: r for r in rows}
    for case in CASES:
        r = by[case.name]
        codes = [f["code"] for f in r["inspect"]]
        assert "E_INSPECT_INTERNAL" not in codes, (case.name, r["inspect"])
        assert r["we_said_error"] is case.harmful, (case.name, codes, r["spec"])
        assert (Path(r["dir"]) == good) is case.same_files
    cfg = {n: json.loads((Path(by[n]["dir"]) / "config.json").read_text()) for n in by}
    ts = {n: draft_tensors(Path(by[n]["dir"])) for n in by}
    assert any(k.startswith("layers.0.") for k in ts["keys_layers0"])
    assert all(k.startswith("draft_model.") for k in ts["keys_draft_model_prefix"])
    assert "d2t" not in ts["d2t_missing"] and "embed_tokens.weight" in ts["embed_present"]
    good_d2t = tensor_values(ts["good"]["d2t"])
    assert (tensor_values(ts["d2t_absolute"]["d2t"]) == good_d2t + range(len(good_d2t))).all()
    assert ts["fc_width_h"]["fc.weight"]["shape"] == [G["H"], G["H"]]
    assert cfg["draft_vocab_null"]["draft_vocab_size"] is None
    assert cfg["aux_ids_off_by_one"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [k + 1 for k in G["ids"]]
    assert cfg["mpe_short"]["max_position_embeddings"] == G["ctx"] // 4
    assert "eagle_config" not in cfg["no_eagle_config"]
    assert cfg["num_layers_2"]["num_hidden_layers"] == 2
    assert (Path(by["embed_present"]["dir"]) / "provenance.json").exists()


def test_a_small_lab_on_replayed_servers(good, tmp_path, monkeypatch):
    """good, keys_layers0 (served like the good draft) and flag_draft_kv_dtype (the recorded
    refusal), replayed from tests/data/sglang/handwritten: tau measured, the refusal's error line,
    outcomes judged against the good row, the claims mapped, the table rendered."""
    fake = fake_sglang(tmp_path / "fake", HAND)
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{os.environ.get('PYTHONPATH', '')}")
    st = _settings(tmp_path, extra=["--cuda-graph-max-bs", "1"], parallel=2)
    rows = prepare(good, tmp_path / "lab", st, ["good", "keys_layers0", "flag_draft_kv_dtype"])
    rec = tmp_path / "rec"
    serve(rows, st, rec)
    claims = judge(rows, rec)
    by = {r["case"]: r for r in rows}
    assert by["good"]["tau"] == pytest.approx(1 + 4 / 3) and by["good"]["observed"] == "same"
    assert by["keys_layers0"]["observed"] == "same" and by["keys_layers0"]["verdict"] == "confirmed"
    kv = by["flag_draft_kv_dtype"]
    assert (kv["observed"], kv["verdict"], kv["caught"]) == ("refuses", "confirmed", "caught")
    assert "unrecognized arguments" in kv["error"]
    m = {c["claim"]: c["status"] for c in claims}
    assert m["rules.server_flags"] == "confirmed" and m["rules.multi_layer"] == "confirmed"
    for case in ("good", "keys_layers0", "flag_draft_kv_dtype"):
        assert (rec / case / "server.log").exists() and (rec / case / "argv.json").exists()
    table = markdown(rows, claims, {"version": "0.5.14", "prompts": 1})
    assert "| flag_draft_kv_dtype |" in table and "refused: " in table
    assert "| rules.server_flags |" in table


LAB_SETS = [s for s in __import__("sglang_replay").recording_sets()
            if (s / "lab" / "lab.json").exists()]


@pytest.mark.parametrize("rec", LAB_SETS, ids=lambda p: p.name)
def test_recorded_lab_rows_agree_with_our_checks(rec, good, tmp_path):
    """What a real SGLang did with each broken variant (a recorded lab, scripts/gpu/
    sglang_fixtures.py) against what our checks say of the same defect today: an error for
    every case SGLang refused, crashed on, or served worse (or that has a harm tau does not
    show), none for a case it served as well as the good draft; every refusal names its error."""
    lab = json.loads((rec / "lab" / "lab.json").read_text())
    ours = {r["case"]: r for r in prepare(good, tmp_path / "lab", _settings(tmp_path))}
    for r in lab["rows"]:
        if r.get("observed") is None:
            continue
        case = BY_NAME[r["case"]]
        if case.blind and r["observed"] == "same":
            continue  # tau cannot judge it (Case.blind): our error stands on the source
        harmful = r["observed"] in ("refuses", "hangs", "crashes", "lower", "collapses",
                                    "inflated") or bool(case.harm)
        assert ours[r["case"]]["we_said_error"] is harmful, (r["case"], r["observed"])
        if r["observed"] == "refuses":
            from eagle3_runner.targets.sglang import error_line
            assert error_line((rec / "lab" / r["case"] / "server.log").read_text()), r["case"]


H100_LAB = json.loads((Path(__file__).parent / "data" / "sglang" / "lab-h100-0.5.14.json")
                      .read_text())


def test_the_first_real_lab_judged_by_todays_cases_and_checks(good, tmp_path):
    """The rows of the H100 lab on SGLang 0.5.14 (2026-12-07, tests/data/sglang/
    lab-h100-0.5.14.json): each outcome, judged against today's cases, confirms their claims (or
    is unknown where tau cannot judge), and our checks say an error exactly where SGLang
    misbehaved or the case has a harm: num_layers_2 (served like the good export) is a warning
    on 0.5.14, the refused draft_vocab_null and the lower use_aux_false stay errors."""
    lab, ours = H100_LAB, {r["case"]: r for r in prepare(good, tmp_path / "lab",
                                                           _settings(tmp_path))}
    assert lab["version"] == "0.5.14"
    good_tau = lab["tau"]["good"]
    rows = [{"case": n, "observed": outcome(True, None, True, t, good_tau)}
            for n, t in lab["tau"].items()]
    rows += [{"case": n, "observed": outcome(False, "refused", False, None, good_tau)}
             for n in lab["refused"]]
    for r in rows:
        r.update(verdict(BY_NAME[r["case"]], r["observed"], ours[r["case"]]["we_said_error"]))
    by = {r["case"]: r for r in rows}
    assert {n: r["observed"] for n, r in by.items()} == {
        "good": "same", "algorithm_eagle": "collapses", "keys_draft_model_prefix": "collapses",
        "d2t_absolute": "collapses", "num_layers_2": "same", "aux_ids_off_by_one": "same",
        "use_aux_false": "lower", "draft_vocab_null": "refuses"}
    for n, r in by.items():
        want = ("unknown", "unjudged") if n == "aux_ids_off_by_one" else \
            ("confirmed", "clean" if n in ("good", "num_layers_2") else "caught")
        assert (r["verdict"], r["caught"]) == want, (n, r)
    m = {c["claim"]: c["status"] for c in claims_map(rows)}
    for claim in ("rules.unloaded_layer", "rules.reads_use_aux_hidden_state",
                  "E_DRAFT_VOCAB_NULL", "E_ALGORITHM_NOT_EAGLE3", "E_KEY_PREFIX",
                  "E_D2T_ABSOLUTE"):
        assert m[claim] == "confirmed", claim
    assert m["rules.capture"] == "unknown"
    n2 = [(f["severity"], f["code"]) for f in ours["num_layers_2"]["inspect"]]
    assert ("warning", "W_NUM_LAYERS") in n2 and not any(s == "error" for s, _ in n2), n2
    codes = {n: {f["code"] for f in ours[n]["inspect"] if f["severity"] == "error"}
             for n in ("use_aux_false", "draft_vocab_null", "aux_ids_off_by_one")}
    assert codes == {"use_aux_false": {"E_AUX_DISABLED"}, "draft_vocab_null": {"E_DRAFT_VOCAB_NULL"},
                     "aux_ids_off_by_one": {"E_AUX_IDS_OFF_BY_ONE"}}, codes
