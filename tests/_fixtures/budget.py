"""Each test's time budget, by marker, checked on the machine running it (issue 68: the suite crept
to an hour on 2-core AVX2 CPUs, one end-to-end test at a time).

A test whose call phase passes its marker's budget fails, saying by how much and what to do; so does a
setup phase (fixtures: a server, a warm-start) over the slow budget. pytest-timeout (pytest.ini) stays
the guard against a hang; this is the guard against creep. Measurements belong in bench/, not here.

A test that cannot yet do its job within its marker's budget carries its own,
`@pytest.mark.budget(seconds, reason="...")`, about twice its measured time on a 2-core AVX2 CPU: the
check still catches it creeping, and docs/development.md lists every such test as over the target.

SEARCH_R1_TEST_BUDGET=off lifts the check (a profiler attached, a machine far slower than the 2-core
CPUs the budgets were set on).
"""
from __future__ import annotations

import os

import pytest

# seconds; a marker's budget, the first that applies (unmarked tests: "default")
BUDGET_S = {"slow": 180.0, "default": 60.0}
SETUP_BUDGET_S = 180.0
OFF_ENV = "SEARCH_R1_TEST_BUDGET"


def budget_for(item: pytest.Item) -> tuple[str, float]:
    """(marker, seconds): the test's own `budget` marker, else the first marker in BUDGET_S it carries,
    else the default."""
    own = item.get_closest_marker("budget")
    if own is not None:
        if not own.args or not own.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget needs the seconds and a reason= saying "
                                    f"why the test cannot yet fit its marker's budget")
        return "budget", float(own.args[0])
    for marker, seconds in BUDGET_S.items():
        if item.get_closest_marker(marker) is not None:
            return marker, seconds
    return "default", BUDGET_S["default"]


def over_budget(when: str, duration: float, marker: str, budget: float) -> str | None:
    """The failure text when a phase took longer than its budget, else None."""
    limit = max(SETUP_BUDGET_S, budget) if when == "setup" else budget
    if when not in ("setup", "call") or duration <= limit:
        return None
    what = "its fixtures' setup" if when == "setup" else f"the test (marker: {marker})"
    return (f"over its time budget: {what} took {duration:.0f} s, the budget is {limit:.0f} s "
            f"(tests/_fixtures/budget.py). Make it do less work to reach the same assertions: a tiny model, "
            f"one step, a fixture shared with the tests that need the same state; a measurement goes to "
            f"bench/. {OFF_ENV}=off lifts the check while profiling.")


def pytest_configure(config):
    config.addinivalue_line("markers", "budget(seconds, reason): this test's own time budget, over its marker's "
                                       "(tests/_fixtures/budget.py)")


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with whole files reordered by their longest test budget, longest first (stable: files of
    equal budget, and the tests inside a file, keep their order). `make test` hands each file to one of
    two pytest-xdist workers in this order; a long file handed out last would run alone at the end."""
    longest: dict[str, float] = {}
    for item in items:
        longest[item.fspath.strpath] = max(longest.get(item.fspath.strpath, 0.0), budget_for(item)[1])
    rank = {path: i for i, path in enumerate(sorted(longest, key=lambda path: -longest[path]))}
    return sorted(items, key=lambda item: rank[item.fspath.strpath])


def pytest_collection_modifyitems(config, items):
    items[:] = longest_files_first(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.passed or os.environ.get(OFF_ENV, "").lower() == "off":
        return
    message = over_budget(report.when, report.duration, *budget_for(item))
    if message:
        report.outcome = "failed"
        report.longrepr = message
