"""warm_free_memory on this host: real memory, real page faults."""

import pytest

from thinvm.host import memory
from thinvm.units import MiB


def test_warms_what_it_is_asked_for_in_whole_huge_pages() -> None:
    warmed, seconds = memory.warm_free_memory(33 * MiB)
    assert warmed == 32 * MiB  # rounded down to 2 MiB
    assert 0 < seconds < 60


def test_leaves_the_headroom_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    avail = memory.WARM_HEADROOM + 8 * MiB
    monkeypatch.setattr(memory, "host_meminfo", lambda: {"MemAvailable": avail})
    assert memory.warm_free_memory(1 << 40)[0] == 8 * MiB
    monkeypatch.setattr(memory, "host_meminfo", lambda: {"MemAvailable": memory.WARM_HEADROOM})
    assert memory.warm_free_memory(1 << 40) == (0, 0.0)
