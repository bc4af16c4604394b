"""Issue 19's rules for a shared machine: spread, the overlap verdict, the quiet gate."""

from typing import Any

import pytest

from thinvm.bench import quiet, report, runner
from thinvm.bench import results as bench_results
from thinvm.bench import scenarios as bench_scenarios
from thinvm.bench.quiet import Observation, QuietGate
from thinvm.bench.results import NO_CLEAR_DIFFERENCE

from .test_bench import _Quiet, _scenario


def _stats(*values: float) -> dict[str, Any]:
    stats = bench_results.summarize(list(values))
    assert stats is not None
    return stats


def test_spread_is_range_over_median() -> None:
    assert _stats(90, 100, 110)["spread"] == 0.2
    assert _stats(5.0)["spread"] == 0.0
    assert _stats(0, 0)["spread"] is None  # nothing to be relative to
    assert bench_results.spread({"median": 4, "min": 3, "max": 6}) == 0.75


@pytest.mark.parametrize(
    ("mine", "reference", "verdict"),
    [
        ((40, 50, 60), (100, 110, 120), "lower"),
        ((130, 140), (100, 110, 120), "higher"),
        ((90, 105, 115), (100, 110, 120), NO_CLEAR_DIFFERENCE),  # ranges overlap
        ((120, 130), (100, 110, 120), NO_CLEAR_DIFFERENCE),  # they touch at 120
        ((100, 130), (110, 115), NO_CLEAR_DIFFERENCE),  # one inside the other
        ((7,), (7,), NO_CLEAR_DIFFERENCE),
    ],
)
def test_verdict_needs_ranges_apart(
    mine: tuple[float, ...], reference: tuple[float, ...], verdict: str
) -> None:
    assert bench_results.verdict(_stats(*mine), _stats(*reference)) == verdict
    assert bench_results.verdict(_stats(*mine), None) is None


def test_summarize_runs_records_the_verdict() -> None:
    runs = [
        {"variant": v, "run": k, "metrics": {"ms": ms}}
        for k, (a, b) in enumerate([(100, 90), (110, 120), (120, 95)], 1)
        for v, ms in (("stock-best", a), ("thinvm", b))
    ]
    summary = bench_results.summarize_runs(runs, ["stock-best", "thinvm"], "stock-best")
    thinvm = summary["thinvm"]["ms"]
    assert thinvm["ratio"] == pytest.approx(95 / 110)
    assert thinvm["verdict"] == NO_CLEAR_DIFFERENCE


def test_a_cell_with_overlapping_ranges_claims_no_ratio() -> None:
    reference = {**_stats(100, 110, 120), "ratio": None, "ratio_to": None}
    overlapping = {**_stats(90, 95, 105), "ratio": 95 / 110, "ratio_to": "stock-best"}
    apart = {**_stats(40, 50, 60), "ratio": 50 / 110, "ratio_to": "stock-best"}
    cell = report.format_cell("migration_ms", overlapping, "stock-best", reference)
    assert cell == f"95 ms [90 ms\u2013105 ms] {NO_CLEAR_DIFFERENCE}"
    assert "\u00d7" not in cell
    cell = report.format_cell("migration_ms", apart, "stock-best", reference)
    assert cell.endswith("\u00d70.45")


def test_a_target_met_on_overlapping_ranges_says_so() -> None:
    summary = {
        "stock-best": {"ms": _stats(100, 110, 120)},
        "thinvm": {"ms": _stats(90, 95, 105)},
    }
    target = {
        "label": "faster",
        "variant": "thinvm",
        "reference": "stock-best",
        "metric": "ms",
        "at_most": 1.0,
        "ratio": 95 / 110,
        "met": True,
    }
    assert f"**met** (the ranges overlap: {NO_CLEAR_DIFFERENCE})" in report.render_target(
        target, summary
    )
    summary["thinvm"]["ms"] = _stats(40, 50, 60)
    assert report.render_target(target, summary).endswith("**met**.")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_quiet_gate_starts_at_once_on_a_quiet_machine() -> None:
    clock = _Clock()
    seen = quiet.wait_quiet(
        QuietGate(max_load=1.0, max_wait_s=60, poll_s=5),
        look=lambda: Observation(0.4, 0),
        sleep=clock.sleep,
        clock=clock,
    )
    assert seen == {"load": 0.4, "other_qemu": 0, "waited_s": 0.0, "quiet": True}


def test_quiet_gate_waits_for_the_load_and_foreign_qemus_to_go() -> None:
    clock = _Clock()
    sights = iter([Observation(3.0, 0), Observation(0.5, 2), Observation(0.9, 0)])
    waits: list[float] = []
    seen = quiet.wait_quiet(
        QuietGate(max_load=1.0, max_wait_s=60, poll_s=5),
        look=lambda: next(sights),
        sleep=clock.sleep,
        clock=clock,
        on_wait=lambda _seen, waited: waits.append(waited),
    )
    assert seen == {"load": 0.9, "other_qemu": 0, "waited_s": 10.0, "quiet": True}
    assert waits == [0.0, 5.0]


def test_quiet_gate_gives_up_after_its_bound_and_records_a_noisy_start() -> None:
    clock = _Clock()
    seen = quiet.wait_quiet(
        QuietGate(max_load=1.0, max_wait_s=12, poll_s=5),
        look=lambda: Observation(2.5, 1),
        sleep=clock.sleep,
        clock=clock,
    )
    # Polls at 0, 5 and 10 s, then sleeps the 2 s left: never more than the bound.
    assert seen == {"load": 2.5, "other_qemu": 1, "waited_s": 12.0, "quiet": False}


def test_quiet_gate_without_a_wait_only_records() -> None:
    seen = quiet.wait_quiet(QuietGate(max_wait_s=0), look=lambda: Observation(9.0, 3))
    assert seen == {"load": 9.0, "other_qemu": 3, "waited_s": 0.0, "quiet": False}


def test_foreign_qemu_count_leaves_out_our_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quiet, "processes_named", lambda prefix: {10: 1, 11: 500, 12: 11})
    ours = {11, 12}  # 11 is our child, 12 its child
    monkeypatch.setattr(quiet, "descends_from", lambda pid, own: pid in ours)
    monkeypatch.setattr(quiet, "read_cmdline", lambda pid: b"qemu-system-x86_64\0-m\0")
    assert quiet.foreign_qemu_count(own=500) == 1


def test_foreign_qemu_count_leaves_out_ours_under_libvirt_and_the_exited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quiet, "processes_named", lambda prefix: {10: 1, 20: 1, 30: 1})
    monkeypatch.setattr(quiet, "descends_from", lambda pid, own: False)
    cmdlines = {10: b"qemu-system-x86_64\0-name\0guest=bench-a,debug-threads=on\0", 20: None}
    monkeypatch.setattr(quiet, "read_cmdline", lambda pid: cmdlines.get(pid, b"qemu\0"))
    # 10 is a benchmark cluster's guest, 20 exited after being listed: only 30 counts.
    assert quiet.foreign_qemu_count(own=500) == 1


def test_runs_record_what_the_gate_saw() -> None:
    runs, _ = runner.run_scenario(_scenario(), 1, _Quiet())  # type: ignore[arg-type]
    for run in runs:
        assert set(run["quiet"]) == {
            "load",
            "other_qemu",
            "waited_s",
            "quiet",
            "other_qemu_during",
            "looks_during",
        }
        assert run["other_qemu"] == run["quiet"]["other_qemu"]


def test_recorded_results_get_at_least_five_interleaved_runs() -> None:
    assert bench_scenarios.MIN_RUNS >= 5
    for spec in bench_scenarios.SCENARIOS.values():
        assert spec.runs >= 5, spec.name
    assert runner.alternation_order(["A", "B"], 2) == [(1, "A"), (1, "B"), (2, "A"), (2, "B")]
