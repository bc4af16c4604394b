"""Host-driven trim: a guest gives back cold memory now (docs/working-set.md).

The guest's agent reclaims cold page cache (TRIM, docs/protocol/agent.md)
and compacts; free page reporting then hands the freed blocks to QEMU,
which discards them.  With our driver the agent has them reported at
once (`report_now`, docs/guest-driver.md) and the answer says so: the
host has them back when the answer arrives.  Otherwise reporting is
asynchronous (a pass every 2 s, a sixteenth of each free list per pass),
so "done" is when the QEMU process's RSS has stopped falling.
"""

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from thinvm.errors import GuestError
from thinvm.guest.agent import AgentClient
from thinvm.host.memory import wait_settled
from thinvm.units import MiB, format_size

# A guest agent that does not PONG within this long is taken as absent.
SYNC_TIMEOUT = 10.0
# Compaction runs after the trim's own time bound; under TCG it takes
# seconds for a few GiB.
COMPACT_SLACK = 60.0
# Reporting hands back free 2 MiB blocks; once RSS has fallen by this
# share of what the guest's free memory grew by, the rest is the part
# too fragmented to report, and waiting out the quiet time gains little.
SETTLE_ENOUGH = 0.9
# Below this the guest freed nothing worth waiting for.
MIN_RECLAIM = 1 * MiB


@dataclass(frozen=True)
class TrimResult:
    """What a trim did, in the guest and on the host."""

    trimmed: bool  # the guest ran a trim
    note: str  # why not, or a caveat about the numbers
    rss_before: int
    rss_after: int
    settle_seconds: float  # from the end of the guest's trim to settled RSS
    guest: dict[str, Any] = field(default_factory=dict)  # the agent's answer

    @property
    def reclaimed(self) -> int:
        return int(self.guest.get("reclaimed_bytes_trim", 0))

    @property
    def returned(self) -> int:
        """Host RSS the trim gave back."""
        return self.rss_before - self.rss_after

    def describe(self, name: str) -> str:
        if not self.trimmed:
            return f"{name}: not trimmed: {self.note}"
        g = self.guest
        line = (
            f"{name}: guest reclaimed {format_size(self.reclaimed)} in "
            f"{int(g.get('elapsed_ms', 0)) / 1000:.1f} s (stopped: {g.get('stop', '?')}; "
            f"page cache {format_size(int(g.get('cache_before', 0)))} -> "
            f"{format_size(int(g.get('cache_after', 0)))}); host RSS "
            f"{format_size(self.rss_before)} -> {format_size(self.rss_after)} "
            f"({format_size(self.returned)} returned, {self._how_returned()})"
        )
        return f"{line}; {self.note}" if self.note else line

    def _how_returned(self) -> str:
        if self.guest.get("reported_now"):
            return "reported at once"
        return f"settled after {self.settle_seconds:.1f} s"

    def to_json(self) -> dict[str, Any]:
        return {
            "trimmed": self.trimmed,
            "note": self.note,
            "reclaimed": self.reclaimed,
            "rss_before": self.rss_before,
            "rss_after": self.rss_after,
            "returned": self.returned,
            "settle_seconds": round(self.settle_seconds, 2),
            "guest": self.guest,
        }


def request_trim(
    agent: AgentClient, max_bytes: int = 0, timeout: float = 30.0
) -> tuple[dict[str, Any] | None, str]:
    """Ask the agent to trim; (its answer, "") or (None, why not).

    Never raises for a guest that cannot trim: an absent, old or silent
    agent and a kernel without memory.reclaim all come back as a reason.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes {max_bytes} < 0")
    try:
        agent.wait_ready(SYNC_TIMEOUT)
    except (GuestError, OSError):
        return None, f"the guest agent did not answer within {SYNC_TIMEOUT:.0f} s"
    request = f"TRIM {max_bytes} {int(timeout * 1000)}"
    try:
        reply = agent.request_json(request, timeout=timeout + COMPACT_SLACK)
    except (GuestError, OSError, ValueError) as exc:
        return None, f"the guest agent did not answer the trim request ({exc})"
    if reply is None:
        return None, "the guest agent predates trimming (it answered TRIM with ERR unknown)"
    if not isinstance(reply, dict):
        return None, f"the guest agent sent a bad trim answer {reply!r}"
    if not reply.get("available"):
        return None, f"the guest has no usable reclaimer: {reply.get('error') or 'unavailable'}"
    return reply, ""


def trim_guest(
    agent: AgentClient,
    read_rss: Callable[[], int],
    reporting: bool,
    max_bytes: int = 0,
    timeout: float = 30.0,
    settle_timeout: float = 60.0,
) -> TrimResult:
    """Trim the guest behind `agent`; `read_rss` reads its QEMU's RSS and
    `reporting` says whether free page reporting is on for it."""
    rss_before = read_rss()
    reply, why = request_trim(agent, max_bytes, timeout)
    if reply is None:
        return TrimResult(False, why, rss_before, rss_before, 0.0)
    if not reporting:
        note = "free page reporting is off, so the host keeps what the guest freed"
        return TrimResult(True, note, rss_before, read_rss(), 0.0, reply)
    if int(reply.get("reclaimed_bytes_trim", 0)) < MIN_RECLAIM or reply.get("reported_now"):
        # Reported at once (thinvm_balloon's report_now): the driver
        # waited for every report to be acknowledged, and QEMU discards
        # a report's pages before it acknowledges it, so the host has it
        # all back already.
        return TrimResult(True, "", rss_before, read_rss(), 0.0, reply)
    settled = wait_settled(read_rss, settle_timeout, enough=expected_return(reply))
    return TrimResult(True, "", rss_before, settled.value, settled.seconds, reply)


def expected_return(reply: dict[str, Any]) -> int:
    """What the host can expect back: most of what the guest's free memory
    grew by during the trim (its compaction included); 0 if unknown."""
    grown = int(reply.get("free_after", 0)) - int(reply.get("free_before", 0))
    return int(grown * SETTLE_ENOUGH) if grown > 0 else 0


def reclaimer_status(
    agent: AgentClient, timeout: float = 30.0, wait: float | None = None
) -> dict[str, Any] | None:
    """The guest reclaimer's counters, or None from an agent without one.
    `wait`: how long another request may hold the agent (AgentBusy after)."""
    reply = agent.request_json("RECLAIM status", timeout=timeout, wait=wait)
    return reply if isinstance(reply, dict) else None


@dataclass(frozen=True)
class ReclaimerClock:
    """The guest reclaimer's counters since its agent started (RECLAIM
    status): `work_ms` is what its reclaim steps and compactions took;
    `thread_ms` its background thread's whole clock, which adds what its
    idle ticks cost (reading meminfo, vmstat, PSI): what the mode costs a
    guest that has nothing to give."""

    background: bool
    work_ms: int
    thread_ms: int
    steps: int

    @classmethod
    def read(cls, agent: AgentClient, timeout: float = 30.0) -> "ReclaimerClock":
        status = reclaimer_status(agent, timeout=timeout)
        if status is None:
            raise GuestError("the guest's agent has no reclaimer")
        if "thread_cpu_ms" not in status:
            raise GuestError("the guest's agent predates thread_cpu_ms: rebuild the image")
        return cls(
            bool(status.get("background")),
            int(status["cpu_ms"]),
            int(status["thread_cpu_ms"]),
            int(status["steps"]),
        )


def reclaimer_usage(
    before: list[ReclaimerClock], after: list[ReclaimerClock], window: float
) -> dict[str, float]:
    """What guests' reclaimers used between two readings `window` seconds
    apart: work and whole-thread CPU summed over the guests, steps, and the
    thread's mean share of one vCPU (a guest's reclaimer runs on one)."""
    pairs = list(zip(before, after, strict=True))
    return {
        "reclaim_work_cpu_s": sum(a.work_ms - b.work_ms for b, a in pairs) / 1000,
        "reclaim_steps": sum(a.steps - b.steps for b, a in pairs),
        "reclaimer_thread_cpu_s": sum(a.thread_ms - b.thread_ms for b, a in pairs) / 1000,
        "reclaimer_thread_cpu_pct": thread_share_pct(before, after, window),
    }


def thread_share_pct(
    before: list[ReclaimerClock], after: list[ReclaimerClock], window: float
) -> float:
    """The reclaimers' threads' mean share of one vCPU, in percent, between
    two readings `window` seconds apart."""
    thread_ms = sum(a.thread_ms - b.thread_ms for b, a in zip(before, after, strict=True))
    if not before or window <= 0:
        return 0.0
    return round(100 * thread_ms / 1000 / (window * len(before)), 3)


def set_background(
    agent: AgentClient, on: bool, timeout: float = 30.0, wait: float | None = None
) -> dict[str, Any] | None:
    """Switch the guest's continuous reclaim on or off; its counters after."""
    reply = agent.request_json(f"RECLAIM {'on' if on else 'off'}", timeout=timeout, wait=wait)
    return reply if isinstance(reply, dict) else None


def report(result: TrimResult, name: str, as_json: bool) -> int:
    """Print a trim's outcome for `thinvm trim` and `thinvm fleet trim`: JSON,
    or one line (on stderr if nothing was trimmed); the command's exit code."""
    if as_json:
        print(json.dumps(result.to_json()))
    elif result.trimmed:
        print(result.describe(name))
    else:
        print(f"thinvm: {result.describe(name)}", file=sys.stderr)
    return 0 if result.trimmed else 1
