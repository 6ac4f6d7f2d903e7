"""Start-up: seconds from launching torchrun to the first training step, `ddpjob train` vs a bare
script that only does init_process_group and DDP construction (bench/bare_ddp.py).

2 processes, gloo, CPU, the same small synthetic model. Median of --repeats.
    python bench/startup.py [--repeats 3]
"""

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from common import REPO, ddpjob_train, median, run, table, torchrun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    bare, ours = [], []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            out = run(
                torchrun(2, str(REPO / "bench/bare_ddp.py"), "256", "2", "4096", "32", "11"),
                cwd=Path(tmp),
                BENCH_T0=str(t0),
            )
            bare.append(float(re.search(r"startup (\S+)", out).group(1)))
            t0 = time.time()
            ddpjob_train(
                Path(tmp),
                "ddpjob.plugins:synthetic_mlp(width=256)",
                "ddpjob.plugins:synthetic(samples=4096)",
                "--max-steps",
                "1",
            )
            records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            ours.append(next(r["time"] for r in records if r["event"] == "start") - t0)
    rows = [
        ["bare: init_process_group + DDP", median(bare), ", ".join(f"{v:.2f}" for v in bare)],
        ["ddpjob train: ready for step 1", median(ours), ", ".join(f"{v:.2f}" for v in ours)],
    ]
    table("startup: seconds from torchrun start, 2 procs gloo CPU", ["what", "median (s)", "runs"], rows)
    print(f"\nratio ddpjob / bare = {median(ours) / median(bare):.3f} (target <= 1.2)")


if __name__ == "__main__":
    main()
