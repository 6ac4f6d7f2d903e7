"""How often each test failed over rounds of the same tests: `make flaky N=5` runs the timing-
sensitive tier (the `serial` mark) N times, each round writing a JUnit XML file, and this prints
the summary. Usage: python tests/flaky.py ROUND.xml ...

A test that failed in any round is listed with its count and the distinct first lines of its
failure messages (the cause to look for). A test counts at most once per round: one that fails in
its call and errors in its teardown has two JUnit entries. The exit code is 1 if any test failed or
no test ran at all (a K that selects nothing), else 0.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def node_id(classname: str, name: str) -> str:
    """pytest's node id from JUnit's classname (``tests.test_x`` or ``tests.test_x.TestY``) and name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (REPO / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def summarise(rounds: list[Path]) -> tuple[Counter[str], dict[str, set[str]], set[str]]:
    """Per test: in how many rounds it failed or errored, the first lines of why, and every test seen."""
    failed: Counter[str] = Counter()
    causes: dict[str, set[str]] = defaultdict(set)
    seen: set[str] = set()
    for path in rounds:
        failed_here: set[str] = set()
        for case in ET.parse(path).getroot().iter("testcase"):
            test = node_id(case.get("classname", ""), case.get("name", ""))
            seen.add(test)
            problems = [e for e in case if e.tag in ("failure", "error")]
            if problems:
                failed_here.add(test)
                causes[test].update(((p.get("message") or p.tag).splitlines() or [p.tag])[0][:200] for p in problems)
        failed.update(failed_here)
    return failed, causes, seen


def main(argv: list[str]) -> int:
    rounds = [Path(a) for a in argv if Path(a).is_file()]
    missing = [a for a in argv if not Path(a).is_file()]
    failed, causes, seen = summarise(rounds)
    print(f"{len(rounds)} rounds, {len(seen)} tests, {len(failed)} failed in at least one round")
    if not seen:
        print("  no test ran: the selection (K, or the serial mark) matched no test")
    for round_file in missing:
        print(f"  round without a report (pytest itself failed): {round_file}")
    for test, count in failed.most_common():
        print(f"  failed {count} of {len(rounds)}: {test}")
        for cause in sorted(causes[test]):
            print(f"      {cause}")
    return 1 if failed or missing or not seen else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
