"""tests/flaky.py, the summary of `make flaky`: a test counts at most once per round, and a
selection that ran no test is a failure (a typo in K), not a clean bill."""

import flaky

CALL_AND_TEARDOWN = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.process.test_faults" name="test_a"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="tests.process.test_faults" name="test_a"><error message="failed on teardown">y</error></testcase>
<testcase classname="tests.process.test_faults" name="test_b" />
</testsuite></testsuites>"""

NOTHING_RAN = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="0" /></testsuites>"""


def test_a_test_that_fails_in_call_and_errors_in_teardown_counts_once_in_its_round(tmp_path, capsys):
    rounds = [tmp_path / "round-1.xml", tmp_path / "round-2.xml"]
    for path in rounds:
        path.write_text(CALL_AND_TEARDOWN)
    failed, causes, seen = flaky.summarise(rounds)
    assert seen == {"tests/process/test_faults.py::test_a", "tests/process/test_faults.py::test_b"}
    assert failed == {"tests/process/test_faults.py::test_a": 2}
    assert causes["tests/process/test_faults.py::test_a"] == {"assert 1 == 2", "failed on teardown"}
    assert flaky.main([str(p) for p in rounds]) == 1
    assert "failed 2 of 2: tests/process/test_faults.py::test_a" in capsys.readouterr().out


def test_rounds_that_ran_no_test_fail_naming_the_selection(tmp_path, capsys):
    rounds = [tmp_path / "round-1.xml"]
    rounds[0].write_text(NOTHING_RAN)
    assert flaky.main([str(p) for p in rounds]) != 0
    assert "no test ran" in capsys.readouterr().out
