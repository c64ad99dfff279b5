"""The `slurm` executor: one submitit job per stage, afterok dependencies, arrays for sweeps.

Modules: sbatch.py (spec -> sbatch parameters, preflight checks, sbatch's rejections), probes.py
(squeue/sinfo/sacct/scancel with timeouts), task.py (the checkpointable callable each Slurm job
runs), executor.py (submitting and following a plan's jobs), cancel.py (`runner cancel`, the
submitted-jobs log).

Mapping (spec -> sbatch, through submitit.SlurmExecutor):
  executor.partition -> --partition     gpus_per_node -> --gpus-per-node (omitted when 0)
  cpus_per_task      -> --cpus-per-task mem_gb        -> --mem=<N>GB
  timeout_min        -> --time          account/qos/constraint -> --account/--qos/--constraint
  extra_sbatch       -> allowlisted options (runner/spec/sections.py SBATCH_ALLOWLIST), verbatim
  executor.stages.<stage> overrides gpus_per_node/cpus_per_task/mem_gb/timeout_min per stage.
  nproc_per_node     -> --ntasks-per-node for extract/train (1 for the other stages): ONE job
                        whose srun starts one task per rank (srun --kill-on-bad-exit=1, so a
                        failed rank stops its peers); each task joins the process group
                        (runner/launch.py run_rank: SLURM_PROCID, SLURM_LOCALID -> GPU) and
                        rank 0 finalizes. cpus_per_task is per task.

Scheduling: jobs are submitted in plan order. Jobs of the same stage with the same resources and
the same topological depth (e.g. `bench` for every variant of a sweep) go out as ONE job array.
A job waits for its upstream jobs with Slurm `afterok` (`aftercorr` when the upstream is an
array in the same task order). When an upstream fails, its dependents are scancelled and
reported as skipped (Slurm would otherwise leave them pending forever).

Following: a job is finished when submitit's result pickle exists or when Slurm reports a
terminal state (`squeue -t all`, then `sacct`), so a cluster without accounting still works.
Failures bring back the remote traceback (submitit FailedJobError) and the job's stderr log.

Checkpointing: every stage runs through `StageTask`, a submitit checkpointable callable. On
timeout or preemption (Slurm sends USR2 `signal_delay_s` before the limit), a checkpointable
stage (a registry row with checkpointable: train) is requeued with the same StageJob and resumes
from the checkpoints in its partial dir; other stages are not requeued (they fail with submitit's "not requeued" message).

Submitted job ids are appended to <log_dir>/jobs.jsonl (default work_dir/slurm/) for
`runner cancel SPEC` and `runner status`.
"""
