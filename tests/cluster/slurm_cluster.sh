#!/usr/bin/env bash
# A real 2-node SLURM cluster inside one machine, for gpukit's tests (and for trying
# `srun gpukit run` by hand).
#
#   tests/cluster/slurm_cluster.sh start DIR   install if missing, configure, start, wait idle
#   tests/cluster/slurm_cluster.sh stop DIR    stop every daemon and job, remove what it added
#   tests/cluster/slurm_cluster.sh map-hosts|unmap-hosts DIR   only the /etc/hosts part of start|stop
#
# `start` writes DIR/env: `source DIR/env` points sinfo/srun/sbatch at the cluster (SLURM_CONF).
# Nodes node1 and node2 are two `slurmd -N` daemons on 127.0.0.1 with their own ports
# (proctrack/linuxproc, task/none: no cgroups needed), one munged with its own key and socket,
# everything (config, state, logs) under DIR. node1/node2 are added to /etc/hosts as
# 127.0.0.1 when they do not resolve (jobs use the first node's name as their master address)
# and removed again by `stop`. Each line is tagged with its cluster's DIR, so that clusters
# running side by side add their own lines and `stop` removes only its own
# (GPUKIT_SLURM_HOSTS_FILE: another file than /etc/hosts, for the tests of this script).
#
# Exit codes of `start`: 0 running; 3 slurm is not installed and cannot be (not root, no
# apt-get, no network) -- the reason is on stderr; 4 installed but did not come up (logs in DIR).
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there; a non-login root shell may lack it

ACTION="${1:-}"
DIR="${2:-}"
HOSTS_TAG="# gpukit-test-slurm"
HOSTS_FILE="${GPUKIT_SLURM_HOSTS_FILE:-/etc/hosts}"
PACKAGES=(slurmctld slurmd slurm-client munge)
START_TIMEOUT_S="${GPUKIT_SLURM_START_TIMEOUT_S:-60}"

die() { echo "slurm_cluster: $2" >&2; exit "$1"; }
[[ "$ACTION" =~ ^(start|stop|map-hosts|unmap-hosts)$ ]] && [[ -n "$DIR" ]] \
  || die 2 "usage: $0 start|stop|map-hosts|unmap-hosts DIR"
DIR="$(realpath -m "$DIR")"  # one spelling for start and stop: the hosts lines' tag holds it
OWN_TAG="$HOSTS_TAG $DIR"

install_slurm() {
  local missing=()
  for cmd in slurmctld slurmd munged sinfo srun sbatch scontrol scancel squeue; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  [[ "$(id -u)" == 0 ]] || die 3 "SLURM is not installed (${missing[*]} missing) and installing needs root"
  command -v apt-get >/dev/null 2>&1 || die 3 "SLURM is not installed (${missing[*]} missing) and there is no apt-get"
  echo "slurm_cluster: installing ${PACKAGES[*]} with apt-get" >&2
  local log="$DIR/apt.log"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${PACKAGES[@]}"; } >"$log" 2>&1; then
    die 3 "apt-get could not install ${PACKAGES[*]}: $(tail -n 2 "$log" | tr '\n' ' ')"
  fi
}

free_ports() {  # N free TCP ports on 127.0.0.1
  python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_config() {
  local host ctl_port n1_port n2_port cpus
  host="$(hostname -s)"
  read -r ctl_port n1_port n2_port < <(free_ports 3)
  cpus="${GPUKIT_SLURM_CPUS:-4}"  # per node; more than the machine has is fine (config_overrides)
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
  chmod 700 "$DIR/munge"
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=gpukit-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmdPort=$n1_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=60
InactiveLimit=0
MessageTimeout=20
SlurmdTimeout=300
SlurmctldTimeout=300
PropagateResourceLimits=NONE
NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n1_port CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n2_port CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
  echo "export SLURM_CONF=$DIR/slurm.conf" >"$DIR/env"
}

resolves_elsewhere() {  # the name resolves without any test cluster's line: DNS, the image's hosts
  local name="$1"
  [[ "$HOSTS_FILE" == /etc/hosts ]] || return 1
  getent hosts "$name" >/dev/null 2>&1 || return 1
  ! grep -Eq "^[^#]*[[:space:]]$name[[:space:]]+$HOSTS_TAG" /etc/hosts
}

map_hosts() {  # our own tagged line per name, even when another test cluster already added one
  local name
  for name in node1 node2; do
    resolves_elsewhere "$name" && continue
    grep -Fqx "127.0.0.1 $name $OWN_TAG" "$HOSTS_FILE" 2>/dev/null && continue
    [[ -w "$HOSTS_FILE" ]] || die 3 "host name $name does not resolve and $HOSTS_FILE is not writable"
    echo "127.0.0.1 $name $OWN_TAG" >>"$HOSTS_FILE"
  done
}

unmap_hosts() {  # only the lines tagged with this cluster's DIR
  grep -Fq "$OWN_TAG" "$HOSTS_FILE" 2>/dev/null || return 0
  # /etc/hosts is often a bind mount: rewrite it in place rather than replace it
  local kept
  kept="$(awk -v tag=" $OWN_TAG" 'length($0) < length(tag) || substr($0, length($0) - length(tag) + 1) != tag' \
    "$HOSTS_FILE")"
  printf '%s\n' "$kept" >"$HOSTS_FILE"
}

start_daemons() {
  local key="$DIR/munge/munge.key"
  dd if=/dev/urandom of="$key" bs=1024 count=1 status=none && chmod 400 "$key"
  munged --force --key-file="$key" --socket="$DIR/munge/munge.sock" --pid-file="$DIR/munge/munged.pid" \
    --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || die 4 "munged did not start: $(tail -n 3 "$DIR/munge/munged.log" 2>/dev/null | tr '\n' ' ')"
  export SLURM_CONF="$DIR/slurm.conf"
  slurmctld -i || die 4 "slurmctld did not start: $(tail -n 3 "$DIR/slurmctld.log" 2>/dev/null | tr '\n' ' ')"
  slurmd -N node1 || die 4 "slurmd node1 did not start: $(tail -n 3 "$DIR/slurmd-node1.log" | tr '\n' ' ')"
  slurmd -N node2 || die 4 "slurmd node2 did not start: $(tail -n 3 "$DIR/slurmd-node2.log" | tr '\n' ' ')"
}

wait_idle() {
  local deadline=$((SECONDS + START_TIMEOUT_S)) states=""
  while ((SECONDS < deadline)); do
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')"
    [[ "$states" == "node1 idle node2 idle " ]] && return 0
    sleep 0.5
  done
  die 4 "nodes not idle after ${START_TIMEOUT_S}s (sinfo: ${states:-no answer}); logs in $DIR"
}

stop_cluster() {
  export SLURM_CONF="$DIR/slurm.conf"
  if [[ -f "$SLURM_CONF" ]]; then
    scancel --full --quiet --partition=test >/dev/null 2>&1 || true
    local pidfile pids=() pid
    for pidfile in "$DIR"/slurmd-node*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
      [[ -f "$pidfile" ]] && pids+=("$(cat "$pidfile")")
    done
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done  # all at once, then wait
    local deadline=$((SECONDS + 5))
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    done
  fi
  unmap_hosts
}

case "$ACTION" in
  start)
    mkdir -p "$DIR"
    install_slurm
    write_config
    map_hosts
    start_daemons
    wait_idle
    echo "slurm_cluster: node1 and node2 idle; source $DIR/env" >&2
    ;;
  stop)
    stop_cluster
    ;;
  map-hosts)
    map_hosts
    ;;
  unmap-hosts)
    unmap_hosts
    ;;
esac
