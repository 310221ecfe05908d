#!/usr/bin/env bash
# Make `scontrol show hostnames` usable for tests/cluster/test_nodelist.py, without a controller.
#
#   tests/cluster/scontrol_hostnames.sh DIR    installs slurm-client if missing, writes DIR/slurm.conf
#
# Prints the path of the slurm.conf to put in SLURM_CONF (scontrol needs one even to expand a
# host list, though it never contacts the controller for it). Exit 3 with the reason on stderr
# when scontrol is missing and cannot be installed (not root, no apt-get, no network).
set -euo pipefail
DIR=${1:?usage: scontrol_hostnames.sh DIR}
mkdir -p "$DIR"
die() { echo "scontrol_hostnames: $2" >&2; exit "$1"; }
if ! command -v scontrol >/dev/null 2>&1; then
  [[ "$(id -u)" == 0 ]] || die 3 "scontrol is not installed and installing slurm-client needs root"
  command -v apt-get >/dev/null 2>&1 || die 3 "scontrol is not installed and there is no apt-get"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurm-client; } >"$DIR/apt.log" 2>&1; then
    die 3 "apt-get could not install slurm-client: $(tail -n 2 "$DIR/apt.log" | tr '\n' ' ')"
  fi
fi
cat >"$DIR/slurm.conf" <<CONF
ClusterName=hostnames
SlurmctldHost=localhost
NodeName=localhost CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES
CONF
echo "$DIR/slurm.conf"
