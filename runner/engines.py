"""Which engine runs the target in each stage (target.engine): the ONE rule and its reason, for
`runner plan` (its `engine:` lines) and for the stages themselves, which call it with the same
inputs (the spec and the target's config), so a stage runs what the plan printed. No torch.

Roles (`stage_role`): regenerate GENERATEs (the embedded engine, engine/generate.py, or an SGLang
server's /generate); extract and the online train stage CAPTURE (transformers with forward hooks,
targets/capture.py, or an SGLang capture server, targets/sglang_target.py). Engines:
- embedded: generate on our Llama (Llama targets only); capture through transformers (extract
  has no embedded capture; online training's is chosen by stages.train.online_capture, which
  applies to either local engine and never beside SGLang).
- hf: capture through transformers; there is no HF generation path (refused for regenerate).
- sglang: an SGLang server for every stage that runs the target (target.sglang: launched on the
  stage's GPUs with tp/ep/dp, or `server`, a URL of one you run).
- auto: `server` given -> sglang everywhere (you already pay for that server). Else, with
  target.sglang declared (SGLang is available), sglang except for a SMALL Llama target on ONE GPU,
  which keeps embedded/hf; without target.sglang, embedded/hf, and a regenerate of a target that is
  not a Llama is refused (only SGLang can run it).
"Small" is the measurement behind auto (EMBEDDED_MAX_B; BENCHMARKS.md, SGLang 0.5.14 on the H200,
SmolLM2-135M: SGLang regenerated 54.0k new tok/s end to end against our stage's 56.1k; the JSON
capture transport costs ~13-20 bytes per float). The lead's device run of scripts/gpu/sglang_target.sh
decides whether these stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_runner.runner import carry
from eagle3_runner.runner.errors import RunnerError
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.target_config import read_target_config
from eagle3_runner.runner.target_size import parameter_groups

GENERATE, CAPTURE = "generate", "capture"
EMBEDDED, HF, SGLANG = "embedded", "hf", "sglang"
# the largest target (billions of parameters) auto keeps on the embedded engine / transformers:
# measured only on SmolLM2-135M so far (module docstring)
EMBEDDED_MAX_B = 1.0
LLAMA_ARCHS = ("LlamaForCausalLM",)  # what models/llama.py from_hf_model loads


@dataclass(frozen=True)
class Choice:
    """engine: "embedded" | "hf" | "sglang"; why: one sentence for the plan."""

    engine: str
    why: str


def stage_role(spec, stage: str) -> str | None:
    """GENERATE (regenerate), CAPTURE (extract, train with features: online) or None (the stage
    does not run the target: train offline, export, bench, and a regenerate that reuses a
    carried set that is there without extending it, runner/carry.py)."""
    if stage == "regenerate":
        return None if carry.reuses(spec) else GENERATE
    if stage == "extract" or (stage == "train" and spec.stages.train is not None
                              and spec.stages.train.features == "online"):
        return CAPTURE
    return None


def llama_target(spec, cfg: dict | None) -> bool | None:
    """Whether the target is a Llama our engine loads: config.json `architectures`, else its
    `model_type` (a GGUF's general.architecture); False for a known non-standard family
    (target.family); None = unknown (no config here, or one that names neither)."""
    archs = [a for a in (cfg or {}).get("architectures") or [] if isinstance(a, str)]
    if archs:
        return any(a in LLAMA_ARCHS for a in archs)
    if (cfg or {}).get("model_type"):
        return cfg["model_type"] == "llama"
    if spec.target.family not in (None, "standard"):
        return False
    return None


def target_params_b(spec, cfg: dict | None) -> float | None:
    """The target's parameters in billions: target.num_parameters_b, else counted from its config
    (runner/target_size.py), else None."""
    if spec.target.num_parameters_b is not None:
        return spec.target.num_parameters_b
    if not cfg:
        return None
    try:
        return sum(parameter_groups(cfg).values()) / 1e9
    except (ValueError, TypeError, KeyError):
        return None


def target_cfg(spec) -> dict | None:
    """The target's config.json / GGUF geometry, or None when it cannot be read here (a Slurm
    login node without the weights: the spec's declared sizes count). What the plan and the
    stages pass to choose_engine and the memory estimate."""
    try:
        return read_target_config(expand_path(spec.target.path))
    except (OSError, RunnerError):
        return None


def stage_engine(spec, stage: str) -> Choice | None:
    """choose_engine for a stage about to run, on the same inputs as the plan's (target_cfg).
    Raises ValueError as choose_engine does."""
    return choose_engine(spec, stage, target_cfg(spec))


def choose_engine(spec, stage: str, cfg: dict | None = None) -> Choice | None:
    """The engine of `stage` (module docstring) and why; None when the stage does not run the
    target. cfg: the target's config dict when readable here (runner/target_config.py), else None.
    Raises ValueError naming target.engine / target.sglang and the fix when the declared engine
    cannot run that stage."""
    role = stage_role(spec, stage)
    if role is None:
        return None
    choice = _choose(spec, stage, role, cfg)
    if stage == "train" and spec.stages.train.online_capture == EMBEDDED:
        if choice.engine == SGLANG:
            raise ValueError("stages.train.online_capture = 'embedded' runs the target on our "
                             "Llama in the train stage, but target.engine puts it on SGLang ("
                             f"{choice.why}); remove online_capture or set target.engine: hf")
        return Choice(EMBEDDED, choice.why + "; stages.train.online_capture: embedded (our "
                                             "Llama, the batch packed into one row)")
    return choice


def _choose(spec, stage: str, role: str, cfg: dict | None) -> Choice:
    """choose_engine's rule for a stage that runs the target (module docstring)."""
    t, declared = spec.target, spec.target.engine
    llama = llama_target(spec, cfg)
    if declared == SGLANG:
        return Choice(SGLANG, "target.engine: sglang")
    if declared == HF:
        if role == GENERATE:
            raise ValueError("target.engine = 'hf': there is no transformers generation path for "
                             f"stage {stage} (the embedded engine replaced it); use embedded "
                             "(Llama targets) or sglang")
        return Choice(HF, "target.engine: hf")
    if declared == EMBEDDED:
        if role == CAPTURE:
            return Choice(HF, "target.engine: embedded (captures through transformers; online "
                              "training's embedded capture is stages.train.online_capture)")
        if llama is False:
            raise ValueError(f"target.engine = 'embedded': stage {stage} runs the target on our "
                             "Llama, and this target is not one; use sglang (target.sglang)")
        return Choice(EMBEDDED, "target.engine: embedded")
    # auto
    local = EMBEDDED if role == GENERATE else HF
    if t.sglang is not None and t.sglang.server is not None:
        return Choice(SGLANG, f"auto: target.sglang.server {t.sglang.server} is running")
    size = target_params_b(spec, cfg)
    small = size is None or size <= EMBEDDED_MAX_B
    one_gpu = (t.sglang is None or t.sglang.gpus == 1) and t.device_map is None
    what = ("a target" if size is None else
            f"a {size:,.0f}B-parameter target" if size >= 10 else
            f"a {size:.2f}B-parameter target") + \
        {True: ", a Llama", False: " that is not a Llama", None: ""}[llama]
    if t.sglang is not None:
        if llama is not False and small and one_gpu:
            return Choice(local, f"auto: {what}, small (<= {EMBEDDED_MAX_B:g}B) on one GPU: the "
                                 f"{'embedded engine' if local == EMBEDDED else 'transformers'} "
                                 "path, as measured")
        return Choice(SGLANG, f"auto: {what}" + ("" if small else f", over {EMBEDDED_MAX_B:g}B")
                      + (f", on {t.sglang.gpus} GPUs (tp x dp)" if t.sglang.gpus > 1 else "")
                      + ": the SGLang server of target.sglang")
    if role == GENERATE and llama is False:
        raise ValueError(f"target.engine = 'auto': stage {stage} of a target that is not a Llama "
                         "needs SGLang (the embedded engine runs Llama only); add target.sglang "
                         "(e.g. {tp: 8}) or target.sglang.server: URL of a server you run")
    return Choice(local, f"auto: no target.sglang, so the "
                         f"{'embedded engine' if local == EMBEDDED else 'transformers path'}")


# ----------------------------------------------------------------------------------------------
# is SGLang there? (plan time, and when a stage starts)


def get_json(url: str, timeout: float = 5.0):
    """GET url -> the decoded JSON. Raises OSError (unreachable, HTTP error) or ValueError (not
    JSON)."""
    import json
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def sglang_version(python: str, timeout: float = 30.0) -> tuple[str | None, str]:
    """(the sglang version `python` has installed, or None; why not). Reads the distribution's
    metadata (importlib.metadata), which is instant: importing sglang takes ~25 s on the H200."""
    import subprocess
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, timeout=timeout, text=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot run {python}: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} has no sglang ({last})"
    return r.stdout.strip(), ""


def server_info_problems(model_info: dict, server_info: dict, spec, role: str,
                         where: str, check_path: bool = True) -> list[str]:
    """What is wrong with a running server for `role` (GENERATE / CAPTURE), from its
    /model_info and /server_info answers (SGLang 0.5.14 http_server.py: /server_info holds every
    ServerArgs field and "version"): another target (check_path: the model path's last part
    against target.path's; a server the runner launched was given the target itself), another
    SGLang version than target.sglang.version, a speculative server, and for capture the
    settings that keep the captured rows aligned (radix cache off, no chunked prefill, hidden
    states on for the json transport)."""
    out = []
    want = spec.target.sglang_options.version
    have = server_info.get("version")
    if want and have != want:
        out.append(f"{where} runs SGLang {have}, target.sglang.version is {want}")
    path = str(model_info.get("model_path") or "").rstrip("/")
    tgt = str(spec.target.path).rstrip("/")
    if check_path and path and path.rsplit("/", 1)[-1] != tgt.rsplit("/", 1)[-1]:
        out.append(f"{where} serves {path}, the spec's target is {spec.target.path}")
    if server_info.get("speculative_algorithm"):
        out.append(f"{where} speculates ({server_info['speculative_algorithm']}): a target "
                   "server must run the plain target")
    if role == CAPTURE:
        if not server_info.get("enable_return_hidden_states") and \
                spec.target.sglang_options.capture_transport == "json":
            out.append(f"{where} was started without --enable-return-hidden-states")
        if not server_info.get("disable_radix_cache"):
            out.append(f"{where} has the radix cache on: a prefix hit returns rows of other "
                       "requests (start it with --disable-radix-cache)")
        chunk = server_info.get("chunked_prefill_size")
        if chunk not in (None, -1) and chunk < spec.data.max_length:
            out.append(f"{where} chunks prefills at {chunk} tokens < data.max_length "
                       f"{spec.data.max_length}: a chunked prompt misaligns the captured rows "
                       "(start it with --chunked-prefill-size -1)")
    return out


def check_sglang(spec, role: str, timeout: float = 10.0) -> list[str]:
    """Plan-time problems of the SGLang a stage of `role` would use: for target.sglang.server,
    that it answers /model_info and /server_info and serves this target as `role` needs
    (server_info_problems); for a launched server, that target.sglang.python has sglang (at
    target.sglang.version when declared). Each message names the field to fix."""
    o = spec.target.sglang_options
    if o.server is not None:
        base = o.server.rstrip("/")
        try:
            mi, si = get_json(base + "/model_info", timeout), get_json(base + "/server_info",
                                                                        timeout)
        except (OSError, ValueError) as e:
            return [f"target.sglang.server = {o.server}: no SGLang answers there ({e}); start "
                    "it, fix the URL, or leave server out to launch one"]
        return [f"target.sglang.server: {p}" for p in
                server_info_problems(mi, si, spec, role, o.server)]
    version, why = sglang_version(o.python)
    if version is None:
        return [f"target.sglang.python: {why}; install sglang there (pip install "
                "'eagle3-runner[sglang]') or point python at an interpreter that has it"]
    if o.version and version != o.version:
        return [f"target.sglang.python = {o.python} has sglang {version}, target.sglang.version "
                f"is {o.version}"]
    return []
