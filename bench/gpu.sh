#!/usr/bin/env bash
# The single-GPU benchmark, as one short prepared script for a machine with one NVIDIA GPU:
# ddpjob train vs the bare DDP loop on an MLP large enough to keep the GPU busy, bf16, with
# steps/s and GPU memory; plus a GPU smoke test of the dp and none strategies and a resume.
# Needs torch >= 2.12 with CUDA (e.g. the pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime image);
# python-dotenv may come as wheels in .whl/ (see bench/README.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/ddpjob-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
W=${WIDTH:-8192} D=${DEPTH:-8} B=${BATCH:-4096} S=${STEPS:-300}
model="ddpjob.plugins:synthetic_mlp(width=$W, depth=$D)"
data="ddpjob.plugins:synthetic(samples=$((B * 40)))"
for i in 1 2 3; do
    BENCH_T0=0 BENCH_WARM=50 python3 -m torch.distributed.run --standalone --nproc-per-node=1 bench/bare_ddp.py \
        "$W" "$D" "$((B * 40))" "$B" "$S" cuda bf16 2>&1 | grep -E "steps_per_s|gpu_mem" | sed "s/^/bare run $i: /" | tee -a "$out/gpu.txt"
    rm -rf "/tmp/run$i"
    python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m ddpjob train --model "$model" --data "$data" \
        --batch-size "$B" --epochs 1000 --max-steps "$S" --save-every 0 --log-every 50 --precision bf16 \
        --device cuda --resume never --run-dir "/tmp/run$i" > "$out/ddpjob-$i.log" 2>&1
    python3 - "$i" <<'PY' | tee -a "$out/gpu.txt"
import json, sys
rows = [json.loads(l) for l in open(f"/tmp/run{sys.argv[1]}/metrics.jsonl")]
t = [r for r in rows if r["event"] == "train"]
print(f"ddpjob run {sys.argv[1]}: steps_per_s {(t[-1]['step'] - t[0]['step']) / (t[-1]['time'] - t[0]['time']):.3f} "
      f"gpu_mem_gib {t[-1].get('gpu_mem_gib')}")
PY
done
# Smoke: single-process strategies on the GPU and an exact resume from a checkpoint.
for strategy in dp none; do
    python3 -m ddpjob train --device cuda --strategy "$strategy" --epochs 2 --run-dir "/tmp/smoke-$strategy" 2>&1 \
        | grep -E "done|error" | sed "s/^/$strategy: /" | tee -a "$out/gpu.txt"
done
python3 -m ddpjob train --device cuda --epochs 2 --max-steps 20 --run-dir /tmp/smoke-resume > /dev/null 2>&1
python3 -m ddpjob train --device cuda --epochs 2 --run-dir /tmp/smoke-resume 2>&1 | grep -E "done|error" \
    | sed "s/^/resume: /" | tee -a "$out/gpu.txt"
grep -c '"resumed_from": "/tmp/smoke-resume' /tmp/smoke-resume/metrics.jsonl | sed 's/^/resumed starts: /' | tee -a "$out/gpu.txt"
