"""warm_free_memory on this host: real memory, real page faults."""

import os

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


def test_chunks_go_back_just_ahead_of_the_consumer() -> None:
    chunk, lead = 64 * MiB, 512 * MiB
    assert memory.chunks_to_release(0, 0, lead, chunk, 100) == 8  # the lead first
    assert memory.chunks_to_release(lead, 0, lead, chunk, 92) == 0
    assert memory.chunks_to_release(lead, 1, lead, chunk, 92) == 1  # any growth: one more
    assert memory.chunks_to_release(lead, 200 * MiB, lead, chunk, 92) == 4
    assert memory.chunks_to_release(lead, 10 << 30, lead, chunk, 3) == 3  # no more than held


def test_a_reserve_holds_its_memory_until_the_consumer_needs_it() -> None:
    with memory.WarmReserve(9 * MiB, lead=4 * MiB, chunk=4 * MiB) as reserve:
        assert reserve.size == 8 * MiB and reserve.held == 8 * MiB  # whole 2 MiB pages
        reserve.release_for(0)
        assert reserve.held == 4 * MiB and reserve.released == 4 * MiB
        reserve.release_for(MiB)
        assert reserve.held == 0 and reserve.released == 8 * MiB
        reserve.release_for(1 << 30)  # nothing left: no error
    assert reserve.held == 0


def test_a_process_rss_from_its_counters() -> None:
    assert memory.rss_bytes(os.getpid()) > MiB
