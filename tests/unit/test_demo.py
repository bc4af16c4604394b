"""The demo's pure logic: its tables line up whatever their cells hold,
the guest has settled once its host RSS is steady, and the migrations'
table (the downtime rule itself: tests/unit/test_downtime_rule.py)."""

from thinvm.demo import (
    StackRun,
    describe_placement,
    format_table,
    migration_rows,
    rss_steady,
    settle,
)
from thinvm.units import MiB
from thinvm.vm.migrate import MigrationResult
from thinvm.vm.stack import STOCK_BEST, THINVM


def test_columns_fit_the_widest_cell() -> None:
    rows = [["verify pattern on destination", "1.00", "x"], ["boot", "12.50", "accel tcg"]]
    lines = format_table(["step", "seconds", "note"], rows, right={1})
    assert len({len(line) for line in lines}) == 1, lines
    # Every column boundary sits at the same offset on every line.
    bars = {tuple(i for i, ch in enumerate(line) if ch == "|") for line in lines}
    assert len(bars) == 1, lines
    assert lines[1] == "|-------------------------------|--------:|-----------|"
    assert lines[3].startswith("| boot ") and "|   12.50 |" in lines[3]


# -- guest settles: host RSS steady -------------------------------------------


def test_rss_is_steady_only_after_a_whole_window_of_history() -> None:
    flat = [(float(t), 500 * MiB) for t in range(4)]
    assert not rss_steady([])
    assert not rss_steady(flat)  # 0..3 s: less than 4 s of history
    assert rss_steady([*flat, (4.0, 500 * MiB)])


def test_rss_steady_measures_from_the_sample_window_seconds_back() -> None:
    """Polls a little over 1 s apart: the sample taken 4 s or more before
    the newest one counts, not only those within the window."""
    drop = [(0.0, 600 * MiB), (1.01, 500 * MiB), (2.02, 500 * MiB), (3.03, 500 * MiB)]
    assert not rss_steady([*drop, (4.04, 500 * MiB)])  # 100 MiB since 4.04 s ago
    assert rss_steady([*drop, (4.04, 500 * MiB), (5.05, 500 * MiB)])


def test_rss_steady_needs_less_than_the_tolerance() -> None:
    base = 500 * MiB
    wobble = [(0.0, base), (1.0, base + 2 * MiB), (2.0, base - 1 * MiB), (3.0, base), (4.0, base)]
    assert rss_steady(wobble)  # spans 3 MiB
    assert not rss_steady([*wobble[:-1], (4.0, base + 3 * MiB)])  # spans 4 MiB
    assert not rss_steady([(0.0, base), (4.0, base - 256 * MiB)])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_settle_returns_once_reporting_stops_giving_memory_back() -> None:
    """Reporting returns 256 MiB per 2 s pass, then nothing: steady 4 s
    after the last change."""
    clock = FakeClock()
    start = clock.now

    def sample() -> int:
        passes = min(3, int((clock.now - start) // 2))
        return 1500 * MiB - passes * 256 * MiB

    seconds, steady = settle(sample, clock=clock, sleep=clock.sleep)
    assert steady
    assert seconds == 10.0  # last change at 6 s, then 4 s without one


def test_settle_gives_up_at_the_cap() -> None:
    clock = FakeClock()
    seconds, steady = settle(
        lambda: int(clock.now) * MiB * 8, cap=60.0, clock=clock, sleep=clock.sleep
    )
    assert not steady
    assert seconds == 60.0


# -- the downtime verdict and the tables --------------------------------------


def test_the_placement_names_each_sides_cpus() -> None:
    assert describe_placement(([0], [1])) == "source on CPU 0, destination on CPU 1"
    assert describe_placement(([0, 1], [2, 3])) == "source on CPUs 0, 1, destination on CPUs 2, 3"
    assert "only CPU" in describe_placement(None)


def test_the_migration_table_has_a_row_per_stack() -> None:
    def result(ms: int, sent: int, downtime: int, skipped: int) -> MigrationResult:
        return MigrationResult("completed", ms, downtime, 0, sent, 0, 0, 1, ms / 1000, skipped)

    runs = [
        StackRun("stock-best", STOCK_BEST, [], result(1300, 600 * MiB, 26, 0), 300, True),
        StackRun("thinvm", THINVM, [], result(120, 140 * MiB, 4, 393216), 300, True),
    ]
    assert migration_rows(runs) == [
        ["stock-best", "1300 ms", "600.00 MiB", "26", "0"],
        ["thinvm", "120 ms", "140.00 MiB", "4", "393216"],
    ]
