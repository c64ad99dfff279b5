#!/usr/bin/env bash
# Stop the one-node Slurm started by scripts/slurm-up.sh: slurmd, then slurmctld, by the PIDs in
# their pid files (never by name), and remove its state folder (the mktemp -d /tmp/eagle3-slurm.*
# that slurm-up.sh made: state, spool, logs). munged is left running (harmless, and shared with
# anything else on the machine). Safe to run when nothing is up. EAGLE3_SLURM_RUN: another
# folder than /run/eagle3-slurm for the `current` pointer (tests/test_slurm.py).
set -uo pipefail
RUN="${EAGLE3_SLURM_RUN:-/run/eagle3-slurm}"
[ -f "$RUN/current" ] || { echo "slurm-down: nothing started by slurm-up.sh" >&2; exit 0; }
S="$(cat "$RUN/current")"

stop() {  # stop PIDFILE NAME
  local f="$1" pid
  [ -f "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    echo "slurm-down: stopped $2 (pid $pid)" >&2
  fi
  rm -f "$f"
}
stop "$S/slurmd.pid" slurmd
stop "$S/slurmctld.pid" slurmctld
rm -f "$RUN/current"
# only a folder slurm-up.sh made (its name), never whatever else `current` might name
case "$(basename "$S")" in
  eagle3-slurm.*) [ -d "$S" ] && rm -rf -- "$S" && echo "slurm-down: removed $S" >&2 ;;
esac
exit 0
