"""Guest workloads driven through the agent (thinvm-mem in the guest)."""

from dataclasses import dataclass
from typing import Any

from thinvm.guest.agent import AgentClient
from thinvm.host.memory import parse_meminfo
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
