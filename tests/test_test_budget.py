"""The per-marker time budget (tests/_fixtures/budget.py) fails a passing test that took too long, and
only that: checked on a pytest run of its own (pytester), with the budgets shrunk to fractions of a
second."""
from __future__ import annotations

from pathlib import Path

from tests._fixtures.budget import BUDGET_S, SETUP_BUDGET_S, over_budget

pytest_plugins = ["pytester"]


def test_budgets_are_three_minutes_for_slow_tests_and_less_for_the_rest():
    assert BUDGET_S["slow"] == SETUP_BUDGET_S == 180.0 and BUDGET_S["default"] < BUDGET_S["slow"]
    assert over_budget("call", 179.0, "slow", 180.0) is None
    assert "took 181 s, the budget is 180 s" in over_budget("call", 181.0, "slow", 180.0)
    assert over_budget("setup", 100.0, "default", 60.0) is None  # fixtures get the slow budget
    assert over_budget("setup", 300.0, "budget", 400.0) is None  # or the test's own, when larger
    assert over_budget("teardown", 1000.0, "default", 60.0) is None


def test_a_test_over_its_markers_budget_fails_and_says_so(pytester, monkeypatch):
    monkeypatch.delenv("SEARCH_R1_TEST_BUDGET", raising=False)
    pytester.makeconftest("""
import tests._fixtures.budget as budget
budget.BUDGET_S = {"slow": 0.5, "default": 0.1}
pytest_plugins = ["tests._fixtures.budget"]
""")
    pytester.makeini(f"[pytest]\npythonpath = {Path(__file__).resolve().parents[1]}\nmarkers =\n    slow: slow\n")
    pytester.makepyfile("""
import time, pytest

def test_quick():
    pass

def test_over_default():
    time.sleep(0.3)

@pytest.mark.slow
def test_slow_within():
    time.sleep(0.3)

@pytest.mark.budget(0.5, reason="measured 0.3 s")
def test_own_budget():
    time.sleep(0.3)

def test_failing_stays_a_plain_failure():
    time.sleep(0.3)
    assert False, "its own message"
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=2)
    out = result.stdout.str()
    assert "test_over_default - over its time budget" in out or "over its time budget: the test (marker: default)" in out
    assert "its own message" in out
    monkeypatch.setenv("SEARCH_R1_TEST_BUDGET", "off")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=4, failed=1)


class _Item:
    """What `longest_files_first` reads of a pytest item: its file and its markers."""

    def __init__(self, path: str, name: str, *markers):
        self.fspath, self.name, self.markers = type("P", (), {"strpath": path})(), name, dict(markers)

    def get_closest_marker(self, name):
        return self.markers.get(name)


def test_files_with_the_longest_budgets_go_first_each_file_kept_whole_and_in_order():
    import pytest as _pytest

    from tests._fixtures.budget import longest_files_first

    own = _pytest.mark.budget(600, reason="r").mark
    slow = _pytest.mark.slow.mark
    items = [_Item("a.py", "a1"), _Item("b.py", "b1"), _Item("b.py", "b2", ("slow", slow)), _Item("c.py", "c1"),
             _Item("d.py", "d1"), _Item("d.py", "d2", ("budget", own)), _Item("a.py", "a2")]
    assert [i.name for i in longest_files_first(items)] == ["d1", "d2", "b1", "b2", "a1", "a2", "c1"]
