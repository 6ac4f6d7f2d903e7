"""tests/flaky.py, the summary of `make flaky`: a test counts at most once per round; a round is a
measure only if pytest finished it and its report reads; a test absent from a round, or a selection
that measured no test, is a failure (a typo in K, skips), not a clean bill."""

from pathlib import Path

import pytest

import flaky

A, B = "tests/process/test_faults.py::test_a", "tests/process/test_faults.py::test_b"
HEAD = '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
TAIL = "</testsuite></testsuites>"
CALL_AND_TEARDOWN = f"""{HEAD}
<testcase classname="tests.process.test_faults" name="test_a"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="tests.process.test_faults" name="test_a"><error message="failed on teardown">y</error></testcase>
<testcase classname="tests.process.test_faults" name="test_b" />
{TAIL}"""
PASSED = f"""{HEAD}<testcase classname="tests.process.test_faults" name="test_a" />
<testcase classname="tests.process.test_faults" name="test_b" />{TAIL}"""
ONLY_A = f"""{HEAD}<testcase classname="tests.process.test_faults" name="test_a" />{TAIL}"""
B_SKIPPED = f"""{HEAD}<testcase classname="tests.process.test_faults" name="test_a" />
<testcase classname="tests.process.test_faults" name="test_b"><skipped message="not root" /></testcase>{TAIL}"""
NOTHING_RAN = f"""{HEAD}{TAIL}"""


def rounds(tmp_path: Path, *reports: str | None, statuses: tuple[str, ...]) -> list[str]:
    """Round reports in TMP_PATH, each with its pytest exit status beside it ("": none written)."""
    paths = []
    for i, report in enumerate(reports, 1):
        path = tmp_path / f"round-{i}.xml"
        if report is not None:
            path.write_text(report)
        if statuses[i - 1]:
            path.with_suffix(".rc").write_text(statuses[i - 1] + "\n")
        paths.append(str(path))
    return paths


def test_a_test_that_fails_in_call_and_errors_in_teardown_counts_once_in_its_round(tmp_path, capsys):
    paths = rounds(tmp_path, CALL_AND_TEARDOWN, CALL_AND_TEARDOWN, statuses=("1", "1"))
    s = flaky.summarise([Path(p) for p in paths])
    assert set(s.ran) == {A, B} and s.failed == {A: 2} and s.rounds == 2
    assert s.causes[A] == {"assert 1 == 2", "failed on teardown"}
    assert flaky.main(paths) == 1
    assert f"failed 2 of 2: {A}" in capsys.readouterr().out


def test_rounds_that_all_passed_are_a_clean_bill(tmp_path, capsys):
    assert flaky.main(rounds(tmp_path, PASSED, PASSED, statuses=("0", "0"))) == 0
    assert "2 rounds measured, 2 tests, 0 failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "second, status, words",
    [
        (PASSED, "2", "round-2.xml: pytest exited 2 (interrupted"),  # a Ctrl-C'd round's partial report
        (PASSED, "3", "round-2.xml: pytest exited 3"),  # INTERNALERROR
        (None, "1", "round-2.xml: no readable report (FileNotFoundError)"),  # no report at all
        (PASSED[: len(PASSED) // 2], "1", "round-2.xml: no readable report (ParseError)"),  # truncated
        (PASSED, "4", "round-2.xml: pytest exited 4 (a usage error)"),
        (ONLY_A, "0", f"ran in 1 of 2 rounds only (missing from the others' reports): {B}"),
        (PASSED, "", "round-2.xml: no exit status"),  # the shell died with pytest before writing it
    ],
    ids=["interrupted", "internal-error", "no-report", "truncated-report", "usage-error", "test-absent", "no-status"],
)
def test_a_round_that_is_no_measure_is_named_and_fails_the_summary(tmp_path, capsys, second, status, words):
    assert flaky.main(rounds(tmp_path, PASSED, second, statuses=("0", status))) == 1
    assert words in capsys.readouterr().out


def test_a_skipped_test_is_named_as_not_measured_in_that_round(tmp_path, capsys):
    assert flaky.main(rounds(tmp_path, PASSED, B_SKIPPED, statuses=("0", "0"))) == 0
    assert f"skipped in 1 of 2 (not measured there): {B}" in capsys.readouterr().out


def test_rounds_that_ran_no_test_fail_naming_the_selection(tmp_path, capsys):
    assert flaky.main(rounds(tmp_path, NOTHING_RAN, statuses=("5",))) != 0
    assert "no test ran" in capsys.readouterr().out


def test_a_selection_whose_every_test_was_skipped_measured_nothing(tmp_path, capsys):
    only_skips = B_SKIPPED.replace('<testcase classname="tests.process.test_faults" name="test_a" />', "")
    assert flaky.main(rounds(tmp_path, only_skips, statuses=("0",))) == 1
    assert "or every one was skipped" in capsys.readouterr().out


def test_a_test_skipped_in_its_call_that_errors_in_teardown_counts_as_failed_not_skipped(tmp_path, capsys):
    skip_then_error = B_SKIPPED.replace(
        "</testcase>",
        '</testcase><testcase classname="tests.process.test_faults" name="test_b"><error message="teardown" /></testcase>',
    )
    assert flaky.main(rounds(tmp_path, skip_then_error, statuses=("1",))) == 1
    out = capsys.readouterr().out
    assert f"failed 1 of 1: {B}" in out and "skipped in" not in out
