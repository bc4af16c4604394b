"""The demo's tables: every row lines up whatever its cells hold."""

from thinvm.demo import format_table


def test_columns_fit_the_widest_cell() -> None:
    rows = [["verify pattern on destination", "1.00", "x"], ["boot", "12.50", "accel tcg"]]
    lines = format_table(["step", "seconds", "note"], rows, right={1})
    assert len({len(line) for line in lines}) == 1, lines
    # Every column boundary sits at the same offset on every line.
    bars = {tuple(i for i, ch in enumerate(line) if ch == "|") for line in lines}
    assert len(bars) == 1, lines
    assert lines[1] == "|-------------------------------|--------:|-----------|"
    assert lines[3].startswith("| boot ") and "|   12.50 |" in lines[3]
