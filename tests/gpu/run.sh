#!/usr/bin/env bash
# GPU check (issue 10, section 1): the CUDA paths that CPU tests cannot reach, as one prepared
# script for a machine with one or more NVIDIA GPUs. Run from anywhere in the repo:
#
#   bash tests/gpu/run.sh                          # prints PASS/FAIL per check; exit 1 on any FAIL
#   DDPJOB_GPU_SELFTEST=cpu bash tests/gpu/run.sh  # the same checks with --device cpu (gloo), no GPU
#
# Checks, each on the bundled digits data with small --max-steps (about 4 minutes on one H200):
#   1 GPU, DDP under torchrun: an uninterrupted run; SIGTERM to the agent mid-run exits 75 with a
#     checkpoint, and --resume auto on CUDA ends with the uninterrupted run's parameter fingerprint
#     (--load-mode rank0 too); --init-from a checkpoint (mmap and rank0) loads its exact weights;
#     --save-mode async for both --checkpoint-format file and dcp (dcp: SIGTERM and resume too);
#     --precision bf16.
#   2+ GPUs: 2 NCCL ranks on one node (the object collectives), SIGTERM and rank0 resume included.
#   --strategy fsdp2 with --precision bf16 on 2 NCCL ranks (1 where there is 1 GPU): accuracy, the
#     per-rank state bytes record, SIGTERM and a resume equal to the uninterrupted run.
#
# Python: $PYTHON if set; else .venv/bin/python when its torch sees CUDA; else python3 (the
# PyTorch images, and the device machine, whose python3 is a venv with CUDA torch). Missing
# dependencies of ddpjob come from wheels in .whl/ when there are any (offline machines: see
# bench/README.md), else from the package index; they go to $DDPJOB_GPU_SITE, ddpjob itself is
# imported from src/. DDPJOB_GPU_TORCH="torch==2.13.0 --index-url URL" instead builds a venv
# ($DDPJOB_GPU_VENV) with that torch and ddpjob installed (online machines). Logs and metrics: $OUT (default
# /tmp/ddpjob-gpu-check). STEPS, SIGNAL_AT, RUN_TIMEOUT, ACCURACY override the settings below.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
repo=$PWD
out=${OUT:-/tmp/ddpjob-gpu-check}
selftest=${DDPJOB_GPU_SELFTEST:-} gpu_torch=${DDPJOB_GPU_TORCH:-}
venv=${DDPJOB_GPU_VENV:-/tmp/ddpjob-gpu-venv} site=${DDPJOB_GPU_SITE:-/tmp/ddpjob-gpu-site}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/ddpjob-gpu.XXXXXX") || exit 1
summary=$out/summary.txt
: >"$summary"
started=$SECONDS
failures=0
children=()

cleanup() {
    local pid
    for pid in "${children[@]}"; do
        kill -KILL "$pid" 2>/dev/null
    done
    rm -rf "$work"
}
trap cleanup EXIT

note() { printf '%s\n' "$*" | tee -a "$summary"; }
pass() { note "PASS $1"; }
fail() {
    note "FAIL $1: $2"
    failures=$((failures + 1))
}

# Settings not meant for these runs: DDPJOB_* from the caller's environment, this script's own
# included (ddpjob reads them all and refuses unknown ones), and ./.env (the runs' working
# directory is $work, so none is found).
while read -r name; do
    unset "$name"
done < <(compgen -e | grep '^DDPJOB_')

if [ "$selftest" = cpu ]; then
    device=cpu
    STEPS=${STEPS:-150} SIGNAL_AT=${SIGNAL_AT:-20} RUN_TIMEOUT=${RUN_TIMEOUT:-240} ACCURACY=${ACCURACY:-0.5}
    gpus=2 # gloo stands in for NCCL, so the two-rank checks run too
    py=${PYTHON:-$repo/.venv/bin/python}
    note "selftest on CPU: --device cpu, gloo, bf16 replaced by fp32; not a GPU result"
elif [ -n "$selftest" ]; then
    echo "DDPJOB_GPU_SELFTEST=$selftest: only 'cpu' is known" >&2
    exit 2
else
    device=cuda
    STEPS=${STEPS:-1500} SIGNAL_AT=${SIGNAL_AT:-150} RUN_TIMEOUT=${RUN_TIMEOUT:-180} ACCURACY=${ACCURACY:-0.9}
    if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$out/gpus.txt" 2>&1; then
        fail preflight "nvidia-smi does not list any GPU (no driver, or not a GPU machine)"
        exit 1
    fi
    gpus=$(grep -c '^GPU ' "$out/gpus.txt")
    cat "$out/gpus.txt"
    if [ -n "$gpu_torch" ]; then
        [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv" || exit 1
        # shellcheck disable=SC2086  # the spec may carry --index-url: word splitting is wanted
        if ! "$venv/bin/pip" install -q $gpu_torch || ! "$venv/bin/pip" install -q -e "$repo"; then
            fail preflight "could not install $gpu_torch and ddpjob into $venv"
            exit 1
        fi
        py=$venv/bin/python
    elif [ -n "${PYTHON:-}" ]; then
        py=$PYTHON
    elif [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        py=$repo/.venv/bin/python
    else
        py=$(command -v python3)
    fi
fi
case $py in
    /*) ;;
    */*) py=$repo/$py ;;
    *) py=$(command -v "$py") ;;
esac
if [ ! -x "$py" ]; then
    fail preflight "no python at '$py'"
    exit 1
fi
export PYTHONPATH=$repo/src:$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 # deterministic cuBLAS: resumed runs must match bit for bit

# ddpjob's dependencies (pyproject.toml), by distribution name; missing ones from .whl/ or the index.
missing_deps() {
    "$py" - "$repo/pyproject.toml" <<'PY'
import re, sys
from importlib import metadata
text = open(sys.argv[1]).read()
deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', deps, re.M)
missing = []
for name in names:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(name)
print(" ".join(missing))
PY
}
missing=$(missing_deps) || {
    fail preflight "$py cannot read pyproject.toml's dependencies"
    exit 1
}
if [[ " $missing " == *" torch "* ]]; then
    fail preflight "$py has no torch: set PYTHON to a python with CUDA torch, or DDPJOB_GPU_TORCH"
    exit 1
elif [ -n "$missing" ]; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl >"$out/pip.log" 2>&1
    else
        # shellcheck disable=SC2086  # one argument per package
        "$py" -m pip install -q --retries 0 --timeout 20 --target "$site" $missing >"$out/pip.log" 2>&1
    fi
    missing=$(missing_deps)
    if [ -n "$missing" ]; then
        fail preflight "missing packages: $missing (offline: put their wheels in .whl/, see bench/README.md)"
        exit 1
    fi
fi
if ! "$py" - "$device" >"$out/versions.txt" 2>&1 <<'PY'; then
import sys
import torch
print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} "
      f"devices {torch.cuda.device_count()}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device (a CPU build of torch?)")
try:
    from ddpjob import versions
except ImportError:  # a ddpjob from before the start-up version check
    versions = None
if versions is not None:
    versions.check_torch()
PY
    fail preflight "$(tail -1 "$out/versions.txt")"
    exit 1
fi
note "$(cat "$out/versions.txt"); $gpus GPU(s) listed; python $py"

base=(--device "$device" --epochs 50 --max-steps "$STEPS" --log-every 10 --save-every 0)

# One ddpjob train under torchrun --standalone: train NPROC NAME [flags]; log $out/NAME.log.
train() {
    local nproc=$1 name=$2
    shift 2
    (cd "$work" && timeout -k 10 "$RUN_TIMEOUT" "$py" -m torch.distributed.run --standalone \
        --nproc-per-node="$nproc" -m ddpjob train --run-dir "$work/$name" "${base[@]}" "$@") \
        >>"$out/$name.log" 2>&1
}

# ddpjob launch (the agent every launcher runs), sent SIGTERM once a train record at step
# SIGNAL_AT or later is written: interrupt NPROC NAME [flags]; sets $code to its exit code.
interrupt() {
    local nproc=$1 name=$2 pid deadline
    shift 2
    (cd "$work" && exec "$py" -m ddpjob launch --nproc-per-node "$nproc" --run-dir "$work/$name" \
        "${base[@]}" "$@") >>"$out/$name.log" 2>&1 &
    pid=$!
    children+=("$pid")
    deadline=$((SECONDS + RUN_TIMEOUT))
    while kill -0 "$pid" 2>/dev/null && [ "$(last_step "$name")" -lt "$SIGNAL_AT" ]; do
        [ "$SECONDS" -lt "$deadline" ] || break
        sleep 0.05
    done
    kill -TERM "$pid" 2>/dev/null
    deadline=$((SECONDS + 120))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null && echo "killed: still running 120 s after SIGTERM" >>"$out/$name.log"
    wait "$pid"
    code=$?
}

last_step() { event_step "$1" train; }

# final NAME KEY: KEY of run NAME's last "final" record.
final() {
    "$py" - "$work/$1/metrics.jsonl" "$2" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
except OSError:
    rows = []
finals = [r for r in rows if r.get("event") == "final"]
print(finals[-1].get(sys.argv[2], "") if finals else "")
PY
}
event_step() { # event_step NAME EVENT: the step of run NAME's last EVENT record (0 if none)
    local line
    line=$(grep "\"event\": \"$2\"" "$work/$1/metrics.jsonl" 2>/dev/null | tail -1)
    [[ $line =~ \"step\":\ ([0-9]+) ]] && echo "${BASH_REMATCH[1]}" || echo 0
}
resumed() { grep '"event": "start"' "$work/$1/metrics.jsonl" 2>/dev/null | tail -1 | grep -qv '"resumed_from": null'; }
newest() { # the newest step-N.pt or step-N/ of run NAME
    local dir=$work/$1/checkpoints best=-1 path="" entry n
    for entry in "$dir"/step-*; do
        n=${entry##*/step-}
        n=${n%.pt}
        [[ $n =~ ^[0-9]+$ ]] && [ "$n" -gt "$best" ] && best=$n path=$entry
    done
    echo "$path"
}
copy_run() { [ ! -d "$work/$1" ] || cp -a "$work/$1" "$work/$2"; }
same() { # same CHECK NAME REFERENCE: run NAME ends with the parameters of run REFERENCE
    local got want
    got=$(final "$2" params) want=$(final "$3" params)
    if [ -n "$got" ] && [ "$got" = "$want" ]; then
        pass "$1 (params $got)"
    else
        fail "$1" "params '${got:-none}' != '${want:-none}' of run $3; $(difference "$2" "$3") (see $out/$2.log)"
    fi
}
difference() { # how far apart the newest checkpoints' weights of two runs are (rounding, or a bug?)
    "$py" - "$(newest "$1")" "$(newest "$2")" 2>&1 <<'PY' | tail -1
import sys
from pathlib import Path
import torch
from ddpjob.checkpoint.formats import dcp_folder as sharded
def weights(path):
    p = Path(path)
    return sharded.read_model(p) if p.is_dir() else torch.load(p, map_location="cpu", weights_only=True)["model"]
a, b = weights(sys.argv[1]), weights(sys.argv[2])
if a.keys() != b.keys():
    print(f"different keys: {sorted(a.keys() ^ b.keys())[:5]}")
else:
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"max |difference| of the final weights {worst:.3g} over {len(a)} tensors")
PY
}
intact() { # intact CHECK NAME: the newest checkpoint of run NAME passes its integrity check
    local path
    path=$(newest "$2")
    if [ -n "$path" ] && (cd "$work" && "$py" -m ddpjob ckpt inspect "$path") >"$out/$2-inspect.txt" 2>&1 &&
        grep -q '^integrity: *ok' "$out/$2-inspect.txt"; then
        pass "$1 (${path##*/} intact)"
    else
        fail "$1" "newest checkpoint '${path##*/}' missing or not intact (see $out/$2-inspect.txt)"
    fi
}
interrupted() { # interrupted CHECK NAME: $code is 75, with a preempted record and a checkpoint
    local at
    at=$(event_step "$2" preempted)
    if [ "$code" -eq 75 ] && [ "$at" -gt 0 ] && [ "$at" -lt "$STEPS" ] && [ -n "$(newest "$2")" ]; then
        pass "$1 (exit 75, checkpoint at step $at of $STEPS, ${base[*]:0:2})"
    elif [ "$code" -eq 0 ] || [ "$at" -ge "$STEPS" ]; then
        fail "$1" "the run finished before SIGTERM landed: raise STEPS (now $STEPS) or lower SIGNAL_AT"
    else
        fail "$1" "exit $code, expected 75 with a checkpoint (see $out/$2.log)"
    fi
}

# --- 1 GPU --------------------------------------------------------------------------------------
if train 1 whole && [ -n "$(final whole params)" ]; then
    pass "1-GPU DDP training ($STEPS steps, accuracy $(final whole accuracy), params $(final whole params))"
    if [ "$device" = cuda ] && ! grep -q '"gpu_mem_gib": [0-9.]*[1-9]' "$work/whole/metrics.jsonl"; then
        fail "1-GPU DDP training on the GPU" "no GPU memory in use in the metrics: did it train on the CPU?"
    fi
else
    fail "1-GPU DDP training" "exit or no final record (see $out/whole.log)"
fi

interrupt 1 stopped
interrupted "SIGTERM to ddpjob launch mid-run" stopped
copy_run stopped stopped-rank0
if train 1 stopped --resume auto && resumed stopped; then
    same "--resume auto on $device equals the uninterrupted run" stopped whole
else
    fail "--resume auto on $device" "exit or no resumed start (see $out/stopped.log)"
fi
if train 1 stopped-rank0 --resume auto --load-mode rank0 && resumed stopped-rank0; then
    same "--resume auto --load-mode rank0 on $device equals the uninterrupted run" stopped-rank0 whole
else
    fail "--resume auto --load-mode rank0 on $device" "exit or no resumed start (see $out/stopped-rank0.log)"
fi

# --init-from with a learning rate too small to move any weight: the run ends with the source's.
source_ckpt=$(newest whole)
for load_mode in mmap rank0; do
    if [ -n "$source_ckpt" ] && train 1 "init-$load_mode" --init-from "$source_ckpt" --load-mode "$load_mode" \
        --lr 1e-30 --max-steps 2; then
        same "--init-from a checkpoint, --load-mode $load_mode, on $device" "init-$load_mode" whole
    else
        fail "--init-from, --load-mode $load_mode, on $device" "exit (see $out/init-$load_mode.log)"
    fi
done

if train 1 async-file --save-mode async --save-every 100; then
    same "--save-mode async (file) on $device: same training" async-file whole
    intact "--save-mode async (file) on $device: checkpoint" async-file
else
    fail "--save-mode async (file) on $device" "exit (see $out/async-file.log)"
fi

dcp=(--checkpoint-format dcp --save-mode async --save-every 50)
interrupt 1 async-dcp "${dcp[@]}"
interrupted "SIGTERM during --save-mode async --checkpoint-format dcp" async-dcp
if train 1 async-dcp "${dcp[@]}" && resumed async-dcp; then
    same "--save-mode async --checkpoint-format dcp on $device: resumed run equals the uninterrupted one" \
        async-dcp whole
    intact "--save-mode async --checkpoint-format dcp on $device: checkpoint" async-dcp
else
    fail "--save-mode async --checkpoint-format dcp resume on $device" "exit (see $out/async-dcp.log)"
fi

precision=bf16
[ "$device" = cuda ] || precision=fp32 # ddpjob refuses bf16 on the CPU
if train 1 bf16 --precision "$precision"; then
    accuracy=$(final bf16 accuracy)
    if "$py" -c "import sys; sys.exit(not float('${accuracy:-0}') >= $ACCURACY)"; then
        pass "--precision $precision on $device (accuracy $accuracy)"
    else
        fail "--precision $precision on $device" "held-out accuracy ${accuracy:-none} < $ACCURACY"
    fi
else
    fail "--precision $precision on $device" "exit (see $out/bf16.log)"
fi

# --- 2 ranks on one node: NCCL on 2 GPUs, through the object collectives ----------------------
if [ "$gpus" -ge 2 ]; then
    if train 2 two && [ -n "$(final two params)" ]; then
        pass "2 ranks on one node ($device), params $(final two params)"
    else
        fail "2 ranks on one node ($device)" "exit or no final record (see $out/two.log)"
    fi
    interrupt 2 two-stopped
    interrupted "SIGTERM to ddpjob launch, 2 ranks" two-stopped
    if train 2 two-stopped --resume auto --load-mode rank0 && resumed two-stopped; then
        same "2 ranks: --resume auto --load-mode rank0 equals the uninterrupted run" two-stopped two
    else
        fail "2 ranks: --resume auto --load-mode rank0" "exit or no resumed start (see $out/two-stopped.log)"
    fi
else
    note "SKIP 2 ranks on one node: $gpus GPU listed"
fi

# --- fsdp2: parameters, gradients and optimizer state sharded over NCCL ranks, bf16 compute ------
# On 2 GPUs where there are 2 (else 1): training reaches ACCURACY with --precision bf16 (params in
# bf16, reductions in fp32), each rank holds its share of the state, and a SIGTERM mid-run
# resumes to the uninterrupted run's parameters.
ranks=1
[ "$gpus" -ge 2 ] && ranks=2
fsdp2=(--strategy fsdp2 --checkpoint-format dcp --precision "$precision")
if train "$ranks" fsdp2 "${fsdp2[@]}" && [ -n "$(final fsdp2 params)" ]; then
    accuracy=$(final fsdp2 accuracy)
    if "$py" -c "import sys; sys.exit(not float('${accuracy:-0}') >= $ACCURACY)"; then
        pass "--strategy fsdp2 --precision $precision, $ranks rank(s) on $device (accuracy $accuracy)"
    else
        fail "--strategy fsdp2 --precision $precision on $device" "held-out accuracy ${accuracy:-none} < $ACCURACY"
    fi
    if grep -q '"event": "memory".*"param_bytes": \[[1-9]' "$work/fsdp2/metrics.jsonl"; then
        pass "--strategy fsdp2: per-rank state bytes recorded ($(grep '"event": "memory"' "$work/fsdp2/metrics.jsonl" | head -1 | cut -c1-160))"
    else
        fail "--strategy fsdp2 state bytes" "no memory record with param_bytes (see $out/fsdp2.log)"
    fi
else
    fail "--strategy fsdp2 on $device" "exit or no final record (see $out/fsdp2.log)"
fi
interrupt "$ranks" fsdp2-stopped "${fsdp2[@]}"
interrupted "SIGTERM to ddpjob launch, --strategy fsdp2" fsdp2-stopped
if train "$ranks" fsdp2-stopped "${fsdp2[@]}" --resume auto && resumed fsdp2-stopped; then
    same "--strategy fsdp2: resumed run equals the uninterrupted one" fsdp2-stopped fsdp2
    intact "--strategy fsdp2: checkpoint" fsdp2-stopped
else
    fail "--strategy fsdp2 resume on $device" "exit or no resumed start (see $out/fsdp2-stopped.log)"
fi

note "$((SECONDS - started)) s, $failures failed; logs in $out"
[ "$failures" -eq 0 ]
