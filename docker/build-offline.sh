#!/usr/bin/env bash
# Build the ddpjob image without any package index inside the build (air-gapped clusters, CI).
# 1. On a machine with pip access, collect every wheel the image needs into ./wheelhouse.
# 2. docker build, whose install step then uses `pip install --no-index --find-links`.
#
#   docker/build-offline.sh [IMAGE_TAG] [BASE_IMAGE]      e.g. docker/build-offline.sh ddpjob:cpu python:3.11-slim-bookworm
# Env: EXTRAS of ddpjob to put in the image (e.g. s3; default none), TORCH_SPEC (default torch==2.13.0), PIP (default: pip of the active python), PYTHON_VERSION of the base (3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-ddpjob:cpu}
base=${2:-python:3.11-slim-bookworm}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
dumb_init=dumb-init==1.2.5.post1  # the pods' init (k8s/); keep equal to docker/install.sh's
extras=${EXTRAS:-}
pip=${PIP:-python3 -m pip}
mkdir -p wheelhouse
rm -f wheelhouse/ddpjob-*.whl  # always this checkout's code
# shellcheck disable=SC2086  # $pip and the torch spec may be several words
$pip wheel --quiet --wheel-dir wheelhouse $torch_spec "$dumb_init" ".${extras:+[$extras]}"
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build --file docker/Dockerfile --tag "$tag" \
    --build-arg BASE_IMAGE="$base" --build-arg TORCH_SPEC="$torch_spec" --build-arg EXTRAS="$extras" .
