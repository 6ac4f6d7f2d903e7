"""How often each test failed over rounds of the same tests: `make flaky N=5` runs the timing-
sensitive tier (the `serial` mark) N times, each round writing a JUnit XML file and, beside it,
pytest's exit status (round-N.rc), and this prints the summary. Usage: python tests/flaky.py ROUND.xml ...

A test that failed in any round is listed with its count and the distinct first lines of its
failure messages (the cause to look for). A test counts at most once per round: one that fails in
its call and errors in its teardown has two JUnit entries.

A round is a measure only if pytest ended it itself (exit 0 or 1) and its report reads: an
interrupted round (exit 2, a collection error too) or an internal error (exit 3) writes a partial
report in which the unfinished tests look passed or are absent. Listed, and making the exit code 1:
a test that failed; a round without a readable report, or that pytest did not finish, or whose exit
status is missing; a test absent from some rounds' reports; no test measured at all (a K that
selects nothing, or only tests skipped here). Tests skipped in some round are listed too (not
measured there).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FINISHED = {"0", "1"}  # pytest's exit status when it ran every test: all passed, or some failed
WHY = {  # any other status: pytest did not run every test
    "2": "interrupted, or a collection error",
    "3": "an internal error",
    "4": "a usage error",
    "5": "no test collected",
}


def node_id(classname: str, name: str) -> str:
    """pytest's node id from JUnit's classname (``tests.test_x`` or ``tests.test_x.TestY``) and name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (REPO / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


@dataclass
class Summary:
    """Per test: in how many rounds it failed, skipped and ran, and the first lines of why it failed."""

    failed: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    ran: Counter[str] = field(default_factory=Counter)
    causes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    broken: list[str] = field(default_factory=list)  # rounds that are no measure, each with why
    rounds: int = 0  # rounds whose report was read


def unfinished(report: Path) -> str:
    """Why pytest did not finish the round of REPORT, from its exit status beside it; "" if it did.
    No status at all counts as unfinished too: a shell killed by the same Ctrl-C writes none."""
    rc_file = report.with_suffix(".rc")
    status = rc_file.read_text().strip() if rc_file.is_file() else ""
    if status in FINISHED:
        return ""
    return (
        f"pytest exited {status} ({WHY.get(status, 'killed or failed')})" if status else "no exit status (round-N.rc)"
    )


def summarise(reports: list[Path]) -> Summary:
    out = Summary()
    for path in reports:
        why = unfinished(path)
        try:
            cases = list(ET.parse(path).getroot().iter("testcase"))
        except (OSError, ET.ParseError) as exc:
            why = why or f"no readable report ({type(exc).__name__})"
            cases = []
        if why:
            out.broken.append(f"{path}: {why}")
            continue
        out.rounds += 1
        failed_here, skipped_here, ran_here = set(), set(), set()
        for case in cases:
            test = node_id(case.get("classname", ""), case.get("name", ""))
            ran_here.add(test)
            problems = [e for e in case if e.tag in ("failure", "error")]
            if problems:
                failed_here.add(test)
                out.causes[test].update(
                    ((p.get("message") or p.tag).splitlines() or [p.tag])[0][:200] for p in problems
                )
            elif any(e.tag == "skipped" for e in case):
                skipped_here.add(test)
        out.failed.update(failed_here)
        out.skipped.update(skipped_here - failed_here)
        out.ran.update(ran_here)
    return out


def main(argv: list[str]) -> int:
    s = summarise([Path(a) for a in argv])
    print(f"{s.rounds} rounds measured, {len(s.ran)} tests, {len(s.failed)} failed in at least one round")
    measured = [t for t, n in s.ran.items() if s.skipped[t] < n]
    if not measured:
        print("  no test ran: the selection (K, or the serial mark) matched no test, or every one was skipped")
    for why in s.broken:
        print(f"  round not measured: {why}")
    absent = sorted(t for t, n in s.ran.items() if n < s.rounds)
    for test in absent:
        print(f"  ran in {s.ran[test]} of {s.rounds} rounds only (missing from the others' reports): {test}")
    for test, count in s.failed.most_common():
        print(f"  failed {count} of {s.rounds}: {test}")
        for cause in sorted(s.causes[test]):
            print(f"      {cause}")
    for test, count in sorted(s.skipped.items()):
        print(f"  skipped in {count} of {s.rounds} (not measured there): {test}")
    return 1 if s.failed or s.broken or absent or not measured else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
