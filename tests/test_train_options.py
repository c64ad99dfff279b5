"""The training options of issue 36 (docs/training-options.md): stages.train.loss (kl, lk_lambda,
lk_alpha) against references written from the formulas, not from the code; the aux noise
(stages.train.noise_std) on training steps only; drafter.fc_norm / norm_output through train
(draft_config.json), export (config.json keys, tensor names) and `runner inspect` per SGLang
version; and their spec rules (drafter.sglang_version). The fast step equals the reference for
every option in tests/test_ttt.py; the engine's draft forward equals training's in
tests/test_engine_vs_train.py; SpecForge's own code in tests/test_parity_specforge.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_spec import one, problems, spec_dict  # noqa: E402

from eagle3_runner.runner.spec.load import load_spec  # noqa: E402
from eagle3_runner.trainer import objective as TR  # noqa: E402

torch.set_num_threads(2)


# ---------------------------------------------------------------------------------------------
# the losses against their formulas


def _case(seed=0, B=2, N=5, Vd=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, Vd, generator=g, dtype=torch.float64) * 2
    full = torch.randn(B, N, Vd + 4, generator=g, dtype=torch.float64) * 2  # 4 out-of-vocab ids
    p = torch.softmax(full[..., :Vd], -1)
    cover = torch.softmax(full, -1)[..., :Vd].sum(-1)
    trained = torch.rand(B, N, generator=g) > 0.3
    return logits, p, cover, trained


def _formula(logits, p, cover, trained, name, eta=3.0):
    """Per-position losses from the definitions, one position at a time in Python floats:
    q = softmax(logits), p_true = p x cover, alpha = sum min(p_true, q); kl = -sum p log q;
    lk_alpha = -log alpha; lk_lambda = lam (-sum p log q) + (1 - lam)(1 - alpha) with
    lam = exp(-eta x mean alpha over the trained positions), a constant."""
    B, N, Vd = logits.shape
    out, alphas = {}, {}
    for b in range(B):
        for i in range(N):
            z = [float(x) for x in logits[b, i]]
            mx = max(z)
            lse = mx + math.log(sum(math.exp(x - mx) for x in z))
            q = [math.exp(x - lse) for x in z]
            pp = [float(x) for x in p[b, i]]
            ce = -sum(pv * (zv - lse) for pv, zv in zip(pp, z))
            alpha = sum(min(pv * float(cover[b, i]), qv) for pv, qv in zip(pp, q))
            out[b, i], alphas[b, i] = ce, alpha
    if name == "kl":
        return out
    if name == "lk_alpha":
        return {k: -math.log(a) for k, a in alphas.items()}
    mean = sum(alphas[k] for k in alphas if trained[k]) / sum(bool(trained[k]) for k in alphas)
    lam = math.exp(-eta * mean)
    return {k: lam * out[k] + (1 - lam) * (1 - alphas[k]) for k in out}


@pytest.mark.parametrize("name,eta", [("kl", 3.0), ("lk_alpha", 3.0), ("lk_lambda", 3.0),
                                      ("lk_lambda", 0.7)])
def test_position_losses_equal_their_formula(name, eta):
    logits, p, cover, trained = _case()
    got = TR.position_losses(logits, p, cover, trained, TR.Loss(name, eta))
    want = _formula(logits, p, cover, trained, name, eta)
    for (b, i), v in want.items():
        assert float(got[b, i]) == pytest.approx(v, rel=1e-9, abs=1e-12), (b, i)
    if name != "kl":  # the LK losses read the TRUE probabilities: coverage 1 gives other values
        other = TR.position_losses(logits, p, torch.ones_like(cover), trained, TR.Loss(name, eta))
        assert (other - got).abs().max() > 1e-3


def test_lk_lambda_has_no_gradient_through_lambda():
    """d/dz of lk_lambda = lam d(CE)/dz + (1 - lam) d(1 - alpha)/dz with lam held constant."""
    logits, p, cover, trained = _case(seed=1)
    z = logits.clone().requires_grad_()
    l = (TR.position_losses(z, p, cover, trained, TR.Loss("lk_lambda")) * trained).sum()
    (g,) = torch.autograd.grad(l, z)
    z2 = logits.clone().requires_grad_()
    q = torch.softmax(z2, -1)
    alpha = torch.minimum(p * cover[..., None], q).sum(-1)
    lam = math.exp(-3.0 * float((alpha.detach() * trained).sum() / trained.sum()))
    ce = -(p * torch.log_softmax(z2, -1)).sum(-1)
    (g2,) = torch.autograd.grad(((lam * ce + (1 - lam) * (1 - alpha)) * trained).sum(), z2)
    assert torch.allclose(g, g2, atol=1e-12)


def test_ttt_loss_is_the_decayed_mean_of_the_position_losses():
    """ttt_loss with an LK loss: sum_j 0.8^j mean over trained positions, on a 1-step unroll
    whose logits are read back (so the reference does not re-run the drafter)."""
    from test_ttt import _setup
    m, used, head, samples = _setup()
    b = TR.make_batch(samples, 1)
    tgt = TR.target_dist(b["tgt_hidden"], head, used, m.t2d, 1e-5)
    seen = []
    orig = type(m).logits
    m.logits = lambda h: seen.append(orig(m, h)) or seen[-1]
    with torch.no_grad():
        loss, st = TR.ttt_loss(m, b, tgt, 1, 0.8, loss=TR.Loss("lk_alpha"))
    N = b["aux"].shape[1]
    trained = b["pmask"][:, :N] & tgt.in_vocab[:, :N]
    want = _formula(seen[0].double(), tgt.p[:, :N].double(), tgt.cover[:, :N].double(), trained,
                    "lk_alpha")
    mean = sum(v for k, v in want.items() if trained[k]) / int(trained.sum())
    assert float(loss) == pytest.approx(mean, rel=1e-5)
    assert float(st["loss"][0]) == pytest.approx(mean, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# the aux noise


def test_aux_noise_is_uniform_in_plus_minus_std_and_keeps_the_dtype():
    torch.manual_seed(0)
    aux = torch.full((200, 300), 2.0, dtype=torch.bfloat16)
    out = TR.aux_noise(aux, 0.05)
    d = out.float() - 2.0
    assert out.dtype == torch.bfloat16 and out.shape == aux.shape
    assert float(d.abs().max()) <= 0.05 + 2 ** -7  # bf16 rounding at 2.0: spacing 2^-6
    d = TR.aux_noise(torch.zeros(400, 500), 0.05)
    assert d.abs().max() <= 0.05 and abs(float(d.mean())) < 1e-3
    assert float(d.std()) == pytest.approx(0.05 / math.sqrt(3), rel=0.02)  # a half-width, not std


def test_noise_is_applied_to_training_steps_only(monkeypatch):
    """train_step adds the noise (the same seed and weights give another loss), evaluate does
    not (noise_std leaves it unchanged)."""
    from test_ttt import _setup
    from eagle3_runner.runner.spec.stage_blocks import TrainStage
    from eagle3_runner.trainer import evaluation as Ev
    from eagle3_runner.trainer import recipe as R

    def learner(noise):
        m, used, head, samples = _setup()
        p = TrainStage(ttt_steps=2, noise_std=noise, kernels="reference")
        opt = torch.optim.AdamW(m.parameters(), lr=0.0)
        return R.Learner(m, opt, p, head, used, m.t2d, 1e-5, torch.device("cpu")), samples

    class Source:
        def __init__(self, s):
            self.s = s

        def batch(self, ids):
            return [self.s[i] for i in ids]

    losses, evals = [], []
    for noise in (0.0, 0.5):
        L, samples = learner(noise)
        torch.manual_seed(1)
        losses.append(float(R.train_step(L, samples).loss))
        evals.append(Ev.evaluate(L, Source(samples), list(range(len(samples))))["loss"])
    assert abs(losses[1] - losses[0]) > 1e-4
    assert evals[0] == evals[1]


# ---------------------------------------------------------------------------------------------
# the spec rules: drafter.fc_norm / norm_output per SGLang version, the new fields


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
@pytest.mark.parametrize("version", [None, "0.5.6", "0.5.10"])
def test_eagle31_options_refused_where_sglang_ignores_them(flag, version):
    d = {flag: True} if version is None else {flag: True, "sglang_version": version}
    msg = one(f"drafter.{flag}", problems(spec_dict(drafter=d)))
    assert "SGLang 0.5.6 never reads" in msg and "0.5.14 or newer" in msg
    assert ("drafter.sglang_version is not set" in msg) == (version is None)


@pytest.mark.parametrize("version", ["0.5.14", "0.5.23", "0.6.1"])
def test_eagle31_options_accepted_for_versions_that_read_them(version):
    s = load_spec(data=spec_dict(drafter={"fc_norm": True, "norm_output": True,
                                          "sglang_version": version}))
    assert s.drafter.fc_norm and s.drafter.norm_output


@pytest.mark.parametrize("value,why", [("latest", "not an SGLang version"),
                                       ("0.4.9", "older than the table's first row")])
def test_sglang_version_must_be_a_known_version(value, why):
    assert why in one("drafter.sglang_version",
                      problems(spec_dict(drafter={"sglang_version": value})))


def test_train_option_fields_are_validated():
    bad = problems(spec_dict(stages={"train": {"loss": "lk-lambda", "noise_std": -0.1},
                                     "extract": {}}))
    assert "lk_lambda" in one("stages.train.loss", bad)  # did you mean
    one("stages.train.noise_std", bad)
    s = load_spec(data=spec_dict(stages={"train": {"loss": "lk_lambda", "lk_eta": 2.0,
                                                   "noise_std": 0.05}, "extract": {}}))
    assert (s.stages.train.loss, s.stages.train.lk_eta, s.stages.train.noise_std) == \
        ("lk_lambda", 2.0, 0.05)
    d = load_spec(data=spec_dict(stages={"train": {}, "extract": {}})).stages.train
    assert (d.loss, d.lk_eta, d.noise_std) == ("kl", 3.0, 0.0)  # defaults: today's recipe


def test_sglang_version_is_not_part_of_the_train_key():
    from eagle3_runner.runner.stages import stage_slice
    a = load_spec(data=spec_dict(stages={"train": {}, "extract": {}, "export": {}}))
    b = load_spec(data=spec_dict(drafter={"sglang_version": "0.5.14"},
                                 stages={"train": {}, "extract": {}, "export": {}}))
    assert stage_slice(a, "train") == stage_slice(b, "train")
    assert stage_slice(a, "export") != stage_slice(b, "export")  # export inspects for it


# ---------------------------------------------------------------------------------------------
# train -> export -> inspect with fc_norm and norm_output


def _export(tmp_path, **options):
    """A drafter built as training builds it (DraftConfig.from_spec), exported by the export
    stage's own functions; returns (export dir, target config dict)."""
    from safetensors.torch import save_file
    from eagle3_runner.jobs.export import sglang_config, sglang_tensors
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    spec = load_spec(data=spec_dict(drafter={"draft_vocab_size": 64, **options}))
    tcfg = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 1536, "vocab_size": 49152, "num_hidden_layers": 30,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    dc = DraftConfig.from_spec(spec, tcfg)
    m = Eagle3Draft(dc)
    with torch.no_grad():
        m.d2t.copy_(torch.arange(64) * 3)
        m.t2d[torch.arange(64) * 4] = True
    cfg = sglang_config(DraftConfig(**json.loads(json.dumps(dc.as_dict()))), tcfg)
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(sglang_tensors(m.state_dict(), cfg), str(d / "model.safetensors"))
    return d, tcfg


def test_export_and_inspect_round_trip_with_fc_norm_and_norm_output(tmp_path):
    from safetensors import safe_open
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.runner.inspect import inspect_draft
    d, tcfg = _export(tmp_path, fc_norm=True, norm_output=True, sglang_version="0.5.14")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    for v in ("0.5.14", "0.5.23"):
        f = inspect_draft(d, target=tcfg, sglang_version=v)
        assert [x.code for x in f if x.severity == "error"] == [], [x.message for x in f]
        assert "W_ENGINE_UNSUPPORTED" not in [x.code for x in f]
    f = inspect_draft(d, target=tcfg, sglang_version="0.5.6")
    errs = [x for x in f if x.severity == "error"]
    assert {x.code for x in errs} == {"E_FLAG_IGNORED"}
    assert {"fc_norm", "norm_output"} <= {w for x in errs for w in ("fc_norm", "norm_output")
                                          if w in x.message}
    back = load_exported(d, torch.zeros(49152, 576))
    assert (back.config.fc_norm, back.config.norm_output) == (True, True)


def test_export_without_options_writes_no_option_keys(tmp_path):
    """Off = absent keys (SGLang's default off; SpecForge 0.2.0 reads an explicit norm_output:
    false as logits without the final norm)."""
    d, tcfg = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    assert "fc_norm" not in cfg and "norm_output" not in cfg


# ---------------------------------------------------------------------------------------------
# stages.bench.drafter: benching an external draft directory (the SpecForge peer's)


def _bench_spec(tmp_path, drafter, tcfg, **drafter_fields):
    t = tmp_path / "target"
    t.mkdir(exist_ok=True)
    (t / "config.json").write_text(json.dumps(tcfg))
    return load_spec(data=spec_dict(
        work_dir=str(tmp_path / "w"), results={"path": str(tmp_path / "r.duckdb")},
        target={"path": str(t)}, drafter={"draft_vocab_size": 64, **drafter_fields},
        stages={"extract": {}, "train": {}, "export": {},
                "bench": {"configs": [{"num_steps": 3}], "drafter": str(drafter)}}))


def test_bench_drafter_replaces_the_export_input_and_keys_on_its_content(tmp_path):
    from eagle3_runner.runner.plan import build_plan, input_files
    from eagle3_runner.runner.stages import stage_needs
    d, tcfg = _export(tmp_path)
    spec = _bench_spec(tmp_path, d, tcfg)
    assert stage_needs(spec, "bench") == ()
    before = input_files(spec, "bench")["drafter"]
    assert set(before) == {"config.json", "model.safetensors"}
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 1  # the same size, another content: another key
    (d / "model.safetensors").write_bytes(bytes(raw))
    assert input_files(spec, "bench")["drafter"]["model.safetensors"] != before["model.safetensors"]
    bench = [p for p in build_plan(spec).stages if p.stage == "bench"][0]
    assert bench.needs == ()


def test_bench_drafter_must_exist_and_pass_inspect(tmp_path):
    from eagle3_runner.jobs.bench import drafter_dir
    from eagle3_runner.runner.errors import PlanError, StageError
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.stage import StageContext
    d, tcfg = _export(tmp_path, fc_norm=True, sglang_version="0.5.14")
    with pytest.raises(PlanError, match="stages.bench.drafter"):
        build_plan(_bench_spec(tmp_path, tmp_path / "nowhere", tcfg))

    def ctx(version):  # the spec's own options are off: it validates for any version
        return StageContext(spec=_bench_spec(tmp_path, d, tcfg, sglang_version=version),
                            stage="bench", variant="base", run_id="t", inputs={},
                            out_dir=tmp_path / "b", db_path=tmp_path / "r.duckdb")
    for version in ("0.5.14", "0.5.23"):
        assert drafter_dir(ctx(version)) == d
    with pytest.raises(StageError, match="(?s)stages.bench.drafter.*E_FLAG_IGNORED"):
        drafter_dir(ctx("0.5.6"))


# ---------------------------------------------------------------------------------------------
# the bench engine: torch runs EAGLE 3.1 (tests/test_engine_vs_train.py), the fused step refuses


def test_fused_draft_step_refuses_eagle31_clearly(tmp_path):
    from engine_helpers import export_drafter, tiny_hf_llama
    from eagle3_runner.engine.speculative import engine_kernels
    from eagle3_runner.kernels import _triton
    from eagle3_runner.kernels.draft_decode import draft_forward
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.models.llama import from_hf_model
    hf = tiny_hf_llama(vocab=64, heads=2, kv=1, seed=1)  # head_dim 32: the fused tiling's
    target = from_hf_model(hf, (0, 1, 2))
    d = load_exported(export_drafter(tmp_path / "d", hf.config, (0, 1, 2), norm_output=True),
                      target.embed_tokens.weight)
    assert engine_kernels("auto", target, d) == "torch"
    if not _triton.interpreting():
        pytest.skip("kernels triton needs CUDA or TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="does not implement the drafter's norm_output"):
        engine_kernels("triton", target, d)
    with pytest.raises(ValueError, match="norm_output"):
        draft_forward(d, None, None, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1),
                      torch.zeros(1), hidden=torch.zeros(1, 1, 64), rope=(None, None),
                      kernels="triton")


def test_engine_loads_the_legacy_fc_norm_spelling(tmp_path):
    """use_aux_norm + aux_norm_low/mid/high (what SGLang 0.5.14 renames to fc_norm.0/1/2) load
    into the same drafter as fc_norm + fc_norm.{i}.weight."""
    from safetensors.torch import load_file, save_file
    from eagle3_runner.models.draft_model import load_exported
    d, _ = _export(tmp_path, fc_norm=True, sglang_version="0.5.14")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["use_aux_norm"] = cfg.pop("fc_norm")
    (legacy / "config.json").write_text(json.dumps(cfg))
    names = {"fc_norm.0": "aux_norm_low", "fc_norm.1": "aux_norm_mid", "fc_norm.2": "aux_norm_high"}
    sd = load_file(str(d / "model.safetensors"))
    for i, (new, old) in enumerate(names.items()):
        sd[new + ".weight"] = sd[new + ".weight"] + i  # tell the three apart
    save_file({next((old + k[len(new):] for new, old in names.items() if k.startswith(new)), k): v
               for k, v in sd.items()}, str(legacy / "model.safetensors"))
    a = load_exported(legacy, torch.zeros(49152, 576))
    assert a.config.fc_norm
    for i in range(3):
        assert torch.equal(a.fc_norm[i].weight, sd[f"fc_norm.{i}.weight"].float())
