#!/usr/bin/env bash
# Stop what provision.sh started: Slurm daemons, munge, dockerd, the node namespaces and bridge.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
state=${E2E_STATE:-$root/.e2e}
for pidfile in "$state"/slurm/slurmd-*.pid "$state/slurm/slurmctld.pid" "$state/slurm/munged.pid" "$state/docker/dockerd.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
done
sleep 3
for ns in $(ip netns list | grep -o '^ddpjob-[a-z0-9]*'); do ip netns delete "$ns"; done
ip link delete ddpjbr0 2>/dev/null
echo "e2e: stopped"
