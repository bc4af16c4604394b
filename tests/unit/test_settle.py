"""The one settle rule (thinvm.host.memory.wait_settled) of the demo, the
trims and the benchmarks: a reading has settled once it has not fallen by
more than a step for the quiet time, or has fallen by what was expected."""

from thinvm.host.memory import SETTLE_QUIET, wait_settled
from thinvm.units import MiB


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_settled_once_reporting_stops_giving_memory_back() -> None:
    """Reporting returns 256 MiB per 2 s pass, three times, then nothing:
    settled the quiet time after the last drop."""
    clock = FakeClock()
    start = clock.now

    def rss() -> int:
        passes = min(3, int((clock.now - start) // 2))
        return 1500 * MiB - passes * 256 * MiB

    settled = wait_settled(rss, 60, clock=clock, sleep=clock.sleep)
    assert settled.settled and settled.value == 1500 * MiB - 3 * 256 * MiB
    assert settled.last_drop_s == 6.0
    assert settled.seconds == 6.0 + SETTLE_QUIET


def test_small_wobbles_do_not_count_as_drops() -> None:
    clock = FakeClock()
    wobble = iter([500 * MiB, 499 * MiB, 500 * MiB, 498 * MiB] * 10)
    settled = wait_settled(lambda: next(wobble), 60, clock=clock, sleep=clock.sleep)
    assert settled.settled and settled.last_drop_s == 0.0
    assert settled.seconds == SETTLE_QUIET


def test_the_timeout_ends_a_wait_that_still_falls() -> None:
    clock = FakeClock()
    settled = wait_settled(
        lambda: 10_000 * MiB - int(clock.now) * 8 * MiB, 60, clock=clock, sleep=clock.sleep
    )
    assert not settled.settled and settled.seconds == 60.0


def test_enough_ends_the_wait_without_the_quiet_time() -> None:
    """Falls 100 MiB per poll for ever: only `enough` can end it early."""
    clock = FakeClock()
    values = iter(range(4000 * MiB, 0, -100 * MiB))
    settled = wait_settled(
        lambda: next(values), 60, enough=300 * MiB, clock=clock, sleep=clock.sleep
    )
    assert settled.settled and settled.value == 3700 * MiB
    assert settled.seconds == 1.5  # three polls of 0.5 s
