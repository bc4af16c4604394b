"""The lab host's price for fresh memory, sampled during a run."""

import time

from thinvm.bench.hostcost import FaultCostWatch
from thinvm.host.memory import fault_cost


def test_fault_cost_is_a_price_per_gib() -> None:
    # Between the warm price (~0.09 s/GiB) and far beyond the cold one:
    # what matters is that it is per GiB, not per probe.
    cost = fault_cost(4 << 20)
    assert 0.001 < cost < 60


def test_the_watch_samples_at_start_during_and_at_the_end() -> None:
    with FaultCostWatch(interval=0.05) as watch:
        time.sleep(0.2)
    assert len(watch.samples) >= 3
    metrics = watch.metrics
    assert metrics["host_fault_max_s_per_gib"] >= metrics["host_fault_s_per_gib"] > 0


def test_a_watch_never_opened_reports_nothing() -> None:
    assert FaultCostWatch().metrics == {
        "host_fault_s_per_gib": None,
        "host_fault_max_s_per_gib": None,
    }
