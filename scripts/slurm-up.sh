#!/usr/bin/env bash
# Start a real one-node Slurm cluster on this machine (tests and CI), as root, without systemd.
#
#   sudo bash scripts/slurm-up.sh      # ~10 s (plus the apt install the first time)
#   bash scripts/slurm-down.sh         # stops the daemons by their PID files
#
# Debian 12 packages: munge slurmctld slurmd slurm-client (Slurm 22.05), no recommends (the
# slurm-wlm metapackage pulls 40+ packages). State, spool, pid and log files live in a FRESH
# temporary dir per start (job ids restart at 1), named in /run/eagle3-slurm/current;
# slurm-down.sh removes it.
#
# Accounting: none. submitit follows jobs through `sacct`, which fails without slurmdbd; tests put
# scripts/sacct-shim/ first on PATH (a stand-in answering from `squeue -t all`), and the runner
# also checks `squeue` itself. A real cluster needs slurmdbd accounting (AccountingStorageType=
# accounting_storage/slurmdbd) so `sacct` answers; see the README.
#
# Idempotent: when the cluster started by this script already answers, it exits 0 at once.
# Every probe has a timeout (sinfo/squeue hang for minutes when no controller answers).
set -euo pipefail
# the daemons live in /usr/sbin, which a minimal PATH (env -i, some CI images) lacks
export PATH="$PATH:/usr/sbin:/sbin"

RUN="${EAGLE3_SLURM_RUN:-/run/eagle3-slurm}"
CONF=/etc/slurm/slurm.conf
MARK="# written by eagle3-runner scripts/slurm-up.sh"
T=timeout

log() { echo "slurm-up: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts slurmctld/slurmd)"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ---- already up? ---------------------------------------------------------------------------
if [ -f "$RUN/current" ]; then
  S="$(cat "$RUN/current")"
  if alive "$S/slurmctld.pid" && alive "$S/slurmd.pid" \
     && [ "$($T 5 sinfo -h -o %T 2>/dev/null | head -1)" = idle ]; then
    log "already running (state $S)"
    exit 0
  fi
  bash "$(dirname "$0")/slurm-down.sh" || true
fi

# ---- packages ------------------------------------------------------------------------------
need=()
for b in munged slurmctld slurmd sbatch; do command -v "$b" >/dev/null || need+=("$b"); done
if [ ${#need[@]} -gt 0 ]; then
  log "installing munge slurmctld slurmd slurm-client (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  $T 300 apt-get update -qq
  $T 600 apt-get install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client >/dev/null
fi

# ---- munge ---------------------------------------------------------------------------------
[ -f /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key \
  bs=1 count=1024 status=none; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
chmod 755 /run/munge
if ! alive /run/munge/munged.pid; then
  runuser -u munge -- munged
fi
for _ in $(seq 50); do
  if $T 5 munge -n 2>/dev/null | $T 5 unmunge >/dev/null 2>&1; then break; fi
  sleep 0.2
done
$T 5 munge -n | $T 5 unmunge >/dev/null || die "munged does not answer (munge -n | unmunge)"

# ---- config --------------------------------------------------------------------------------
if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF" && [ "${SLURM_UP_FORCE:-0}" != 1 ]; then
  die "$CONF exists and was not written by this script; refusing to replace a real cluster's \
config (set SLURM_UP_FORCE=1 to overwrite)"
fi
mkdir -p "$RUN"
S="$(mktemp -d /tmp/eagle3-slurm.XXXXXX)"
mkdir -p "$S/ctld" "$S/d" 
chmod 755 "$S"
HOST="$(hostname -s)"
CPUS="$(nproc)"
MEM_MB=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) - 1024 ))
mkdir -p /etc/slurm
cat > "$CONF.tmp" <<EOF
$MARK (state: $S)
ClusterName=eagle3test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$S/ctld
SlurmdSpoolDir=$S/d
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=batch_sched_delay=0
KillWait=2
EnforcePartLimits=ALL
MinJobAge=3600
DefMemPerCPU=1024
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
mv "$CONF.tmp" "$CONF"
echo "$S" > "$RUN/current"

# ---- daemons -------------------------------------------------------------------------------
slurmctld -i || { tail -20 "$S/slurmctld.log" >&2 || true; die "slurmctld did not start"; }
for _ in $(seq 50); do $T 3 scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
slurmd || { tail -20 "$S/slurmd.log" >&2 || true; die "slurmd did not start"; }

state=""
for _ in $(seq 120); do
  state="$($T 5 sinfo -h -o %T 2>/dev/null | head -1 || true)"
  [ "$state" = idle ] && break
  sleep 0.25
done
if [ "$state" != idle ]; then
  tail -20 "$S/slurmctld.log" "$S/slurmd.log" >&2 || true
  die "node not idle after 30 s (state: '${state:-no answer}')"
fi
log "up: node $HOST ($CPUS CPUs, ${MEM_MB} MiB), partition debug, state $S"
