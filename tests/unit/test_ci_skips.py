"""The CI skip gate (tests/ci_skip_gate.py): under THINVM_CI=1 a skip, xfail or
xpass fails the run unless THINVM_CI_EXPECTED_SKIPS declares it.

Each test runs pytest on a small test file whose conftest loads the gate
exactly as the suite's conftest does (its pytest_configure).
"""

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]

GATE_CONFTEST = "from tests.ci_skip_gate import pytest_configure  # noqa: F401\n"

# One test of each kind that can end a run without checking anything,
# next to one that passes.
SKIPPING = """
import pytest

@pytest.fixture
def missing_tool():
    pytest.skip("no frobnicator")

def test_passes():
    pass

def test_skips_in_its_body():
    pytest.skip("needs a unicorn")

@pytest.mark.skipif(True, reason="not on this machine")
def test_skipped_by_mark():
    pass

def test_skipped_by_fixture(missing_tool):
    pass

@pytest.mark.xfail(reason="known bug 12")
def test_xfails():
    assert False

@pytest.mark.xfail(reason="fixed long ago")
def test_xpasses():
    pass
"""

SKIPPED_MODULE = """
import pytest

pytest.skip("whole module needs a unicorn", allow_module_level=True)

def test_never_runs():
    pass
"""

UNEXPECTED = {
    "test_skipping.py::test_skips_in_its_body": "needs a unicorn",
    "test_skipping.py::test_skipped_by_mark": "not on this machine",
    "test_skipping.py::test_skipped_by_fixture": "no frobnicator",
    "test_skipping.py::test_xfails": "known bug 12",
    "test_skipping.py::test_xpasses": "fixed long ago",
}


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest(GATE_CONFTEST)
    pytester.makepyfile(test_skipping=SKIPPING)
    # The gate lives in this repository's tests package.
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{path}" if path else str(REPO))
    monkeypatch.delenv("THINVM_CI", raising=False)
    monkeypatch.delenv("THINVM_CI_EXPECTED_SKIPS", raising=False)
    return pytester


def assert_listed(result: pytest.RunResult, unexpected: dict[str, str]) -> None:
    text = result.stdout.str()
    for nodeid, reason in unexpected.items():
        assert any(nodeid in line and reason in line for line in text.splitlines()), (
            f"{nodeid} ({reason}) not listed:\n{text}"
        )


def test_without_ci_a_skip_passes(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-p", "no:xdist")
    result.assert_outcomes(passed=1, skipped=3, xfailed=1, xpassed=1)
    assert result.ret == pytest.ExitCode.OK


def test_under_ci_every_undeclared_skip_fails_the_run(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("THINVM_CI", "1")
    suite.makepyfile(test_skipped_module=SKIPPED_MODULE)
    result = suite.runpytest("-p", "no:xdist")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert_listed(result, {**UNEXPECTED, "test_skipped_module.py": "whole module"})
    result.stdout.fnmatch_lines(["*6 skipped or xfail/xpass tests not declared expected*"])


def test_declared_skips_pass_and_the_rest_still_fail(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("THINVM_CI", "1")
    # By reason, by node id, by a node id's prefix (the parametrised test).
    suite.makepyfile(
        test_params="import pytest\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_p(n):\n    pytest.skip('param')\n"
    )
    declared = [
        "not on this machine",
        "test_skipping.py::test_skipped_by_fixture",
        "test_params.py::test_p",
        "test_skipping.py::test_x",  # a prefix of a name, not of a node id: no match
    ]
    monkeypatch.setenv("THINVM_CI_EXPECTED_SKIPS", "\n".join(declared))
    result = suite.runpytest("-p", "no:xdist")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    left = {k: v for k, v in UNEXPECTED.items() if "mark" not in k and "fixture" not in k}
    assert_listed(result, left)
    assert "test_skipped_by_mark" not in result.stdout.str().split("not declared expected")[1]
    assert "test_params.py" not in result.stdout.str().split("not declared expected")[1]

    monkeypatch.setenv("THINVM_CI_EXPECTED_SKIPS", "\n".join([*declared, *UNEXPECTED, "  ", ""]))
    assert suite.runpytest("-p", "no:xdist").ret == pytest.ExitCode.OK


def test_under_xdist_the_controller_sees_the_workers_skips(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `make test` runs the suite: three workers, whole files each."""
    monkeypatch.setenv("THINVM_CI", "1")
    suite.makepyfile(test_skipped_module=SKIPPED_MODULE)
    result = suite.runpytest_subprocess("-ra", "-n", "3", "--dist", "loadfile")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert_listed(result, {**UNEXPECTED, "test_skipped_module.py": "whole module"})
    result.stdout.fnmatch_lines(["*6 skipped or xfail/xpass tests not declared expected*"])
