"""The stage registry: every stage kind in one row (what it reads from the spec, what it needs,
how it runs), and the spec's `stages` section built from the rows.

A row says: the stage's name (its spec block `stages.<name>` and its code `jobs/<name>.py`, whose
`run(ctx) -> metrics` the executor core calls through `stage_module`), the Pydantic model of its
block (runner/spec/stage_blocks.py), the stages it needs (a function of the spec: a stage may need
different upstreams under different settings), the slice of the resolved spec that makes its
cache key, the external files it reads (their content is part of the key), whether it runs
data-parallel (executor nproc_per_node ranks) and whether a Slurm requeue resumes it from its
partial dir. Rows run in registry order. Adding a stage = its block model in
runner/spec/stage_blocks.py and one row here + jobs/<stage>.py.

Never imports torch or jobs/ (the stage code is imported by name, at run time, in
`stage_module` only).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from pydantic import Field, create_model, model_validator

from eagle3_runner.runner import carry
from eagle3_runner.runner.errors import PlanError
from eagle3_runner.runner.spec.base import Strict
from eagle3_runner.runner.spec.stage_blocks import (BenchStage, ExportStage, ExtractStage,
                                                    RegenerateStage, TrainStage)
from eagle3_runner.runner.train_counts import optimizer_steps, train_samples

# ----------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class StageKind:
    """One stage kind (see the module docstring)."""

    name: str
    params: type  # the Pydantic model of stages.<name>
    description: str  # the field's description in the spec reference
    needs: Callable[[Any], tuple[str, ...]]  # spec -> upstream stage names (when enabled)
    key: Callable[[Any, dict], dict]  # (spec, spec.model_dump(mode="json")) -> key slice
    # external inputs hashed into the key ("target", "data", "drafter" = stages.bench.drafter),
    # or spec -> those names
    files: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    data_parallel: bool = False  # runs executor.nproc_per_node ranks (one per GPU)
    checkpointable: bool = False  # a Slurm timeout/preemption requeues it; it resumes
    # whether a rerun continues what an interrupted run left in its partial dir (regenerate and
    # extract after their last complete shard, train from its checkpoint, bench from the parts
    # it measured on the same machine); export starts over, and the plan says which
    resumes: bool = False
    # the file in its partial dir that a resumed run starts from (train: the checkpoint); the
    # plan says when there is none yet, so "resuming" never hides a restart from step 0
    resume_file: Optional[str] = None
    # (spec, {upstream stage: its artifact.json}) -> why the stage cannot run on those inputs,
    # or None; runner plan calls it when the upstream is complete, run_stage before the stage
    check: Optional[Callable[[Any, dict], Optional[str]]] = None
    # spec -> the upstream stages without which it has nothing to work on (a bench without an
    # export has no drafter to measure); validate and plan refuse a spec that lacks one
    requires: Callable[[Any], tuple[str, ...]] = lambda spec: ()
    # the name of a torch-free function of the stage's module, (spec) -> None or raises a
    # RunnerError naming the fix, that validate and plan call: what this machine must have for
    # the stage to start (bench: sglang importable by stages.bench.sglang.python)
    preflight: Optional[str] = None
    # spec -> why a file the stage reads besides the target, the data and the drafter cannot be used, naming the
    # field and the fix, or None; validate and plan call it (regenerate: the carried set's
    # checksum, runner/carry.py), and the stage checks again when it runs
    file_check: Optional[Callable[[Any], Optional[str]]] = None
    # (spec, {upstream stage: its artifact.json or None} or None, stage id) -> warnings about
    # settings that are valid but do not do what they say on this stage's input (train: a batch
    # larger than its samples, a warm-up longer than its steps); validate and plan say them
    notes: Optional[Callable[[Any, Optional[dict], str], list[str]]] = None

    @property
    def module(self) -> str:
        return f"eagle3_runner.jobs.{self.name}"


def _online(spec) -> bool:
    """Whether the train stage runs the target itself (stages.train.features: online)."""
    return spec.stages.train is not None and spec.stages.train.features == "online"


# stages.train fields that say only when checkpoints are written: the weights and every output
# are the same whatever they are, so they stay out of the cache key and the run's fingerprint
# (trainer/recipe.py): changing one keeps the finished or partial run
CHECKPOINT_FIELDS = frozenset({"checkpoint_every", "checkpoint_minutes"})


def _train_key(spec, d: dict) -> dict:
    drafter = {k: v for k, v in d["drafter"].items() if k != "sglang_version"}  # serving only
    train = {k: v for k, v in d["stages"]["train"].items() if k not in CHECKPOINT_FIELDS}
    key = {"target": _target(d), "drafter": drafter, "aux_layer_ids": spec.aux_ids,
           "train": train}
    return {**key, "data": _data(d)} if _online(spec) else key


def _target(d: dict) -> dict:
    """The target fields every stage that runs the target depends on (target.engine: the
    engines' outputs agree to bf16 rounding only, so declaring another one reruns)."""
    return {k: d["target"][k] for k in ("path", "dtype", "num_hidden_layers", "hidden_size",
                                        "vocab_size", "chat_template", "engine")}


def _train_check(spec, manifests: dict) -> str | None:
    """train.num_samples must fit the extract (train would otherwise clamp it silently and a
    data-scaling sweep would get duplicate points): the extract's `samples` metric."""
    p, n = spec.stages.train, (manifests.get("extract") or {}).get("metrics", {}).get("samples")
    if not isinstance(n, int):
        return None
    avail = n - p.eval_samples
    if avail < 1:
        return (f"stages.train.eval_samples = {p.eval_samples}: the extract holds {n} samples, "
                "so none are left to train on. Lower train.eval_samples or extract more data "
                "(data.max_samples).")
    if p.num_samples is not None and p.num_samples > avail:
        return (f"stages.train.num_samples = {p.num_samples}: the extract holds {n} samples and "
                f"train.eval_samples holds out {p.eval_samples}, so {avail} are available. Set "
                f"num_samples <= {avail} (or null = all), or extract more data "
                "(data.max_samples).")
    return None


def _train_input(spec, manifests: dict | None) -> tuple[int, bool, str] | None:
    """(the samples the train stage's input holds, whether that is exact, where the count comes
    from): the extract's `samples` metric when its artifact is complete (the count _train_check
    holds num_samples to), else, when the stage that reads the data file is extract or an
    online train itself, the data's training conversations (data/conversations.py
    train_conversations: an upper bound). None when not known before the run: a regenerate
    stage's output, a data file too big to count, unreadable data (said elsewhere)."""
    n = ((manifests or {}).get("extract") or {}).get("metrics", {}).get("samples")
    if isinstance(n, int) and not _online(spec):
        return n, True, f"the extract holds {n} samples"
    if not reads_data(spec, "train" if _online(spec) else "extract"):
        return None
    n = importlib.import_module(DATA_MODULE).train_conversations(spec.data)
    if n is None:
        return None
    return n, False, (f"the data gives {n} training conversations after data.holdout"
                      f"{' and data.max_samples' if spec.data.max_samples is not None else ''}, "
                      "before the tokenizer drops any")


def _train_notes(spec, manifests: dict | None, sid: str) -> list[str]:
    """The train stage's registry `notes` (`_train_input`'s count): stages.train.batch_size
    above its training samples (each epoch is one optimizer step of fewer samples than asked),
    warmup_steps at or above its optimizer steps (the learning rate never leaves the linear
    warm-up: trainer/recipe.py lr_lambda). Said with the numbers and the fix; [] when the count
    is not known before the run."""
    p, got = spec.stages.train, _train_input(spec, manifests)
    if got is None:
        return []
    n, exact, whence = got
    n_train, most = train_samples(p, n), "" if exact else "at most "
    if n_train < 1:  # none left: _train_check refuses it
        return []
    left = f"{whence}, less train.eval_samples = {p.eval_samples}" + (
        f", at most train.num_samples = {p.num_samples}" if p.num_samples is not None else "")
    out = []
    if p.batch_size > n_train:
        out.append(f"stages.train.batch_size = {p.batch_size}: the {sid} stage trains on "
                   f"{most}{n_train} samples ({left}), so each epoch is one optimizer step of "
                   f"{most}{n_train} samples, not {p.batch_size}. Set batch_size <= {n_train}, "
                   "or train on more data (data.max_samples).")
    steps = optimizer_steps(p, n_train)
    if p.warmup_steps >= steps:
        cap = f", max_steps {p.max_steps}" if p.max_steps and steps == p.max_steps else ""
        out.append(f"stages.train.warmup_steps = {p.warmup_steps}: the {sid} stage takes "
                   f"{most}{steps} optimizer steps ({most}{n_train} samples, batch_size "
                   f"{p.batch_size}, epochs {p.epochs:g}{cap}), so the learning rate never "
                   f"leaves its warm-up: it ends at {100 * steps / (p.warmup_steps + 1):.2g}% "
                   f"of stages.train.lr. Set warmup_steps below {steps} "
                   f"(e.g. {max(1, steps // 10)}).")
    return out


def _external_drafter(spec) -> bool:
    """Whether the bench reads stages.bench.drafter (a draft directory) instead of the export."""
    return spec.stages.bench is not None and spec.stages.bench.drafter is not None


def _data(d: dict) -> dict:
    """The data fields that determine the conversations read: data.max_bad_fraction is a
    tolerance (it decides pass or fail, never the output), so it is not part of a key."""
    return {k: v for k, v in d["data"].items() if k != "max_bad_fraction"}


def _regenerate_key(spec, d: dict) -> dict:
    """A carried set that is there (stages.regenerate.reuse, runner/carry.py) is the stage's
    output: the key is its sha256 (and the shard size it is written in), whatever the target,
    data and generation settings. Grown (stages.regenerate.extend, with the set there): its
    sha256 under "extend" with the generation's inputs. Otherwise the generation's inputs,
    without `reuse` and `extend`: declaring a set that is not there yet keeps a finished
    regeneration's key (and extend: false is not in any key)."""
    regen = {k: v for k, v in d["stages"]["regenerate"].items() if k not in ("reuse", "extend")}
    if (path := carry.reuses(spec)) is not None:
        return {"reuse": {"sha256": carry.file_sha256(path)},
                "shard_conversations": regen["shard_conversations"]}
    grown = carry.extends(spec)
    return {**({"extend": {"sha256": carry.file_sha256(grown)}} if grown else {}),
            "target": _target(d), "data": _data(d), "regenerate": regen}


def _bench_key(spec, d: dict) -> dict:
    """The bench's inputs: the target (and its device), the whole stages.bench block, the data's
    holdout and seed. stages.bench.sglang.curve_parallel is left out while null (its default:
    waves of `parallel`), so a spec written before the field keeps its key; set, it is part of
    the key as `parallel` is."""
    bench = d["stages"]["bench"]
    if bench["sglang"].get("curve_parallel") is None:
        bench = {**bench, "sglang": {k: v for k, v in bench["sglang"].items()
                                     if k != "curve_parallel"}}
    return {"target": {**_target(d), "device": d["target"]["device"]}, "bench": bench,
            "data": {k: d["data"][k] for k in ("holdout", "seed")}}


REGISTRY: tuple[StageKind, ...] = (
    StageKind("regenerate", RegenerateStage, "Regenerate the training responses with the target "
              "(optional).", needs=lambda spec: (), key=_regenerate_key,
              files=lambda spec: () if carry.reuses(spec) else ("target", "data"),
              resumes=True, file_check=carry.problem),
    StageKind("extract", ExtractStage, "Capture the target's aux hidden states for training.",
              needs=lambda spec: ("regenerate",),
              key=lambda spec, d: {"target": _target(d), "data": _data(d),
                                   "aux_layer_ids": spec.aux_ids, "extract": d["stages"]["extract"]},
              files=("target", "data"), data_parallel=True, resumes=True),
    StageKind("train", TrainStage, "Train the drafter with TTT.",
              needs=lambda spec: ("regenerate",) if _online(spec) else ("extract",),
              key=_train_key, files=lambda spec: ("target", "data") if _online(spec) else (),
              data_parallel=True, checkpointable=True, resumes=True, resume_file="ckpt.pt",
              check=_train_check, notes=_train_notes),
    StageKind("export", ExportStage, "Write the SGLang draft directory.",
              needs=lambda spec: ("train", "extract"), requires=lambda spec: ("train",),
              key=lambda spec, d: {"drafter": d["drafter"], "export": d["stages"]["export"]}),
    StageKind("bench", BenchStage, "Measure accept length (tau) and tok/s.", resumes=True,
              needs=lambda spec: () if _external_drafter(spec) else ("export",),
              requires=lambda spec: () if _external_drafter(spec) else ("export",),
              preflight="check_backend",
              key=_bench_key,
              files=lambda spec: ("target", "drafter") if _external_drafter(spec) else ("target",)),
)
STAGE_ORDER = tuple(k.name for k in REGISTRY)
DATA_PARALLEL_STAGES = tuple(k.name for k in REGISTRY if k.data_parallel)
StageName = Literal[STAGE_ORDER]  # type: ignore[valid-type]


class _StagesRules(Strict):
    """The rules between stage blocks."""

    @model_validator(mode="after")
    def _online_has_no_extract(self):
        if self.train is not None and self.train.features == "online" and self.extract is not None:
            raise ValueError(
                "stages.extract: set, but stages.train.features = 'online' runs the target in the "
                "train stage, so nothing would read the extracted features. Remove stages.extract "
                "(in a variant: `stages.extract: null`), or use features: offline.")
        if self.train is not None and self.train.features == "offline" and self.extract is None:
            raise ValueError(
                "stages.train.features: 'offline' (the default) trains on the extract stage's "
                "features on disk, but stages.extract is not set. Add a stages.extract block, or "
                "set stages.train.features: online (the target runs inside the train stage).")
        return self


Stages = create_model(
    "Stages", __base__=_StagesRules, __module__=__name__,
    __doc__="Each stage is optional; present = enabled. They run in this order.",
    **{k.name: (Optional[k.params], Field(None, description=k.description)) for k in REGISTRY})


def stage_kind(name: str) -> StageKind:
    """The registry row of stage `name`. Raises PlanError for an unknown stage."""
    for k in REGISTRY:
        if k.name == name:
            return k
    raise PlanError(f"unknown stage {name}")


def enabled_stages(spec) -> list[str]:
    """The stages the spec enables (its stages.<name> block is present), in run order."""
    return [k.name for k in REGISTRY if getattr(spec.stages, k.name) is not None]


def stage_needs(spec, name: str) -> tuple[str, ...]:
    """The enabled stages that stage `name` reads the artifacts of."""
    on = enabled_stages(spec)
    return tuple(n for n in stage_kind(name).needs(spec) if n in on)


def stage_files(spec, name: str) -> tuple[str, ...]:
    """The external inputs ("target", "data", "drafter") whose content is part of stage `name`'s
    key."""
    f = stage_kind(name).files
    return f(spec) if callable(f) else f


def stage_slice(spec, name: str) -> dict:
    """The part of the resolved spec that determines stage `name`'s output (its cache key)."""
    return stage_kind(name).key(spec, spec.model_dump(mode="json"))


def stage_module(name: str):
    """The stage's code, `jobs.<name>` (imported here, at run time, and nowhere else in runner/:
    runner/ never imports jobs/ statically). Its run(ctx) returns the stage's metrics."""
    return importlib.import_module(stage_kind(name).module)


# The one reader, cleaner and verdicts of every stage's data (data/conversations.py): validate
# and plan hold the data file to them before any stage runs. data/ stands above runner/, so it is
# reached by name here, like the stage code.
DATA_MODULE = "eagle3_runner.data.conversations"


def reads_data(spec, name: str) -> bool:
    """Whether stage `name` reads the data file itself (data.path or the fetched ShareGPT): it
    lists "data" among its files and no regenerate stage feeds it (then it reads that)."""
    return "data" in stage_files(spec, name) and "regenerate" not in stage_needs(spec, name)


def data_problems(spec) -> list[str]:
    """What the stages would refuse in spec.data's file (data/conversations.py data_problems:
    no usable conversation, data.max_bad_fraction, a data.holdout that leaves nothing to train
    on), from a streamed count cached by the file's path, size and mtime. Torch-free."""
    return importlib.import_module(DATA_MODULE).data_problems(spec.data)


def stage_nproc(spec, stage: str) -> int:
    """Ranks for `stage`: executor.nproc_per_node (or executor.stages.<stage>.nproc_per_node on
    Slurm) for the data-parallel stages, else 1."""
    if stage not in DATA_PARALLEL_STAGES:
        return 1
    ex = spec.executor
    over = getattr(ex, "stages", {}).get(stage)
    if over is not None and over.nproc_per_node is not None:
        return over.nproc_per_node
    return ex.nproc_per_node
