"""Per-rank memory: DDP against fsdp2 at 1, 2 and 4 processes.

Each configuration is a short `ddpjob train` under torchrun (CPU, gloo) on the synthetic MLP with
AdamW. Its "memory" record, written after the first optimizer step, gives each rank's bytes of
parameters, gradients and optimizer state (under fsdp2 the rank's own shards), and the peak
resident memory of each worker process so far (the Python interpreter, torch and the data
included: that floor is the same for both strategies). The table shows the largest rank's figures.
``--mmap-threshold BYTES`` sets glibc's MALLOC_MMAP_THRESHOLD_ for the workers: a fixed threshold
returns each freed large buffer to the system at once, so the peak RSS shows what was live rather
than what the allocator kept (fsdp2's per-block gathers are freed and allocated again every block).
    python bench/memory.py [--width 1024] [--depth 4] [--procs 1,2,4] [--mmap-threshold 131072]
"""

import argparse
import json
import tempfile
from pathlib import Path

from common import run, table, torchrun


def measure(work: Path, strategy: str, nproc: int, model: str, environ: dict[str, str]) -> dict[str, list[int]]:
    run_dir = work / f"{strategy}-{nproc}"
    args = ["--model", model, "--data", "ddpjob.plugins:synthetic(samples=512)", "--strategy", strategy]
    args += ["--checkpoint-format", "dcp", "--max-steps", "3", "--epochs", "1", "--save-every", "0"]
    args += ["--log-every", "1000", "--run-dir", str(run_dir), "--resume", "never"]
    run(torchrun(nproc, "-m", "ddpjob", "train", *args), cwd=work, **environ)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    record: dict[str, list[int]] = [json.loads(ln) for ln in lines if '"memory"' in ln][-1]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--mmap-threshold", type=int, default=0, help="MALLOC_MMAP_THRESHOLD_ (0: glibc's default)")
    a = parser.parse_args()
    environ = {"MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)} if a.mmap_threshold else {}
    model = f"ddpjob.plugins:synthetic_mlp(width={a.width}, depth={a.depth})"
    mib = 2**20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (int(n) for n in a.procs.split(",")):
            ddp_state = 0
            for strategy in ("ddp", "fsdp2"):
                r = measure(Path(tmp), strategy, nproc, model, environ)
                state = max(
                    p + g + o for p, g, o in zip(r["param_bytes"], r["grad_bytes"], r["optimizer_bytes"], strict=True)
                )
                ddp_state = ddp_state or state
                rows.append(
                    [
                        strategy,
                        nproc,
                        f"{max(r['param_bytes']) / mib:.2f}",
                        f"{max(r['grad_bytes']) / mib:.2f}",
                        f"{max(r['optimizer_bytes']) / mib:.2f}",
                        f"{state / mib:.2f}",
                        f"{state / ddp_state:.3f}",
                        f"{max(r['peak_rss_bytes']) / mib:.0f}",
                    ]
                )
    table(
        f"per-rank memory (largest rank), {model}, AdamW, CPU, gloo"
        + (f", MALLOC_MMAP_THRESHOLD_={a.mmap_threshold}" if a.mmap_threshold else ""),
        ["strategy", "procs", "params MiB", "grads MiB", "optimizer MiB", "state MiB", "x DDP", "peak RSS MiB"],
        rows,
    )


if __name__ == "__main__":
    main()
