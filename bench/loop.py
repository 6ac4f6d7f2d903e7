"""Loop overhead: `ddpjob train` vs a minimal hand-written DDP loop doing the same work, in pairs.

2 processes under torchrun, gloo, CPU; the same synthetic MLP, data, batch size, AdamW and cosine
schedule on both sides (bench/bare_ddp.py is the bare loop), ddpjob with its default settings
(--log-every 10, straggler sharing, stop checks) and no checkpoints. Two configurations:
  default: MLP width 256, depth 2, batch 64 per rank
  heavy:   MLP width 1024, depth 2, batch 256 per rank
Each run is timed per step inside rank 0's process over a fixed window of steps
(bench/steptimes.py), in interleaved pairs with the ratio's confidence interval (bench/paired.py).
    python bench/loop.py [--pairs 10] [--configs default heavy] [--window 100,600] [--ddpjob-flags F] [--quick]
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import steptimes
from common import REPO, ddpjob_train, run, torchrun
from paired import report, run_pairs

CONFIGS = {"default": (256, 2, 64), "heavy": (1024, 2, 256)}  # width, depth, batch per rank
EPOCHS = 1000  # ddpjob's cosine runs over all of them: the bare loop is given the same length


def ddpjob_times(
    work: Path, a: argparse.Namespace, width: int, depth: int, batch: int, **environ: str
) -> dict[str, Any]:
    out = work / "times"
    data = f"ddpjob.plugins:synthetic(samples={a.samples})"
    ddpjob_train(
        work,
        f"ddpjob.plugins:synthetic_mlp(width={width}, depth={depth})",
        f"bench.steptimes:timed(data={data!r}, out={str(out)!r}, first={a.first}, last={a.last})",
        "--batch-size",
        str(batch),
        "--epochs",
        str(EPOCHS),
        "--max-steps",
        str(a.last + 1),
        "--save-every",
        "0",
        "--log-every",
        str(a.log_every),
        *shlex.split(a.ddpjob_flags),
        **environ,
    )
    return steptimes.read(out)


def bare_times(work: Path, a: argparse.Namespace, width: int, depth: int, batch: int) -> dict[str, Any]:
    work.mkdir(parents=True)
    out = work / "times"
    schedule = a.samples // (batch * 2) * EPOCHS
    args = [str(v) for v in (width, depth, a.samples, batch, a.last + 1)]
    options = ["--times", str(out), "--window", f"{a.first},{a.last}", "--schedule-steps", str(schedule)]
    run(torchrun(2, str(REPO / "bench/bare_ddp.py"), *args, *options), cwd=work, BENCH_T0="0")
    return steptimes.read(out)


def baseline(a: argparse.Namespace, shape: tuple[int, int, int]) -> Callable[[Path], dict[str, Any]]:
    """The bare loop, or ddpjob with --baseline-env's variable set."""
    if not a.baseline_env:
        return lambda work: bare_times(work, a, *shape)
    key, _, value = a.baseline_env.partition("=")
    return lambda work: ddpjob_times(work, a, *shape, **{key: value})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10, help="interleaved pairs per configuration")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["default", "heavy"])
    parser.add_argument("--window", default="100,600", help="FIRST,LAST: the steps timed")
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--log-every", type=int, default=10, help="ddpjob's logging interval (its default: 10)")
    parser.add_argument("--ddpjob-flags", default="", help="more flags for ddpjob train, e.g. '--tracker mlflow'")
    parser.add_argument(
        "--baseline-env",
        default="",
        help="KEY=VALUE: the baseline is ddpjob itself with this variable (e.g. TORCH_FR_BUFFER_SIZE=0: the flight "
        "recorder off), not the bare loop: the ratio is then the cost of what it switches off",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 pairs over steps 10..40")
    a = parser.parse_args()
    if a.quick:
        a.pairs, a.window = 2, "10,40"
    a.first, a.last = map(int, a.window.split(","))
    for name in a.configs:
        width, depth, batch = CONFIGS[name]
        shape = (width, depth, batch)
        print(f"\n{name}: pairs of runs, {a.last + 1} steps each ...", flush=True)
        pairs = run_pairs(
            a.pairs,
            lambda work: ddpjob_times(work, a, *shape),  # noqa: B023 - used within the iteration
            baseline(a, shape),
            lambda p: print(f"  ratio {p.ratio:.3f} (ddpjob {'first' if p.ours_first else 'second'})", flush=True),
        )
        against = f", baseline: ddpjob with {a.baseline_env}" if a.baseline_env else ""
        report(
            f"loop ({name}{against}): steps/s over steps {a.first}..{a.last}, 2 procs gloo CPU, "
            f"MLP width {width} depth {depth}, batch {batch} per rank",
            pairs,
        )


if __name__ == "__main__":
    main()
