"""Loop overhead: steps/s of `ddpjob train` vs a minimal hand-written DDP loop doing the same work.

2 processes under torchrun, gloo, CPU; same synthetic model, data, batch size and optimizer.
Both are timed over the same steps (after a warm-up), median of --repeats runs each.
    python bench/loop.py [--repeats 3] [--steps 600] [--width 256] [--depth 2] [--batch 64]
"""

import argparse
import json
import re
import tempfile
from pathlib import Path

from common import REPO, ddpjob_train, median, run, table, torchrun

WARM = 50


def ddpjob_steps_per_s(work: Path, a: argparse.Namespace) -> float:
    model = f"ddpjob.plugins:synthetic_mlp(width={a.width}, depth={a.depth})"
    data = f"ddpjob.plugins:synthetic(samples={a.samples})"
    ddpjob_train(
        work,
        model,
        data,
        "--batch-size",
        str(a.batch),
        "--epochs",
        "1000",
        "--max-steps",
        str(a.steps),
        "--save-every",
        "0",
        "--log-every",
        str(WARM),
    )
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["event"] == "train"]
    first, last = train[0], train[-1]  # steps WARM and a.steps
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


def bare_steps_per_s(work: Path, a: argparse.Namespace) -> float:
    out = run(
        torchrun(
            2, str(REPO / "bench/bare_ddp.py"), str(a.width), str(a.depth), str(a.samples), str(a.batch), str(a.steps)
        ),
        cwd=work,
        BENCH_T0="0",
        BENCH_WARM=str(WARM),
    )
    return float(re.search(r"steps_per_s (\S+)", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=16384)
    a = parser.parse_args()
    bare, ours = [], []
    for i in range(a.repeats):  # interleaved, so drift in machine load hits both
        with tempfile.TemporaryDirectory() as tmp:
            bare.append(bare_steps_per_s(Path(tmp), a))
            ours.append(ddpjob_steps_per_s(Path(tmp) / f"run{i}", a))
    rows = [
        ["bare DDP loop", median(bare), ", ".join(f"{v:.1f}" for v in bare)],
        ["ddpjob train", median(ours), ", ".join(f"{v:.1f}" for v in ours)],
    ]
    table(
        f"loop: steps/s, 2 procs gloo CPU, MLP width {a.width} depth {a.depth}, batch {a.batch}, "
        f"steps {WARM}..{a.steps}",
        ["loop", "median steps/s", "runs"],
        rows,
    )
    print(f"\nratio ddpjob / bare = {median(ours) / median(bare):.3f} (target >= 0.98)")


if __name__ == "__main__":
    main()
