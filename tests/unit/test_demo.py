"""The demo's pure logic: its tables line up whatever their cells hold,
and the migrations' table (the settle rule: tests/unit/test_settle.py;
the downtime rule itself: tests/unit/test_downtime_rule.py)."""

from thinvm.demo import (
    StackRun,
    describe_placement,
    format_table,
    migration_rows,
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
