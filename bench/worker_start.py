"""Worker start: `ddpjob launch --worker-start fork` against `exec`, a one-step 2-worker CPU job, in
interleaved pairs. Per run: wall seconds of launch, CPU seconds of launch and its workers together,
and seconds from launch's start to the job's first step (its metrics 'start' record).
    python bench/worker_start.py [--pairs 3]
"""

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from common import PY, median, run, table


def one(how: str) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        job = ["--max-steps", "1", "--log-every", "1000", "--run-dir", tmp, "--resume", "never"]
        launch = [PY, "-m", "ddpjob", "launch", "--nproc-per-node", "2", "--device", "cpu", "--worker-start", how]
        run([*launch, *job], cwd=Path(tmp))
        wall = time.time() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        return wall, cpu, next(r["time"] for r in records if r["event"] == "start") - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3)
    a = parser.parse_args()
    runs: dict[str, list[tuple[float, float, float]]] = {"fork": [], "exec": []}
    for _ in range(a.pairs):
        for how in runs:
            runs[how].append(one(how))
    medians = {how: [median([r[i] for r in rs]) for i in range(3)] for how, rs in runs.items()}
    rows = [[how, *medians[how], "; ".join(", ".join(f"{v:.2f}" for v in r) for r in rs)] for how, rs in runs.items()]
    table(
        "worker start: one-step 2-worker launch, CPU", ["start", "wall (s)", "CPU (s)", "to step 1 (s)", "runs"], rows
    )
    ratios = [f / e for f, e in zip(medians["fork"], medians["exec"], strict=True)]
    print(f"\nratio fork / exec: wall {ratios[0]:.2f}, CPU {ratios[1]:.2f}, to step 1 {ratios[2]:.2f}")


if __name__ == "__main__":
    main()
