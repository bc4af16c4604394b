"""The quiet gate during a run: other QEMUs that appear while it goes on."""

import time
from typing import Any

from thinvm.bench.quiet import RunWatch, gate_watched, run_was_quiet
from thinvm.bench.report import quiet_warning


def test_the_watch_keeps_the_most_other_qemus_it_saw() -> None:
    seen = iter([0, 2, 1])
    with RunWatch(0.01, count=lambda: next(seen, 0)) as watch:
        deadline = time.monotonic() + 5
        while watch.looks < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watch.as_record()["other_qemu_during"] == 2
    assert watch.looks >= 3


def test_a_run_is_quiet_at_its_start_and_all_along() -> None:
    assert run_was_quiet({"quiet": True, "other_qemu_during": 0})
    assert not run_was_quiet({"quiet": True, "other_qemu_during": 1})
    assert not run_was_quiet({"quiet": False, "other_qemu_during": 0})
    assert run_was_quiet({"quiet": True})  # recorded before the watch existed


def result(*quiet: dict[str, Any]) -> dict[str, Any]:
    return {"load": {"gate": {"max_load": 1.0}}, "runs": [{"quiet": q} for q in quiet]}


def test_a_record_with_noisy_runs_says_so_above_its_table() -> None:
    calm = {"quiet": True, "other_qemu_during": 0}
    assert quiet_warning(result(calm, calm)) is None
    warning = quiet_warning(result(calm, {"quiet": True, "other_qemu_during": 1}))
    assert warning is not None and "1 of 2 runs" in warning


def test_a_record_made_before_the_watch_is_marked_in_the_scenario_table() -> None:
    watched = result({"quiet": True, "other_qemu_during": 0})
    at_start = result({"quiet": True})
    ungated = {"load": {}, "runs": [{"quiet": {"quiet": True}}]}
    assert gate_watched(watched) == ""
    assert gate_watched(at_start) == "quiet gate at each run's start only"
    assert gate_watched(ungated) == "no quiet gate"
