#!/usr/bin/env bash
# Provision everything the end-to-end tests need on this host, as root: Debian packages, a Docker
# engine with Compose and the ddpjob image (built offline), and a 2-node Slurm cluster.
# Fails loudly (non-zero) if any step fails; the tests then fail rather than skip.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" != 0 ]; then
    echo "provision.sh: run as root (it installs packages, starts daemons and creates network namespaces)" >&2
    exit 1
fi
packages=(docker.io debootstrap slurmctld slurmd slurm-client munge iproute2 iptables)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
bash "$here/docker_up.sh"
bash "$here/slurm_up.sh"
