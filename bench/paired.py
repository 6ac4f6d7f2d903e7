"""Interleaved pairs: two loops run alternately, each timed per step inside its own process, and
their throughput ratio reported with a distribution-free confidence interval.

Pair i runs both loops back to back, ddpjob first in even pairs and the bare loop first in odd ones,
so drift in the machine's load and any first-run/second-run effect fall on both alike; a pair whose
two runs saw different thread counts, world size or torch (bench/steptimes.py's setting) stops
the benchmark. Each run
gives its per-step wall times over the same fixed window (bench/steptimes.py); its throughput is
window steps / window seconds. The pair's ratio is ddpjob's throughput over the bare loop's.
With more than two loops (bench/peers.py), a round runs each once, the order rotated by one each
round, and ddpjob's pair with each other loop is taken within the round.

The summary is the median of the pair ratios with the order-statistic (sign-test) confidence
interval for a median: [r_(k), r_(n-k+1)] of the sorted ratios, k the largest for which a
Binomial(n, 1/2) gives coverage >= 95%. It assumes only that pairs are independent; its coverage
is exact (and printed: with few pairs 95% is out of reach). Also the sign test: in how many pairs
ddpjob was slower, and the two-sided p-value of that count if both loops were equally fast.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def run_rounds(count: int, timers: Mapping[str, Timer]) -> Iterator[dict[str, dict[str, Any]]]:
    """``count`` rounds, each running every loop of ``timers`` once, the order rotated by one each
    round (with two loops: ddpjob first in even rounds, the other first in odd ones); yields each
    round's records by name, in the order they ran. Loops that saw different threads, world size or
    torch within a round stop the benchmark."""
    names = list(timers)
    for i in range(count):
        order = names[i % len(names) :] + names[: i % len(names)]
        with tempfile.TemporaryDirectory() as tmp:
            records = {name: timers[name](Path(tmp) / name) for name in order}
        settings = {name: r["setting"] for name, r in records.items()}
        if len({repr(s) for s in settings.values()}) > 1:
            raise SystemExit(f"unfair round: the loops ran with different settings: {settings}")
        yield records


def pair(records: Mapping[str, dict[str, Any]], ours: str, theirs: str) -> Pair:
    """The pair of ``ours`` and ``theirs`` in one round's records."""
    order = list(records)
    return Pair(
        order.index(ours) < order.index(theirs),
        Run.of(records[ours]["seconds"]),
        Run.of(records[theirs]["seconds"]),
    )


def run_pairs(count: int, ours: Timer, bare: Timer, progress: Callable[[Pair], None] = print) -> list[Pair]:
    pairs = []
    for records in run_rounds(count, {"ours": ours, "bare": bare}):
        pairs.append(pair(records, "ours", "bare"))
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


def report(
    title: str, pairs: Sequence[Pair], unit: str = "steps/s", scale: float = 1.0, baseline: str = "bare"
) -> float:
    """Print the pairs and the summary; returns the median ratio. ``scale`` turns steps/s into ``unit``;
    ``baseline`` names the other loop."""
    rows = [
        [
            i + 1,
            "ddpjob" if p.ours_first else baseline,
            f"{p.bare.steps_per_s * scale:.1f}",
            f"{p.ours.steps_per_s * scale:.1f}",
            f"{p.bare.median_ms:.1f}",
            f"{p.ours.median_ms:.1f}",
            f"{p.ratio:.3f}",
        ]
        for i, p in enumerate(pairs)
    ]
    header = ["pair", "first", f"{baseline} {unit}", f"ddpjob {unit}", f"{baseline} ms/step (median)"]
    header += ["ddpjob ms/step", "ratio"]
    table(title, header, rows)
    ratios = [p.ratio for p in pairs]
    low, high, cover = median_ci(ratios)
    slower = sum(r < 1 for r in ratios)
    bare_rate = statistics.median(p.bare.steps_per_s for p in pairs) * scale
    ours_rate = statistics.median(p.ours.steps_per_s for p in pairs) * scale
    print(
        f"\nmedians: {baseline} {bare_rate:.1f} {unit}, ddpjob {ours_rate:.1f} {unit}\n"
        f"ratio ddpjob / {baseline}: median {statistics.median(ratios):.3f} of {len(ratios)} pairs, "
        f"{100 * cover:.1f}% CI [{low:.3f}, {high:.3f}] (sign-test order statistics), "
        f"range {min(ratios):.3f}..{max(ratios):.3f} (target >= 0.98)\n"
        f"ddpjob slower in {slower} of {len(ratios)} pairs (sign test p = {sign_test(slower, len(ratios)):.3f})",
        flush=True,
    )
    return statistics.median(ratios)
