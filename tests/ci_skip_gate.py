"""The CI skip gate: under CI a test that skips checked nothing.

When THINVM_CI=1 (.ci/run sets it) any skip, xfail or xpass fails the run,
unless THINVM_CI_EXPECTED_SKIPS declares it expected on this machine: one
entry a line, equal to the skip's reason, or to the test's node id or a
prefix of it that ends where a part of the node id does (a module, a class,
a parametrised test).  docs/test-suite.md has the rules.  tests/conftest.py
loads it by importing pytest_configure; it imports nothing of thinvm.
"""

import os
from dataclasses import dataclass

import pytest

CI_ENV = "THINVM_CI"
CI_EXPECTED_SKIPS_ENV = "THINVM_CI_EXPECTED_SKIPS"


@dataclass(frozen=True)
class Skip:
    """A test (or a module, at collection) that ended without checking anything."""

    nodeid: str
    outcome: str  # SKIPPED, XFAIL or XPASS
    reason: str


def skip_in(report: pytest.TestReport | pytest.CollectReport) -> Skip | None:
    """The skip, xfail or xpass that a report records; None for a pass or failure."""
    xfail_reason = getattr(report, "wasxfail", None)
    if xfail_reason is not None and report.skipped:
        return Skip(report.nodeid, "XFAIL", str(xfail_reason))
    if xfail_reason is not None and report.passed:
        return Skip(report.nodeid, "XPASS", str(xfail_reason))
    if not report.skipped:
        return None
    # (path, line, reason); pytest.skip() puts "Skipped: " before the reason.
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple | list) else str(longrepr)
    return Skip(report.nodeid, "SKIPPED", reason.removeprefix("Skipped: "))


class CiSkipGate:
    """Collects the undeclared skips and fails the session if there are any.

    Registered on the controller only: with pytest-xdist the workers'
    reports reach the controller's pytest_runtest_logreport and, for a
    module skipped at collection, pytest_collectreport.
    """

    def __init__(self, expected: list[str]) -> None:
        self.expected = expected
        self.unexpected: dict[tuple[str, str], Skip] = {}

    def declared(self, skip: Skip) -> bool:
        return any(
            entry in (skip.reason, skip.nodeid)
            or skip.nodeid.startswith((entry + "::", entry + "["))
            for entry in self.expected
        )

    def record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        skip = skip_in(report)
        if skip is not None and not self.declared(skip):
            self.unexpected.setdefault((skip.nodeid, skip.outcome), skip)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.unexpected and session.exitstatus in passing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unexpected:
            return
        tr = terminalreporter
        tr.section(f"{CI_ENV}=1: unexpected skips", sep="=", red=True, bold=True)
        tr.line(
            f"{len(self.unexpected)} skipped or xfail/xpass tests not declared expected "
            "on this machine:",
            red=True,
        )
        for skip in self.unexpected.values():
            tr.line(f"{skip.outcome} {skip.nodeid} - {skip.reason}")
        tr.line(
            "Install what they need in scripts/setup.sh, or, for what this kind of "
            f"machine never has, declare them in {CI_EXPECTED_SKIPS_ENV} (docs/test-suite.md)."
        )


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(CI_ENV) != "1" or hasattr(config, "workerinput"):
        return  # not under CI, or an xdist worker: its controller judges
    expected = os.environ.get(CI_EXPECTED_SKIPS_ENV, "").splitlines()
    gate = CiSkipGate([entry.strip() for entry in expected if entry.strip()])
    config.pluginmanager.register(gate, "thinvm-ci-skip-gate")
