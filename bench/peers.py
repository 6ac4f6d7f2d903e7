"""ddpjob against its peers: the same jobs through `ddpjob train`, a hand-written loop, Lightning
Fabric and HF Accelerate, with DDP and with FSDP2, in interleaved rounds.

Jobs (as bench/lm.py and bench/loop.py run them): examples/lm.py's tiny_lm on stdlib_text (batch 16
sequences of 128 tokens per rank, tokens/s) and the synthetic MLP (width 256, depth 2, batch 64 per
rank, samples/s). Every side: 2 processes under the same torchrun (OMP_NUM_THREADS=1), gloo, CPU,
seed 0, fused AdamW (lr 3e-3, no weight decay) with a cosine schedule of the same length, no
checkpoints, no validation. FSDP2: `--strategy fsdp2` in ddpjob; `fully_shard` by hand; Fabric's
ModelParallelStrategy with `fully_shard`; the shard units are ddpjob's default blocks (tiny_lm's
Blocks, the MLP's Linears) on every side. Not Accelerate: 1.15 enables its FSDP plugin only on
GPUs and other accelerators (AcceleratorState's FSDP branch is for the MULTI_GPU, MULTI_NPU, ...
types); on CPU (MULTI_CPU) it ignores the plugin without a word and wraps the model in DDP, which
bench/peer_loop.py refuses. The
hand-written DDP loops are bench/bare_lm.py and bench/bare_ddp.py, the others bench/peer_loop.py.

A round runs every side once, the order rotated each round so that the machine's drift falls on
all alike (bench/paired.py). Per side: steady-state throughput over a fixed window of steps timed
inside rank 0 (bench/steptimes.py), and the whole process's time from launching torchrun to the
start of step 1 (the first batch fetch). ddpjob's ratio to each peer is taken within each round,
and summarised by its median and sign-test interval. Fabric and Accelerate are bench-only extras
(`pip install -e .[peers]`); without them this prints one line and exits 0.
    python bench/peers.py [--rounds 4] [--jobs lm mlp] [--strategies ddp fsdp2] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm
import loop
import steptimes
from common import REPO, run, table, torchrun
from paired import Timer, median_ci, pair, report, run_rounds, sign_test

PEERS = ("bare", "fabric", "accelerate")
MLP = loop.CONFIGS["default"]  # width, depth, batch per rank


def peer_times(work: Path, a: argparse.Namespace, framework: str, strategy: str, job: str) -> dict[str, Any]:
    """bench/peer_loop.py under torchrun: one peer's run of ``job``."""
    work.mkdir(parents=True)
    out = work / "times"
    if job == "lm":
        model, data = lm.specs(a)
        batch, epochs, blocks = a.batch, lm.EPOCHS, "Block"
    else:
        width, depth, batch = MLP
        model = f"ddpjob.plugins:synthetic_mlp(width={width}, depth={depth})"
        data, epochs, blocks = f"ddpjob.plugins:synthetic(samples={a.samples})", loop.EPOCHS, "Linear"
    args = ["--framework", framework, "--strategy", strategy, "--model", model, "--data", data]
    args += ["--blocks", blocks, "--batch", str(batch), "--steps", str(a.last + 1), "--epochs", str(epochs)]
    args += ["--times", str(out), "--window", f"{a.first},{a.last}"]
    run(torchrun(2, str(REPO / "bench/peer_loop.py"), *args), cwd=work)
    return steptimes.read(out)


def timers(a: argparse.Namespace, job: str, strategy: str) -> dict[str, Timer]:
    """Each side's run of ``job`` with ``strategy``; the hand-written DDP loops are lm's and loop's."""
    flags = ["--strategy", strategy, *(["--checkpoint-format", "dcp"] if strategy == "fsdp2" else [])]  # its format
    if job == "lm":
        sides: dict[str, Timer] = {"ddpjob": lambda work: lm.ddpjob_times(work, a, False, *flags)}
        bare: Timer = lambda work: lm.bare_times(work, a, False)  # noqa: E731
    else:
        mlp = argparse.Namespace(**{**vars(a), "ddpjob_flags": " ".join(flags)})
        sides = {"ddpjob": lambda work: loop.ddpjob_times(work, mlp, *MLP)}
        bare = lambda work: loop.bare_times(work, mlp, *MLP)  # noqa: E731
    sides["bare"] = bare if strategy == "ddp" else lambda work: peer_times(work, a, "torch", strategy, job)
    for framework in PEERS[1:] if strategy == "ddp" else ("fabric",):  # Accelerate: no FSDP on CPU (above)
        sides[framework] = lambda work, f=framework: peer_times(work, a, f, strategy, job)  # type: ignore[misc]
    return {name: launched(timer) for name, timer in sides.items()}


def launched(timer: Timer) -> Timer:
    """``timer``, its record given ``startup``: seconds from launch to the start of step 1."""

    def timed(work: Path) -> dict[str, Any]:
        start = time.time()
        record = timer(work)
        return {**record, "startup": record["first_fetch"] - start}

    return timed


def interval(ratios: Sequence[float]) -> str:
    low, high, cover = median_ci(ratios)
    return f"{statistics.median(ratios):.3f} [{low:.3f}, {high:.3f}] ({100 * cover:.0f}%)"


def summary(name: str, rounds: list[dict[str, dict[str, Any]]], unit: str, scale: float) -> list[list[object]]:
    """Print each peer's pairs (bench/paired.py's table) and return the summary rows of this configuration."""
    rows: list[list[object]] = []
    rates = {
        side: statistics.median(len(r[side]["seconds"]) / sum(r[side]["seconds"]) for r in rounds) for side in rounds[0]
    }
    starts = {side: statistics.median(r[side]["startup"] for r in rounds) for side in rounds[0]}
    peers = [side for side in rounds[0] if side != "ddpjob"]
    best = max(peers, key=lambda p: rates[p])
    for peer in peers:
        pairs = [pair(r, "ddpjob", peer) for r in rounds]
        report(f"{name}: ddpjob vs {peer}, {unit}", pairs, unit=unit, scale=scale, baseline=peer)
        start_ratios = [r["ddpjob"]["startup"] / r[peer]["startup"] for r in rounds]
        later = sum(s > 1 for s in start_ratios)
        rows.append(
            [
                name,
                peer + (" (best)" if peer == best else ""),
                f"{rates[peer] * scale:.0f}",
                f"{rates['ddpjob'] * scale:.0f}",
                interval([p.ratio for p in pairs]),
                f"{starts[peer]:.2f}",
                f"{starts['ddpjob']:.2f}",
                interval(start_ratios) + f", later in {later}/{len(rounds)} (p={sign_test(later, len(rounds)):.2f})",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per configuration (each side runs once)")
    parser.add_argument("--jobs", nargs="+", choices=("lm", "mlp"), default=["lm", "mlp"])
    parser.add_argument("--strategies", nargs="+", choices=("ddp", "fsdp2"), default=["ddp", "fsdp2"])
    parser.add_argument("--lm-window", default="5,25", help="FIRST,LAST: the language model's steps timed")
    parser.add_argument("--mlp-window", default="50,300", help="FIRST,LAST: the MLP's steps timed")
    parser.add_argument("--batch", type=int, default=16, help="the language model's sequences per rank")
    parser.add_argument("--block", type=int, default=128, help="the language model's tokens per sequence")
    parser.add_argument("--samples", type=int, default=16384, help="the MLP's data set")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 round, short windows")
    parser.add_argument("--save", default="", help="FILE: every round's records as JSON, for a later look")
    a = parser.parse_args()
    missing = [m for m in ("lightning", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"peers: skipped, {' and '.join(missing)} not installed (pip install -e '.[peers]')")
        return
    if a.quick:
        a.rounds, a.lm_window, a.mlp_window = 1, "2,6", "5,30"
    a.log_every, rows = 10, list[list[object]]()  # ddpjob's default logging interval, as in loop.py
    saved: dict[str, list[dict[str, dict[str, Any]]]] = {}
    for job in a.jobs:
        a.first, a.last = map(int, (a.lm_window if job == "lm" else a.mlp_window).split(","))
        unit, scale = ("tokens/s", a.batch * a.block * 2) if job == "lm" else ("samples/s", MLP[2] * 2)
        for strategy in a.strategies:
            name = f"{job} {strategy}"
            print(f"\n{name}: {a.rounds} rounds, {a.last + 1} steps each ...", flush=True)
            rounds = []
            for records in run_rounds(a.rounds, timers(a, job, strategy)):
                rounds.append(records)
                print(
                    "  "
                    + ", ".join(f"{s} {len(r['seconds']) / sum(r['seconds']) * scale:.0f}" for s, r in records.items()),
                    flush=True,
                )
            rows += summary(name, rounds, unit, scale)
            saved[name] = rounds
            if a.save:
                Path(a.save).write_text(json.dumps(saved))
    header = ["configuration", "peer", "peer rate", "ddpjob rate", "rate ddpjob/peer: median [CI]"]
    header += ["peer s to step 1", "ddpjob s to step 1", "start-up ddpjob/peer: median [CI]"]
    table("peers: medians; ratios per round, median [sign-test interval] (coverage)", header, rows)


if __name__ == "__main__":
    main()
