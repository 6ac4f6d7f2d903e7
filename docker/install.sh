#!/bin/sh
# Inside the image build: a venv at /opt/ddpjob with torch and ddpjob.
# Offline when the build context's wheelhouse/ held wheels (they are copied flat into /tmp/build);
# a torch that the base image already has (the PyTorch CUDA images) is reused.
# dumb-init (a static binary in a wheel) is the pods' PID 1: k8s/ runs `dumb-init -- ddpjob launch`.
set -eu
torch_spec=$1
extras=${2:-}  # ddpjob's extras, comma-separated (s3), or none
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
[ -z "$extras" ] || project="${project}[$extras]"
if ! /opt/ddpjob/bin/python -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086  # word splitting is wanted: the spec may carry --index-url
    "$pip" install $offline $torch_spec
fi
# shellcheck disable=SC2086
"$pip" install $offline "$project" "$dumb_init"
# The examples: root-owned and read-only to the job's user, on sys.path after site-packages (a .pth
# file), so `examples.lm` resolves whatever the working directory; one in the working directory wins.
share=/opt/ddpjob/share/ddpjob
mkdir -p "$share"
cp -R /tmp/build/examples "$share/examples"
# A namespace package: a user's own `examples` folder without __init__.py merges with it instead
# of being hidden by it.
rm -f "$share/examples/__init__.py"
/opt/ddpjob/bin/python -m compileall -q "$share/examples"
chmod -R u=rwX,go=rX "$share"
site=$(/opt/ddpjob/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "$share" > "$site/ddpjob-examples.pth"
/opt/ddpjob/bin/ddpjob --help >/dev/null
# examples.lm's corpus is the base's standard-library .py sources: a base that strips them fails here.
(cd / && /opt/ddpjob/bin/python -c '
from examples.lm import corpus_files
n = sum(p.stat().st_size for p in corpus_files())
assert n >= 1_000_000, f"examples.lm: the standard library has only {n} bytes of .py sources"
')
/opt/ddpjob/bin/dumb-init --version >/dev/null 2>&1
# An extra that did not install fails the build, not the first job that needs it.
case ",$extras," in *,s3,*) /opt/ddpjob/bin/python -c "import s3fs" ;; esac
