"""The stages' spec blocks, `stages.<name>`: one strict Pydantic model per stage (RegenerateStage,
ExtractStage, TrainStage, ExportStage, BenchStage with its SpecParams and SglangOptions), each with
its own field rules.

The registry (runner/stages.py) names each block in its stage's row and builds the `stages`
section from them, in run order, with the rules between blocks; the rules that span the whole
spec: runner/spec/schema.py. The SGLang facts a block checks (the draft-token bound) come from
runner/drafts/checks.py; the server flags and host: runner/spec/server.py. No torch.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from eagle3_runner.runner.drafts.checks import chain_draft_tokens, spec_draft_tokens_problem
from eagle3_runner.runner.spec.base import Strict
from eagle3_runner.runner.spec.server import (MIN_PORT, extra_args_problems, host_problem,
                                               ports_problem)


class RegenerateStage(Strict):
    """Replace assistant turns with the target's own responses (EAGLE-3's recipe)."""

    max_new_tokens: int = Field(512, ge=1, description="Tokens per regenerated turn.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling when temperature > 0.")
    batch_size: int = Field(8, ge=1, description="Sequences in flight (rows of the continuous "
                            "batch; a finished row takes the next prompt). E.g. 512 on an H200.")
    max_turns: Optional[int] = Field(None, ge=1, description="Regenerate only the first N "
                                     "answers (assistant turns) of each conversation and drop "
                                     "the rest (counted); null = every one, each conditioned on "
                                     "the target's own earlier answers. System, user and tool "
                                     "turns and tool calls stay as context.")
    seed: int = Field(0, description="Sampling seed (per conversation and turn).")
    max_minutes: Optional[float] = Field(None, gt=0, description=(
        "A time budget for the stage's generation (synthetic prompts, then answers; synthesis "
        "gets the share its prompts cost of all the work, at most half): once it has passed no "
        "new request starts; conversations in flight keep their answered turns "
        "(cut_time_budget), those never started are counted (dropped_time_budget). With a "
        "budget conversations start in a seeded shuffled order, so what fits is a uniform "
        "sample; null = everything, longest first."))
    synthetic_prompts: int = Field(0, ge=0, description="Also answer N user turns the target "
                                   "writes itself from its chat template's user-turn prefix "
                                   "(Magpie); degenerate and duplicate ones are dropped, counted.")
    synthetic_temperature: float = Field(1.0, gt=0, description="Sampling temperature of the "
                                         "synthetic user turns (> 0: greedy would write one).")
    synthetic_top_p: float = Field(1.0, gt=0, le=1, description="Nucleus of the synthetic user "
                                   "turns.")
    synthetic_max_tokens: int = Field(128, ge=1, description="Tokens per synthetic user turn; "
                                      "one that does not end by then is dropped (no_eos).")
    shard_conversations: int = Field(1024, ge=1, description="Conversations per output shard "
                                     "(gzip JSONL; a killed run resumes after the last shard).")
    cuda_graph: bool = Field(True, description="CUDA graphs for the decode step (CUDA only).")
    kernels: Literal["auto", "triton", "torch"] = Field(
        "torch", description="Decode attention: triton = kernels.attention (reads each row's own "
        "length), torch = SDPA over the longest live row, auto = torch (triton is opt-in).")
    reuse: Optional[str] = Field(None, description=(
        "A regenerated set carried from an earlier GPU window (runner/carry.py): a run's shards "
        "concatenated into one gzip JSONL file (e.g. regen-NAME.jsonl.gz) with its sha256sum "
        "sidecar PATH.sha256 next to it. When the file is there, its sha256 must be the "
        "sidecar's (validate, plan and the stage refuse a missing sidecar or a mismatch) and "
        "the stage writes its records as its output without running the target; its cache key "
        "is then the file's sha256 (another set reruns what reads it). When it is not there, "
        "the stage regenerates, with the key it has without this field. A second sidecar, "
        "PATH.json (the state record of the run that made the set), names its target: a set "
        "another target generated is refused (docs/data.md). Relative = relative to the spec "
        "file's folder; ${VAR} expanded. With extend: true the set is grown, not just reused."))
    extend: bool = Field(False, description=(
        "Grow the carried set of `reuse` instead of only reusing it (docs/data.md): when the "
        "file is there, the stage writes its records as its shards, then regenerates, within "
        "max_minutes, what the set does not hold: the real conversations it has no record of "
        "(and those its own run never started, dropped_time_budget) and synthetic_prompts NEW "
        "self-written prompts (numbered after the set's highest synthetic index, seeded by that "
        "index, none equal to a carried prompt), and the later turns of carried conversations: "
        "a carried real conversation whose conversation in the data has more answers to write "
        "(up to max_turns) is continued turn by turn, its record's messages (the target's own "
        "earlier answers) as the context; it is matched by id (real-NNNNNN, the index in the "
        "training split) and continued only where its turns are the data's (carried_continued, "
        "carried_answers_added, carried_unlike_data). The output is the union; it runs the "
        "target, and its key is the set's sha256 with the generation settings. When the file is "
        "not there, the stage regenerates as without it (the same key). Needs reuse."))

    @model_validator(mode="after")
    def _extend_needs_reuse(self):
        if self.extend and self.reuse is None:
            raise ValueError("stages.regenerate.extend: true grows the carried set of "
                             "stages.regenerate.reuse, which is not set. Set "
                             "stages.regenerate.reuse to the carried file (regen-NAME.jsonl.gz), "
                             "or remove stages.regenerate.extend.")
        return self


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
    max_minutes: Optional[float] = Field(None, gt=0, description=(
        "A time budget for the optimizer steps (eval and checkpoints excluded): once the step "
        "time is measured (after the first 64 steps, compilation included in them), the run's "
        "step count shrinks to what fits, and the cosine schedule with it; train_metrics.json "
        "records the steps run and train_samples counts only the samples trained on."))
    batch_size: int = Field(4, ge=1, description="Samples per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup, then cosine decay to 0.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    init_head: Literal["target", "random"] = Field("random", description=(
        "How the drafter's lm_head and final norm start: random = nn.Linear's default init and "
        "a unit norm; target = copies of the target's lm_head rows of the draft vocab and its "
        "final norm (as vLLM speculators does). On the demo target and data (206 samples, 52 "
        "steps) target started at 1.8x the eval loss and ended behind random (eval acc_0 0.142 "
        "against 0.158)."))
    grad_clip: float = Field(0.5, gt=0, description="Max global grad norm.")
    eval_every: int = Field(50, ge=1, description="Steps between evaluations (logged to DuckDB).")
    eval_samples: int = Field(8, ge=0, description="Held-out extracted samples for evaluation.")
    checkpoint_every: int = Field(100, ge=1, description="Steps between checkpoints. Not part "
                                  "of the cache key: changing it keeps the partial run.")
    checkpoint_minutes: Optional[float] = Field(10.0, gt=0, description=(
        "Minutes of training between checkpoints, as well as every checkpoint_every steps: an "
        "interrupted run (Ctrl-C, a killed job) loses at most this much; null = steps only. "
        "(Data parallel: checked at the host syncs, every 32 steps.) Not part of the cache key: "
        "changing it keeps the partial run."))
    seed: int = Field(0, description="Initialisation and shuffling seed.")
    kernels: Literal["auto", "triton", "flex", "torch", "reference"] = Field("auto", description=(
        "The training step: auto = triton on CUDA, torch on CPU; triton = the fast step with "
        "Triton TTT attention and the fused soft CE (kernels/); flex = flex_attention instead of "
        "the Triton attention; torch = the fast step (packing, draft-vocab logits) on PyTorch "
        "references; reference = the plain K-step objective (trainer/objective.py), the slow baseline."))
    loss: Literal["kl", "lk_lambda", "lk_alpha"] = Field("kl", description=(
        "The per-step loss of the TTT unroll, each step weighted step_decay^j "
        "(docs/training-options.md): kl = forward KL to the target's distribution over the "
        "draft vocab (soft cross-entropy; SpecForge's and EAGLE-3's loss); lk_lambda = "
        "lambda x KL + (1 - lambda) x (1 - alpha), alpha = sum_v min(p_v, q_v) the expected "
        "acceptance with the target's full-vocab probabilities, lambda = exp(-lk_eta x the "
        "step's mean alpha); lk_alpha = -log(alpha). LK losses: arXiv 2602.23881."))
    lk_eta: float = Field(3.0, gt=0, le=100, description=(
        "eta of loss lk_lambda (lambda = exp(-eta x mean alpha)); 3 is the LK paper's best "
        "value (arXiv 2602.23881), also speculators' and TorchSpec's default. Read only with "
        "loss: lk_lambda."))
    noise_std: float = Field(0.0, ge=0, description=(
        "Uniform noise in [-noise_std, +noise_std) added to the aux hidden states before fc "
        "(and fc_norm), on training batches only (vLLM speculators' --noise-std, its default "
        "0.05; the value is a half-width, not a standard deviation). 0 = off."))
    features: Literal["offline", "online"] = Field("offline", description=(
        "Where the aux hidden states come from. offline = the extract stage's features on disk "
        "((3 aux + 1 last) x hidden x dtype bytes per token: `runner plan` estimates them); "
        "online = the train stage runs the target itself on each batch (each data-parallel "
        "rank its own copy) and writes nothing but checkpoints and the drafter; the spec then "
        "has no stages.extract."))
    online_capture: Literal["hf", "embedded"] = Field("hf", description=(
        "How the train stage runs the target with features: online. hf = transformers' forward "
        "over right-padded length groups with hooks on the aux layers (extract's capture); "
        "embedded = our own Llama forward (models/llama.py) over the batch packed into one row "
        "without padding, each layer one compiled graph on CUDA: for a plain Llama target on one "
        "device (no target.device_map); the same features up to float rounding."))
    prefetch: bool = Field(False, description=(
        "With features: online on CUDA: the next step's target forward runs on a second CUDA "
        "stream while this step trains (the same batches and results, overlapped)."))
    snapshots: bool = Field(False, description=(
        "Keep the drafter of every evaluation (snapshots/step-NNNNNN.safetensors in the train "
        "artifact; export writes each as an SGLang draft under snapshots/, and stages.bench.curve "
        "benches them): the learning curve, tau against optimizer steps and samples. ~4 bytes "
        "per drafter parameter each (SmolLM2: 47 MB)."))
    select: Literal["last", "tau"] = Field("last", description=(
        "Which drafter the stage outputs. last = the final step's; tau = the evaluation (every "
        "eval_every steps and the last) whose simulated greedy chain of select_num_steps draft "
        "steps has the highest tau on the held-out samples (trainer/acceptance.py: exact on the "
        "target's own greedy text, so use it on data regenerated at temperature 0, with "
        "eval_samples > 0). EAGLE-3 drafters can peak before the end while the loss still falls "
        "(DeepSpec #84); neither the last step nor the lowest loss is the best tau. Needs "
        "snapshots: true."))
    select_num_steps: int = Field(3, ge=1, le=16, description=(
        "The chain length (SGLang --speculative-num-steps) whose simulated tau select: tau "
        "compares; at most ttt_steps (read only with select: tau)."))

    @model_validator(mode="after")
    def _selection(self):
        if self.select == "tau" and not self.snapshots:
            raise ValueError("stages.train.select: tau picks among the kept evaluations; set "
                             "stages.train.snapshots: true as well.")
        if self.select == "tau" and self.eval_samples == 0:
            raise ValueError("stages.train.select: tau needs held-out samples to simulate on; "
                             "set stages.train.eval_samples (e.g. 256), or select: last.")
        if self.select == "tau" and self.select_num_steps > self.ttt_steps:
            raise ValueError(f"stages.train.select_num_steps = {self.select_num_steps} exceeds "
                             f"ttt_steps = {self.ttt_steps}: the chain can only be simulated "
                             "for the trained steps. Lower it or raise ttt_steps.")
        return self

    @model_validator(mode="after")
    def _online_options(self):
        for name, off in (("online_capture", "hf"), ("prefetch", False)):
            if self.features != "online" and getattr(self, name) != off:
                raise ValueError(f"stages.train.{name}: set, but it applies to features: online "
                                 f"only (this spec trains offline). Remove it, or set features: "
                                 "online.")
        return self


class ExportStage(Strict):
    """Write the SGLang draft directory (config.json + model.safetensors)."""

    speculators: bool = Field(False, description="Also write a speculators-format copy.")


class SpecParams(Strict):
    """One SGLang speculative configuration (names as in sglang.launch_server)."""

    num_steps: int = Field(..., ge=1, description="--speculative-num-steps: draft chain depth.")
    eagle_topk: int = Field(1, ge=1, description="--speculative-eagle-topk: branching per step.")
    num_draft_tokens: Optional[int] = Field(None, ge=2, description="--speculative-num-draft-tokens;"
                                            " default num_steps+1 (required when topk > 1); at "
                                            "most 1 + topk + (num_steps - 1) x topk^2.")

    @model_validator(mode="after")
    def _consistent(self):
        problem = spec_draft_tokens_problem(self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def draft_tokens(self) -> int:
        return self.num_draft_tokens or chain_draft_tokens(self.num_steps)


class SglangOptions(Strict):
    """How the sglang backend launches servers."""

    python: str = Field("python3", description="Interpreter that has sglang installed: a name "
                        "on PATH or a path (~ and ${VAR} expanded), e.g. a wrapper that sets "
                        "PYTHONPATH to sglang's own folder (DEVELOPERS.md).")
    host: str = Field("127.0.0.1", description="Bind address: loopback only (127.0.0.1, ::1, "
                      "localhost).")
    port: Optional[int] = Field(None, ge=MIN_PORT, le=65000, description="First port: each server "
                                "takes two consecutive ones (HTTP, --nccl-port) from it, every "
                                "HTTP port at most 55535 (SGLang 0.5.14 takes HTTP + 10000 as "
                                "its gRPC port and refuses one past 65535); null = free ports "
                                "picked per server, at most 55535.")
    tp: int = Field(1, ge=1, description="--tp-size.")
    parallel: int = Field(1, ge=1, description=(
        "Timed servers (the plain one and the configurations) started at once on the GPU(s). "
        "Each decodes alone, one after another, but its tok/s is measured beside the wave's "
        "other servers, and idle ones still cost CPU (their scheduler, tokenizer and "
        "detokenizer processes; a small target's batch-1 decode is CPU-bound): on the H100 of "
        "2026-12-07 (SmolLM2-135M, SGLang 0.5.14) 7 idle neighbours instead of 1 made plain "
        "16% and 3/1/4 28% slower. For timing use 1-2, and curve_parallel to start the "
        "curve's tau-only servers together. Above 1, set mem_fraction_static and a "
        "--max-total-tokens in extra_args so that they fit together."))
    curve_parallel: Optional[int] = Field(None, ge=1, description=(
        "Learning-curve servers (stages.bench.curve's snapshot drafters: tau only, which no "
        "neighbour changes) started at once, in waves of their own after the timed servers; "
        "null = parallel. They must fit together as parallel's do."))
    mem_fraction_static: Optional[float] = Field(None, gt=0, lt=1, description="--mem-fraction-"
                                                 "static of every server; null = SGLang's "
                                                 "choice (most of the GPU: one server at a time).")
    startup_timeout_s: float = Field(900, gt=0, description="Seconds from a server's launch to "
                                     "ready; past it the server is stopped and its "
                                     "configuration recorded as failed.")
    request_timeout_s: float = Field(600, gt=0, description="Per-request timeout.")
    cuda_graph_max_bs: Optional[int] = Field(None, ge=1, description="--cuda-graph-max-bs.")
    extra_args: list[str] = Field(default_factory=list, description="Extra server argv items "
                                  "(appended last); flags the runner sets itself are refused.")

    @model_validator(mode="after")
    def _guards(self):
        problems = extra_args_problems(self.extra_args)
        if (bad := host_problem(self.host)) is not None:
            problems.append(bad)
        # the widest wave takes the most ports: the timed one or the curve's
        widest = max((self.parallel, "parallel"), (self.curve_parallel or 0, "curve_parallel"))
        if (bad := ports_problem(self.port, *widest)) is not None:
            problems.append(bad)
        if problems:
            raise ValueError("\n".join(problems))
        return self


# prompts in each fixed bench set (data/prompts.py reads them; sharegpt has data.holdout)
PROMPT_SET_SIZES = {"mtbench": 80, "humaneval": 164}


class BenchStage(Strict):
    """Measure tau and tok/s against a no-speculation baseline in the same run."""

    backend: Literal["embedded", "sglang", "both"] = Field(
        "embedded", description="embedded = our PyTorch engine; sglang = real SGLang servers "
        "(stages.bench.sglang); both = the two on the same prompts in one stage, SGLang's plain "
        "greedy output compared with ours (view bench_parity).")
    prompt_sets: list[Literal["mtbench", "humaneval", "sharegpt"]] = Field(
        default_factory=lambda: ["mtbench"], min_length=1,
        description="Prompt sets; sharegpt = data.holdout.")
    num_prompts: Optional[int] = Field(None, ge=1, description="First N prompts per set; null=all.")
    max_new_tokens: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [128], min_length=1, description="Sweep axis (each >= 1).")
    temperature: float = Field(0.0, ge=0, description="0 = greedy (lossless check applies).")
    configs: list[SpecParams] = Field(default_factory=lambda: [SpecParams(num_steps=3)], min_length=1,
                                      description="Speculative configurations (sweep axis).")
    cuda_graph: list[bool] = Field(default_factory=lambda: [False], min_length=1,
                                   description="CUDA graphs on/off (sweep axis; GPU only).")
    kernels: Literal["auto", "triton", "torch"] = Field(
        "auto", description="embedded: the engine's decode/verify forwards and chain draft steps; "
        "triton = the fused kernels (kernels/; opt-in), torch = the models' PyTorch forward "
        "(CUDA-graphed under cuda_graph), auto = torch on every device (on the H200 a 1-row "
        "decode measured 1.79 ms fused vs 1.37 ms torch). Recorded per bench row.")
    context_length: Optional[int] = Field(None, ge=1, description="Serving context; the drafter's "
                                          "max_position_embeddings must cover it. Default = target's.")
    seed: int = Field(0, description="Sampling seed.")
    speed_profile: Optional[str] = Field(None, description="An SGLang round-cost profile "
                                         "(sglang_profile.json of a bench with backend sglang or "
                                         "both): the embedded rows then also report the speedup "
                                         "and break-even tau SGLang would give (predicted_*). "
                                         "Default with backend both: the profile this stage "
                                         "measures.")
    drafter: Optional[str] = Field(None, description=(
        "Bench this SGLang draft directory (config.json + model.safetensors, e.g. "
        "scripts/bench/specforge_peer.py's output) instead of the export stage's: the bench "
        "then needs no export, inspects the directory first (for drafter.sglang_version) and "
        "its content is part of the bench's cache key. Its eagle_config ids must be the spec's "
        "aux ids. Relative = relative to the spec file's folder."))
    curve: int = Field(0, ge=0, description=(
        "The learning curve: bench this many of the train stage's kept drafters "
        "(stages.train.snapshots: true), evenly spaced by step and always with the exported one, "
        "at the first configuration (a chain: eagle_topk 1): the embedded side simulates greedy "
        "chain decoding on this stage's own plain decode (trainer/acceptance.py: exact for chains "
        "up to bf16 rounding), an SGLang backend serves each and measures its tau (decoded side "
        "by side: tau only). Rows: table bench_curve; `runner report` draws tau against steps "
        "and samples. 0 = off."))
    sglang: SglangOptions = Field(default_factory=SglangOptions, description="sglang backend only.")
