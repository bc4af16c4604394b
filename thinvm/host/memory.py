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


def rss_bytes(pid: int) -> int:
    """A process's resident set from its counters (/proc/PID/statm): no
    page-table walk, so cheap to read often while the process runs."""
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * mmap.PAGESIZE


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
    seconds it took.  WarmReserve says why, and keeps it warm for longer."""
    with WarmReserve(nbytes) as reserve:
        return reserve.size, reserve.seconds


# The reserve hands memory back in chunks of this size, keeping this much
# handed back and not yet taken ahead of its consumer: enough for ~1 s of
# a destination that receives at 10 Gbit/s, little enough to be taken
# long before the lab host's reporting delay (2 s) runs out.
WARM_CHUNK = 64 * MiB
WARM_LEAD = 512 * MiB


def chunks_to_release(released: int, consumed: int, lead: int, chunk: int, held: int) -> int:
    """How many of `held` chunks to hand back so that what was handed back
    is at least `lead` bytes ahead of what the consumer has taken."""
    short = consumed + lead - released
    if short <= 0:
        return 0
    return min(held, -(-short // chunk))


class WarmReserve:
    """Free host memory faulted in now and handed back to the host just
    ahead of a consumer that allocates it (a destination QEMU filling its
    RAM), so that none of it lies free long enough to go cold.

    Why: a host that is itself a guest with free page reporting (this lab's
    machines are microVMs that report free 8 MiB blocks to their
    hypervisor) gets memory freed for a couple of seconds taken away, and
    the next process to fault it in pays for the hypervisor backing it
    again: 2.2 s of CPU per GiB measured here, against 0.09 s for memory
    that was freed just before.  A bare-metal host never pays that.  The
    kernel hands out free pages it has not reported before those it has,
    so memory released just before a consumer faults it in is what the
    consumer gets.  Memory warmed once and released at once (the way before
    issue 48) was cold again two seconds into a migration that took
    seventeen; held here, it cannot expire before it is used.

    `release_for(consumed)` hands back chunks as the consumer grows;
    leaving the context hands back the rest.
    """

    def __init__(self, nbytes: int, lead: int = WARM_LEAD, chunk: int = WARM_CHUNK) -> None:
        self.wanted = nbytes
        self.lead = lead
        self.chunk = chunk
        self.size = 0  # warmed: nbytes capped by the headroom, whole chunks
        self.seconds = 0.0  # how long warming took (how cold the host was)
        self.released = 0
        self._chunks: list[mmap.mmap] = []

    @property
    def held(self) -> int:
        return len(self._chunks) * self.chunk

    def __enter__(self) -> "WarmReserve":
        avail = host_meminfo().get("MemAvailable", 0)
        # Whole 2 MiB pages, then whole chunks (a last smaller one allowed).
        size = max(0, min(self.wanted, avail - WARM_HEADROOM)) // (2 << 20) * (2 << 20)
        start = time.monotonic()
        try:
            while self.size < size:
                piece = min(self.chunk, size - self.size)
                self._chunks.append(_fault_in(piece, huge=True))
                self.size += piece
        except BaseException:
            self._release_all()
            raise
        self.seconds = time.monotonic() - start if size else 0.0
        return self

    def release_for(self, consumed: int) -> None:
        """Hand back chunks until `lead` bytes lie ahead of `consumed`."""
        count = chunks_to_release(self.released, consumed, self.lead, self.chunk, len(self._chunks))
        for _ in range(count):
            area = self._chunks.pop()
            self.released += len(area)
            area.close()

    def _release_all(self) -> None:
        while self._chunks:
            self._chunks.pop().close()

    def __exit__(self, *exc: object) -> None:
        self._release_all()


def _fault_in(size: int, huge: bool) -> mmap.mmap:
    """`size` bytes of fresh anonymous memory, faulted in."""
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        with contextlib.suppress(OSError):
            area.madvise(mmap.MADV_HUGEPAGE)
    try:
        area.madvise(MADV_POPULATE_WRITE)
    except OSError:  # older kernel: touch a byte per page instead
        for offset in range(0, size, mmap.PAGESIZE):
            area[offset] = 1
    return area


# Enough to time (a few 2 MiB blocks), little enough to sample every second.
FAULT_PROBE_BYTES = 16 << 20


def fault_cost(nbytes: int = FAULT_PROBE_BYTES) -> float:
    """Seconds per GiB it costs now to fault in fresh anonymous memory: the
    price the next process that allocates pays (WarmReserve says why
    it varies on a host that is itself a guest: ~0.09 s per GiB for memory
    freed moments ago, ~2.2 s once the host's own hypervisor took it back).
    The memory is released again at once."""
    size = max(2 << 20, nbytes // (2 << 20) * (2 << 20))
    start = time.monotonic()
    _fault_in(size, huge=False).close()
    return (time.monotonic() - start) * (1 << 30) / size
