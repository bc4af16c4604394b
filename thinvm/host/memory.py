"""Host-side memory of a process, read from /proc."""

from dataclasses import dataclass
from pathlib import Path

from thinvm.units import KiB


@dataclass(frozen=True)
class HostMemory:
    """Memory a QEMU process holds on the host, in bytes."""

    rss: int
    anonymous: int
    anon_huge: int
    shmem: int
    swap: int


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
