"""Host-side memory of a process, read from /proc."""

import contextlib
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from thinvm.units import KiB, MiB


@dataclass(frozen=True)
class HostMemory:
    """Memory a QEMU process holds on the host, in bytes."""

    rss: int
    anonymous: int
    anon_huge: int
    shmem: int
    swap: int


# A reading (a QEMU's RSS, a cgroup's usage) has settled when it has not
# fallen by more than SETTLE_STEP for SETTLE_QUIET seconds: free page
# reporting starts 2 s after a free and returns a pass every 2 s, so 4 s
# without a drop means it has given back what it will.
SETTLE_QUIET = 4.0
SETTLE_STEP = 2 * MiB
SETTLE_POLL = 0.5


@dataclass(frozen=True)
class Settled:
    """How a wait for a falling reading ended."""

    value: int  # the last reading
    seconds: float  # how long the wait took
    last_drop_s: float  # when the reading last fell by more than the step
    settled: bool  # False: the timeout ended it while it still fell


def wait_settled(
    read: Callable[[], int],
    timeout: float,
    *,
    quiet: float = SETTLE_QUIET,
    step: int = SETTLE_STEP,
    poll: float = SETTLE_POLL,
    enough: int = 0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Settled:
    """Poll `read` every `poll` s until it has not fallen by more than
    `step` for `quiet` s, or has fallen by `enough` bytes in all (if not
    0: the caller knows what to expect and need not wait out the quiet), or
    `timeout` s have passed.  The one settle rule of the demo, the trims
    and the benchmarks."""
    start = clock()
    first = low = value = read()
    last_drop = start
    while True:
        now = clock()
        if now - last_drop >= quiet:
            return Settled(value, now - start, last_drop - start, True)
        if now - start >= timeout:
            return Settled(value, now - start, last_drop - start, False)
        sleep(poll)
        value = read()
        now = clock()
        if enough and first - value >= enough:
            return Settled(value, now - start, now - start, True)
        if value < low - step:
            low, last_drop = value, now


def _smaps_rollup(pid: int) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            values[parts[0].rstrip(":")] = int(parts[1]) * KiB
    return values


def process_memory(pid: int) -> HostMemory:
    """Rss, anonymous and THP-backed memory of a live process."""
    rollup = _smaps_rollup(pid)
    shmem = rollup.get("Shared_Clean", 0) + rollup.get("Shared_Dirty", 0)
    return HostMemory(
        rss=rollup.get("Rss", 0),
        anonymous=rollup.get("Anonymous", 0),
        anon_huge=rollup.get("AnonHugePages", 0),
        shmem=shmem,
        swap=rollup.get("Swap", 0),
    )


def host_meminfo() -> dict[str, int]:
    """/proc/meminfo of the host, in bytes."""
    return parse_meminfo(Path("/proc/meminfo").read_text())


def parse_vmstat(text: str) -> dict[str, int]:
    """Parse /proc/vmstat text (host's or a guest's) into counters by name."""
    counters: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            counters[name] = int(value)
    return counters


def parse_meminfo(text: str) -> dict[str, int]:
    """Parse meminfo text (host's or a guest's) into bytes per field."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields or not fields[0].isdigit():
            continue
        scale = KiB if len(fields) > 1 and fields[1] == "kB" else 1
        values[name.strip()] = int(fields[0]) * scale
    return values


# madvise(2) advice that faults a range in writable (Linux 5.14); Python's
# mmap module names it only from 3.13.
MADV_POPULATE_WRITE = 23
# What a warm-up leaves to the rest of the host.
WARM_HEADROOM = 2 << 30


def warm_free_memory(nbytes: int) -> tuple[int, float]:
    """Fault in `nbytes` of anonymous memory and release it again; return
    how much was warmed (capped to leave WARM_HEADROOM available) and the
    seconds it took.

    Why: a host that is itself a guest with free page reporting (this lab's
    machines are microVMs that report free 8 MiB blocks to their
    hypervisor) gets memory freed for a couple of seconds taken away, and
    the next process to fault it in pays for the hypervisor backing it
    again: 2.2 s of CPU per GiB measured here, against 0.09 s for memory
    that was freed just before.  A bare-metal host never pays that.  The
    kernel hands out free pages it has not reported before those it has,
    so memory warmed and released just before a measurement is what the
    measurement gets, and the seconds returned say how cold the host was.
    """
    avail = host_meminfo().get("MemAvailable", 0)
    size = max(0, min(nbytes, avail - WARM_HEADROOM)) // (2 << 20) * (2 << 20)
    if size == 0:
        return 0, 0.0
    start = time.monotonic()
    _fault_in_and_release(size, huge=True)  # huge pages, as QEMU asks for guest RAM
    return size, time.monotonic() - start


def _fault_in_and_release(size: int, huge: bool) -> None:
    """Fault in `size` bytes of fresh anonymous memory, then unmap it."""
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as area:
        if huge:
            with contextlib.suppress(OSError):
                area.madvise(mmap.MADV_HUGEPAGE)
        try:
            area.madvise(MADV_POPULATE_WRITE)
        except OSError:  # older kernel: touch a byte per page instead
            for offset in range(0, size, mmap.PAGESIZE):
                area[offset] = 1


# Enough to time (a few 2 MiB blocks), little enough to sample every second.
FAULT_PROBE_BYTES = 16 << 20


def fault_cost(nbytes: int = FAULT_PROBE_BYTES) -> float:
    """Seconds per GiB it costs now to fault in fresh anonymous memory: the
    price the next process that allocates pays (warm_free_memory says why
    it varies on a host that is itself a guest: ~0.09 s per GiB for memory
    freed moments ago, ~2.2 s once the host's own hypervisor took it back).
    The memory is released again at once."""
    size = max(2 << 20, nbytes // (2 << 20) * (2 << 20))
    start = time.monotonic()
    _fault_in_and_release(size, huge=False)
    return (time.monotonic() - start) * (1 << 30) / size
