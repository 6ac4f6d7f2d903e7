#!/usr/bin/env bash
# Bring up a real 2-node Slurm cluster on this host (root): munge, slurmctld in the root network
# namespace on a bridge, and one slurmd per node in its own network namespace with its own
# hostname and /etc/hosts. Addresses are in 198.19.0.0/24 (inside 198.18.0.0/15).
# Prints nothing else on success but "slurm: ... ready"; the tests use SLURM_CONF=$state/slurm.conf.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
state=${E2E_STATE:-$root/.e2e}/slurm
bridge=ddpjbr0
ctl_addr=198.19.0.1
nodes=(node1 node2)
mkdir -p "$state"/{spool,state,log}
export SLURM_CONF=$state/slurm.conf

# Network: bridge in the root namespace, one namespace + veth per node.
if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge
    ip addr add "$ctl_addr/24" dev "$bridge"
    ip link set "$bridge" up
fi
# Docker sets the FORWARD policy to DROP; let the node namespaces talk to each other over the bridge.
if command -v iptables >/dev/null; then
    iptables -C FORWARD -i "$bridge" -o "$bridge" -j ACCEPT 2>/dev/null || iptables -I FORWARD -i "$bridge" -o "$bridge" -j ACCEPT
fi
printf '127.0.0.1 localhost\n%s %s\n' "$ctl_addr" "$(hostname)" > "$state/hosts"
for i in "${!nodes[@]}"; do
    node=${nodes[$i]} addr=198.19.0.$((11 + i))
    echo "$addr $node" >> "$state/hosts"
    if ! ip netns list | grep -qw "ddpjob-$node"; then
        ip netns add "ddpjob-$node"
        ip link add "ve-$node" type veth peer name eth0 netns "ddpjob-$node"
        ip link set "ve-$node" master "$bridge" up
        nsenter --net="/run/netns/ddpjob-$node" sh -c "ip addr add $addr/24 dev eth0 && ip link set eth0 up && ip link set lo up && ip route add default via $ctl_addr"
    fi
done

# No DNS server is reachable from the namespaces: fail lookups at once instead of timing out.
echo "nameserver 127.0.0.1" > "$state/resolv.conf"

# munge: one key and daemon for all nodes (same filesystem).
if [ ! -S "$state/munge.sock" ] || ! munge --socket="$state/munge.sock" -n >/dev/null 2>&1; then
    [ -f "$state/munge.key" ] || { head -c 1024 /dev/urandom > "$state/munge.key"; chmod 400 "$state/munge.key"; }
    munged --force --socket="$state/munge.sock" --key-file="$state/munge.key" --pid-file="$state/munged.pid" \
        --log-file="$state/log/munged.log" --seed-file="$state/munge.seed"
fi

cat > "$SLURM_CONF" <<CONF
ClusterName=ci
SlurmctldHost=$(hostname)($ctl_addr)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge.sock,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$state/state
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SchedulerParameters=nohold_on_prolog_fail
NodeName=node1 NodeAddr=198.19.0.11 CPUs=2 RealMemory=4000
NodeName=node2 NodeAddr=198.19.0.12 CPUs=2 RealMemory=4000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p /etc/slurm && cp "$SLURM_CONF" /etc/slurm/slurm.conf

if ! scontrol ping 2>/dev/null | grep -q UP; then
    slurmctld -f "$SLURM_CONF"
fi
for node in "${nodes[@]}"; do
    mkdir -p "$state/spool/$node"
    if [ ! -f "$state/slurmd-$node.pid" ] || ! kill -0 "$(cat "$state/slurmd-$node.pid")" 2>/dev/null; then
        nsenter --net="/run/netns/ddpjob-$node" unshare --uts --mount --propagation private \
            sh -c "hostname $node && mount --bind $state/hosts /etc/hosts && mount --bind $state/resolv.conf /etc/resolv.conf && exec slurmd -f $SLURM_CONF -N $node"
    fi
done
for _ in $(seq 60); do
    idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c idle || true)
    [ "$idle" = "${#nodes[@]}" ] && break
    scontrol update NodeName=node1,node2 State=RESUME >/dev/null 2>&1 || true
    sleep 1
done
sinfo -N
[ "$idle" = "${#nodes[@]}" ] || { echo "slurm nodes not idle; see $state/log" >&2; tail -5 "$state"/log/*.log >&2; exit 1; }
echo "slurm: controller $ctl_addr, nodes ${nodes[*]} ready (SLURM_CONF=$SLURM_CONF)"
