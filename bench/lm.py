"""The language model: `ddpjob train` vs a hand-written DDP loop of the same model, data and
optimizer (bench/bare_lm.py), tokens/s, eager and with --compile, in interleaved pairs.

examples/lm.py's tiny_lm (byte vocabulary, dim 128, 4 layers, 4 heads, block 128) on stdlib_text,
2 processes under torchrun, gloo, CPU; AdamW (lr 3e-3) with the cosine schedule on both sides,
ddpjob with its default settings and no checkpoints. Per-step times inside rank 0 over a fixed
window (bench/steptimes.py); ratio and its confidence interval as bench/paired.py says.
    python bench/lm.py [--pairs 6] [--modes eager compile] [--batch 16] [--window 50,250] [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import steptimes
from common import REPO, ddpjob_train, run, torchrun
from paired import report, run_pairs

EPOCHS = 10  # the cosine schedule runs over them on both sides; the timed steps end within them


def specs(a: argparse.Namespace) -> tuple[str, str]:
    return f"examples.lm:tiny_lm(block={a.block})", f"examples.lm:stdlib_text(block={a.block})"


def ddpjob_times(work: Path, a: argparse.Namespace, compiled: bool, *more: str) -> dict[str, Any]:
    """``ddpjob train`` of the language model, ``more`` flags added; rank 0's steptimes record."""
    model, data = specs(a)
    out = work / "times"
    timed = f"bench.steptimes:timed(data={data!r}, out={str(out)!r}, first={a.first}, last={a.last}, val=False)"
    flags = ["--batch-size", str(a.batch), "--epochs", str(EPOCHS), "--max-steps", str(a.last + 1)]
    flags += ["--save-every", "0", *(["--compile"] if compiled else []), *more]
    ddpjob_train(work, model, timed, *flags)
    return steptimes.read(out)


def bare_times(work: Path, a: argparse.Namespace, compiled: bool) -> dict[str, Any]:
    model, data = specs(a)
    work.mkdir(parents=True)
    out = work / "times"
    args = ["--model", model, "--data", data, "--batch", str(a.batch), "--steps", str(a.last + 1)]
    args += ["--epochs", str(EPOCHS), "--times", str(out), "--window", f"{a.first},{a.last}"]
    run(torchrun(2, str(REPO / "bench/bare_lm.py"), *args, *(["--compile"] if compiled else [])), cwd=work)
    return steptimes.read(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6, help="interleaved pairs per mode")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--window", default="50,250", help="FIRST,LAST: the steps timed")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 pair per mode over steps 5..20")
    a = parser.parse_args()
    if a.quick:
        a.pairs, a.window = 1, "5,20"
    a.first, a.last = map(int, a.window.split(","))
    tokens_per_step = a.batch * a.block * 2
    for mode in a.modes:
        compiled = mode == "compile"
        print(f"\n{mode}: pairs of runs, {a.last + 1} steps each ...", flush=True)
        pairs = run_pairs(
            a.pairs,
            lambda work: ddpjob_times(work, a, compiled),  # noqa: B023 - used within the iteration
            lambda work: bare_times(work, a, compiled),  # noqa: B023
            lambda p: print(f"  ratio {p.ratio:.3f} (ddpjob {'first' if p.ours_first else 'second'})", flush=True),
        )
        report(
            f"lm ({mode}): tokens/s over steps {a.first}..{a.last}, 2 procs gloo CPU, tiny_lm block {a.block}, "
            f"batch {a.batch} per rank",
            pairs,
            unit="tokens/s",
            scale=tokens_per_step,
        )


if __name__ == "__main__":
    main()
