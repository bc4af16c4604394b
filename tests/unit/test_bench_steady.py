"""reclaim-steady's window figures (pure arithmetic over RSS samples) and its
continuous reader."""

import pytest

from thinvm.bench.scenarios import steady
from thinvm.bench.scenarios.steady import SETTLED_WITHIN, window_figures
from thinvm.errors import ThinvmError
from thinvm.units import MiB


def test_a_falling_window_settles_where_it_stays_near_its_end() -> None:
    samples = [(0.0, 2000 * MiB), (10.0, 1500 * MiB), (20.0, 700 * MiB), (30.0, 650 * MiB),
               (40.0, 660 * MiB)]  # fmt: skip
    figures = window_figures(samples)
    assert figures["rss_end_bytes"] == 660 * MiB
    assert figures["rss_peak_bytes"] == 2000 * MiB
    assert figures["settled_s"] == 20.0
    # Trapezoids: (1750 + 1100 + 675 + 655) * 10 / 40
    assert figures["rss_mean_bytes"] == (1750 + 1100 + 675 + 655) * 10 * MiB // 40


def test_a_flat_window_is_settled_from_its_start() -> None:
    samples = [(0.0, 900 * MiB), (10.0, 900 * MiB + SETTLED_WITHIN)]
    figures = window_figures(samples)
    assert figures["settled_s"] == 0.0
    assert figures["rss_mean_bytes"] == 900 * MiB + SETTLED_WITHIN // 2


def test_a_single_sample_is_its_own_mean() -> None:
    assert window_figures([(0.0, 5 * MiB)])["rss_mean_bytes"] == 5 * MiB


def test_the_continuous_reader_is_a_choice_and_counts_whole_reads() -> None:
    assert steady.reader_param({"reader": "loop"}) == "loop"
    with pytest.raises(ThinvmError, match="choose none or loop"):
        steady.reader_param({"reader": "often"})
    line = steady.reader_command("/srv/thinvm-ws/data")
    # Backgrounded with every stream redirected, so the agent's shell
    # returns at once; a line per whole read of the data set.
    assert line.endswith(">/dev/null 2>&1 </dev/null &"), line
    assert f"do echo >>{steady.READER_PASSES}; done" in line
    assert "dd if=/srv/thinvm-ws/data of=/dev/null" in line
