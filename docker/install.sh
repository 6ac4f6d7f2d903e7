#!/bin/sh
# Inside the image build: a venv at /opt/ddpjob with torch and ddpjob.
# Offline when the build context's wheelhouse/ held wheels (they are copied flat into /tmp/build);
# a torch that the base image already has (the PyTorch CUDA images) is reused.
# dumb-init (a static binary in a wheel) is the pods' PID 1: k8s/ runs `dumb-init -- ddpjob launch`.
set -eu
torch_spec=$1
dumb_init=dumb-init==1.2.5.post1  # keep equal to docker/build-offline.sh's
python3 -m venv --system-site-packages /opt/ddpjob
pip=/opt/ddpjob/bin/pip
if ls /tmp/build/*.whl >/dev/null 2>&1; then
    offline="--no-index --find-links /tmp/build"
    project=ddpjob
else
    offline=""
    project=/tmp/build
fi
if ! /opt/ddpjob/bin/python -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086  # word splitting is wanted: the spec may carry --index-url
    "$pip" install $offline $torch_spec
fi
# shellcheck disable=SC2086
"$pip" install $offline "$project" "$dumb_init"
/opt/ddpjob/bin/ddpjob --help >/dev/null
/opt/ddpjob/bin/dumb-init --version >/dev/null 2>&1
