"""The spec schema: the whole spec (`Spec`: its sections and derived geometry) and the
cross-field rules between its sections (`Spec._cross_checks`), with the spec's paths
(`PATH_FIELDS`).

Each section validates itself in runner/spec/sections.py (target, drafter, data, executor,
results, variants); the stages' blocks come from the stage registry, runner/stages.py (their
models: runner/spec/stage_blocks.py). Cross-field rules encode the silent failures seen when
EAGLE-3 drafters are served by SGLang (docs/eagle3-format.md); the SGLang facts themselves (the
algorithm name, aux-id conventions and range, the draft-token bound) are stated once in
runner/drafts/. Loading YAML and overrides: runner/spec/load.py. No torch.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from eagle3_runner.runner.drafts.checks import (default_aux_ids, draft_vocab_null_problem,
                                                spec_aux_problems, spec_version_problems)
from eagle3_runner.runner.drafts.layout import ALGORITHM, AUX_COUNT
from eagle3_runner.runner.engines import choose_engine
from eagle3_runner.runner.errors import EnvVarError
from eagle3_runner.runner.files import expand_path, expand_vars
from eagle3_runner.runner.placement import layer_devices
from eagle3_runner.runner.spec.base import MAX_NAME, NAME_PATTERN, Strict
from eagle3_runner.runner.spec.sections import (Data, Drafter, Executor, LocalExecutor, Results,
                                                Target, Variant)
from eagle3_runner.runner.stages import STAGE_ORDER, Stages


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
                f"target.path = {t.path!r}{_expanded(t.path)}: no such file or folder, so the "
                f"target's geometry ({', '.join(missing)}) is unknown. Fix the path (`runner "
                "fetch all` fetches the demo assets), or declare those fields in the spec.")
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


def _expanded(path: str) -> str:
    """" (= /the/path/looked/at)" when expanding ~ or ${VAR} changed `path`, else ""."""
    try:
        full = str(expand_path(path))
    except (EnvVarError, OSError, ValueError):
        return ""
    return "" if full == path else f" (= {full})"


def _exists(path: str) -> bool:
    """Whether target.path names something on disk (True when it cannot tell: an unset ${VAR}
    is reported by its own check)."""
    try:
        return expand_path(path).exists()
    except (EnvVarError, OSError, ValueError):
        return True
