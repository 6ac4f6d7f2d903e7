"""Interleaved pairs: two loops run alternately, each timed per step inside its own process, and
their throughput ratio reported with a distribution-free confidence interval.

Pair i runs both loops back to back, ddpjob first in even pairs and the bare loop first in odd ones,
so drift in the machine's load and any first-run/second-run effect fall on both alike; a pair whose
two runs saw different thread counts, world size or torch (bench/steptimes.py's setting) stops
the benchmark. Each run
gives its per-step wall times over the same fixed window (bench/steptimes.py); its throughput is
window steps / window seconds. The pair's ratio is ddpjob's throughput over the bare loop's.

The summary is the median of the pair ratios with the order-statistic (sign-test) confidence
interval for a median: [r_(k), r_(n-k+1)] of the sorted ratios, k the largest for which a
Binomial(n, 1/2) gives coverage >= 95%. It assumes only that pairs are independent; its coverage
is exact (and printed: with few pairs 95% is out of reach). Also the sign test: in how many pairs
ddpjob was slower, and the two-sided p-value of that count if both loops were equally fast.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any

from common import table

Timer = Callable[[Path], dict[str, Any]]  # runs one loop in a work dir, returns rank 0's steptimes record


@dataclass(frozen=True)
class Run:
    steps_per_s: float
    median_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Run:
        return cls(len(seconds) / sum(seconds), 1000 * statistics.median(seconds))


@dataclass(frozen=True)
class Pair:
    ours_first: bool
    ours: Run
    bare: Run

    @property
    def ratio(self) -> float:
        return self.ours.steps_per_s / self.bare.steps_per_s


def run_pairs(count: int, ours: Timer, bare: Timer, progress: Callable[[Pair], None] = print) -> list[Pair]:
    pairs = []
    for i in range(count):
        ours_first = i % 2 == 0
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if ours_first:
                mine, theirs = ours(work / "ours"), bare(work / "bare")
            else:
                theirs = bare(work / "bare")
                mine = ours(work / "ours")
        if mine["setting"] != theirs["setting"]:
            raise SystemExit(f"unfair pair: ddpjob ran with {mine['setting']}, the bare loop with {theirs['setting']}")
        pairs.append(Pair(ours_first, Run.of(mine["seconds"]), Run.of(theirs["seconds"])))
        progress(pairs[-1])
    return pairs


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the order-statistic interval for the median of ``values``."""
    ranked, n = sorted(values), len(values)

    def coverage(k: int) -> float:  # P(r_(k) <= median <= r_(n-k+1)) = 1 - 2 P(Bin(n, 1/2) <= k-1)
        return 1 - 2 * sum(comb(n, j) for j in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ranked[k - 1], ranked[n - k], coverage(k)


def sign_test(below: int, n: int) -> float:
    """Two-sided p-value of ``below`` of ``n`` pairs falling on one side if either side were as likely."""
    tail = min(below, n - below)
    return min(1.0, 2 * sum(comb(n, j) for j in range(tail + 1)) / 2**n)


def report(title: str, pairs: Sequence[Pair], unit: str = "steps/s", scale: float = 1.0) -> float:
    """Print the pairs and the summary; returns the median ratio. ``scale`` turns steps/s into ``unit``."""
    rows = [
        [
            i + 1,
            "ddpjob" if p.ours_first else "bare",
            f"{p.bare.steps_per_s * scale:.1f}",
            f"{p.ours.steps_per_s * scale:.1f}",
            f"{p.bare.median_ms:.1f}",
            f"{p.ours.median_ms:.1f}",
            f"{p.ratio:.3f}",
        ]
        for i, p in enumerate(pairs)
    ]
    header = ["pair", "first", f"bare {unit}", f"ddpjob {unit}", "bare ms/step (median)", "ddpjob ms/step", "ratio"]
    table(title, header, rows)
    ratios = [p.ratio for p in pairs]
    low, high, cover = median_ci(ratios)
    slower = sum(r < 1 for r in ratios)
    bare_rate = statistics.median(p.bare.steps_per_s for p in pairs) * scale
    ours_rate = statistics.median(p.ours.steps_per_s for p in pairs) * scale
    print(
        f"\nmedians: bare {bare_rate:.1f} {unit}, ddpjob {ours_rate:.1f} {unit}\n"
        f"ratio ddpjob / bare: median {statistics.median(ratios):.3f} of {len(ratios)} pairs, "
        f"{100 * cover:.1f}% CI [{low:.3f}, {high:.3f}] (sign-test order statistics), "
        f"range {min(ratios):.3f}..{max(ratios):.3f} (target >= 0.98)\n"
        f"ddpjob slower in {slower} of {len(ratios)} pairs (sign test p = {sign_test(slower, len(ratios)):.3f})",
        flush=True,
    )
    return statistics.median(ratios)
