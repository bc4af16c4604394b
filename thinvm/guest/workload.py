"""Guest workloads driven through the agent (thinvm-mem in the guest)."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinvm.guest.agent import AgentClient
from thinvm.host.memory import parse_meminfo, parse_vmstat
from thinvm.units import MiB

PATTERN_PATH = "/dev/shm/thinvm-pattern"


@dataclass(frozen=True)
class PatternCheck:
    pages: int
    bad: int
    first_bad: int

    @property
    def ok(self) -> bool:
        return self.bad == 0 and self.pages > 0


def meminfo(agent: AgentClient) -> dict[str, int]:
    return parse_meminfo(agent.check("cat /proc/meminfo").stdout)


def vmstat(agent: AgentClient) -> dict[str, int]:
    """The guest's /proc/vmstat counters by name."""
    return parse_vmstat(agent.check("cat /proc/vmstat").stdout)


def touch(agent: AgentClient, size: int) -> dict[str, Any]:
    """Fault in `size` bytes of anonymous memory in the guest, then free it."""
    result: dict[str, Any] = agent.check(f"thinvm-mem touch {size // MiB}").json()
    return result


def touch_free_memory(agent: AgentClient, leave: int = 96 * MiB) -> int:
    """Touch (and free) all but `leave` bytes of the guest's free memory.

    Afterwards every guest page the allocator hands out is backed on the
    host, so a balloon inflation must lower host RSS page for page.
    """
    size = max(0, meminfo(agent)["MemFree"] - leave)
    touch(agent, size)
    return size


def pattern_write(agent: AgentClient, size: int, seed: int, path: str = PATTERN_PATH) -> None:
    agent.check(f"thinvm-mem pattern write {path} {size // MiB} --seed {seed}")


def pattern_verify(agent: AgentClient, seed: int, path: str = PATTERN_PATH) -> PatternCheck:
    result = agent.run(f"thinvm-mem pattern verify {path} --seed {seed}")
    data = result.json()
    return PatternCheck(int(data["pages"]), int(data["bad"]), int(data["first_bad"]))


def pattern_corrupt(agent: AgentClient, page: int, path: str = PATTERN_PATH) -> None:
    agent.check(f"thinvm-mem pattern corrupt {path} --page {page}")


# -- a scratch disk: page cache the guest can reclaim ------------------------
#
# The initramfs root is tmpfs, whose pages are not reclaimable page cache,
# so guests that need a real page cache get a virtio-blk disk and read it
# raw: /dev/vda's pages are ordinary file LRU pages ("Buffers").


def scratch_disk(path: Path, size: int) -> Path:
    """A raw image of non-zero data (one random MiB, repeated): zero pages
    would be sent as zero pages and hide what the cache costs a migration."""
    block = os.urandom(MiB)
    with path.open("wb") as f:
        for _ in range(size // MiB):
            f.write(block)
    return path


def disk_args(path: Path, direct: bool = False) -> list[str]:
    """QEMU arguments for the scratch disk.  Read-only: the source and the
    destination of a migration, or several guests, open it at once.
    `direct` bypasses the host page cache, so the host's copy of the data
    is not charged to the guests' memory budget."""
    cache = ",cache.direct=on" if direct else ""
    return ["-drive", f"file={path},if=virtio,format=raw,readonly=on{cache}"]


SCRATCH_DEVICE = "/dev/vda"  # a busybox guest's only disk


def hold_disk_open(agent: AgentClient, device: str = SCRATCH_DEVICE) -> None:
    """A block device's page cache is dropped when its last opener closes
    it: a sleeping process keeps the device open, as a mounted filesystem
    would."""
    agent.check(f"sleep 1000000 <{device} >/dev/null 2>&1 &")


def read_disk_command(
    size: int, passes: int = 1, skip: int = 0, source: str = SCRATCH_DEVICE
) -> str:
    """The guest shell command that reads `size` bytes of the scratch disk
    (or of another file, `source`), from `skip` on, `passes` times."""
    return (
        f"for i in $(seq {passes}); do dd if={source} of=/dev/null bs=1M "
        f"count={size // MiB} skip={skip // MiB} 2>/dev/null; done"
    )


def read_disk(
    agent: AgentClient,
    size: int,
    passes: int = 1,
    skip: int = 0,
    timeout: float = 300.0,
    source: str = SCRATCH_DEVICE,
) -> None:
    agent.check(read_disk_command(size, passes, skip, source), timeout=timeout)
