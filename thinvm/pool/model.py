"""The pool's state and its pure decisions: which slot to lease, when to fill or give back.

Nothing here touches the host; the worker feeds in what it measured
(thinvm.pool.probes) and carries out the Action it gets back.
"""

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.host.pressure import PSI_MEMORY
from thinvm.units import GiB, format_size

KINDS = ("hugetlbfs", "tmpfs")

PSI_PATH = PSI_MEMORY
DEFAULT_WATERMARK = 2 * GiB
DEFAULT_PSI_THRESHOLD = 10.0  # % of time some task stalled on memory, last 10 s
DEFAULT_INTERVAL = 2.0
MIN_INTERVAL = 0.1  # shorter, and the idle daemon would keep a CPU busy
DEFAULT_COOLDOWN = 30.0


class PoolError(ThinvmError):
    """The pool is missing, misconfigured, or cannot do what was asked."""


class PoolEmpty(PoolError):
    """No free slot fits; callers fall back to ordinary preallocation."""


def check_interval(seconds: float) -> None:
    """Refuse an interval the daemon cannot sleep for: 0 or less spins, NaN or inf fail."""
    if not (math.isfinite(seconds) and seconds >= MIN_INTERVAL):
        raise PoolError(
            f"--interval {seconds:g}: the daemon sleeps this many seconds between checks; "
            f"give a number of at least {MIN_INTERVAL:g} (default {DEFAULT_INTERVAL:g})"
        )


# -- model -------------------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one with the same pid."""

    pid: int
    start: int  # field 22 of /proc/PID/stat: start time in clock ticks


@dataclass
class Slot:
    index: int
    size: int
    path: str
    state: str = "empty"
    owner: Owner | None = None  # the VM's QEMU (leased) or the worker (filling/scrubbing)
    token: str = ""  # identifies the lease
    vm: str = ""  # name of the VM that holds the lease
    leases: int = 0
    error: str = ""  # why the last fill or scrub stopped short


@dataclass
class Policy:
    budget: int  # bytes all slot files together may hold, leased slots included
    watermark: int = DEFAULT_WATERMARK  # MemAvailable the pool leaves the host
    psi_threshold: float = DEFAULT_PSI_THRESHOLD
    psi_path: str = PSI_PATH
    interval: float = DEFAULT_INTERVAL
    cooldown: float = DEFAULT_COOLDOWN  # no filling for this long after a shrink


@dataclass
class PoolConfig:
    kind: str
    directory: str
    page_size: int
    policy: Policy
    cgroup: str | None = None  # cgroup name (under each controller)
    mounted: str | None = None  # a hugetlbfs mount the pool made and unmounts
    manage_hugepages: bool = False  # grow/shrink the huge page pool with the slots


@dataclass
class PoolState:
    config: PoolConfig
    slots: list[Slot]
    daemon: Owner | None = None
    hugepages_added: int = 0  # huge pages the pool added to the kernel's pool
    note: str = ""  # what the worker did or waits for, for status

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PoolState":
        def owner(value: dict[str, int] | None) -> Owner | None:
            return Owner(**value) if value else None

        cfg = dict(data["config"])
        cfg["policy"] = Policy(**cfg["policy"])
        slots = [Slot(**{**s, "owner": owner(s.get("owner"))}) for s in data["slots"]]
        return cls(
            config=PoolConfig(**cfg),
            slots=slots,
            daemon=owner(data.get("daemon")),
            hugepages_added=int(data.get("hugepages_added", 0)),
            note=str(data.get("note", "")),
        )


# -- pure logic: leasing -----------------------------------------------------


def choose_slot(slots: Sequence[Slot], memory: int) -> Slot | None:
    """The smallest free slot that holds `memory` (lowest index on a tie)."""
    fits = [s for s in slots if s.state == "free" and s.size >= memory]
    return min(fits, key=lambda s: (s.size, s.index), default=None)


def shortage(slots: Sequence[Slot], memory: int) -> str:
    """Why no slot can be leased for `memory`, in words."""
    if not slots:
        return "the warm pool has no slots"
    big = [s for s in slots if s.size >= memory]
    if not big:
        largest = max(s.size for s in slots)
        return (
            f"no warm pool slot holds {format_size(memory)} (the largest is {format_size(largest)})"
        )
    counts = Counter(s.state for s in big)
    states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"no free warm pool slot of {format_size(memory)} or more ({states})"


def take(state: PoolState, memory: int, owner: Owner, vm: str, token: str) -> Slot:
    """Lease a free slot to `owner`; PoolEmpty if none fits."""
    page = state.config.page_size
    if memory % page:
        raise PoolEmpty(
            f"guest memory {format_size(memory)} is not a multiple of the pool's "
            f"{format_size(page)} pages"
        )
    slot = choose_slot(state.slots, memory)
    if slot is None:
        raise PoolEmpty(shortage(state.slots, memory))
    slot.state, slot.owner, slot.token, slot.vm = "leased", owner, token, vm
    slot.leases += 1
    slot.error = ""
    return slot


def bind(state: PoolState, index: int, token: str, owner: Owner) -> bool:
    """Hand a lease over to the QEMU process that maps the slot."""
    slot = state.slots[index]
    if slot.state != "leased" or slot.token != token:
        return False
    slot.owner = owner
    return True


def release(state: PoolState, *, token: str | None = None, pid: int | None = None) -> Slot | None:
    """The lease's VM is gone: its slot becomes dirty (idempotent)."""
    for slot in state.slots:
        if slot.state != "leased":
            continue
        if (token is not None and slot.token == token) or (
            token is None and pid is not None and slot.owner is not None and slot.owner.pid == pid
        ):
            slot.state, slot.owner, slot.token = "dirty", None, ""
            return slot
    return None


def reap(state: PoolState, alive: Callable[[Owner], bool]) -> list[Slot]:
    """Slots whose owner died: leases and interrupted work become dirty."""
    reaped = []
    for slot in state.slots:
        if slot.state in ("leased", "filling", "scrubbing") and (
            slot.owner is None or not alive(slot.owner)
        ):
            slot.state, slot.owner, slot.token = "dirty", None, ""
            reaped.append(slot)
    if state.daemon is not None and not alive(state.daemon):
        state.daemon = None
    return reaped


# -- pure logic: when to grow and shrink -------------------------------------


@dataclass(frozen=True)
class Pressure:
    mem_available: int
    psi_some_avg10: float | None  # None: no PSI on this kernel


@dataclass(frozen=True)
class Action:
    kind: str  # shrink | scrub | fill | idle
    index: int | None = None
    reason: str = ""


def pressure_reason(pressure: Pressure, policy: Policy) -> str | None:
    """Why the host counts as under memory pressure, or None."""
    psi = pressure.psi_some_avg10
    if psi is not None and psi > policy.psi_threshold:
        return f"memory pressure: PSI some avg10 {psi:.2f}% > {policy.psi_threshold:g}%"
    if pressure.mem_available < policy.watermark:
        return (
            f"MemAvailable {format_size(pressure.mem_available)} is below the "
            f"watermark {format_size(policy.watermark)}"
        )
    return None


def growth_block(
    pressure: Pressure, policy: Policy, held: int, cost: int, spare: int = 0
) -> str | None:
    """Why the pool may not fill `cost` more bytes now, or None.

    `held`: what the slots hold now.  `spare`: bytes of free huge pages the
    kernel has reserved already; filling those takes nothing from
    MemAvailable.  A slot is started only if all of it fits, so the pool
    never holds a part of a slot it could not complete.
    """
    reason = pressure_reason(pressure, policy)
    if reason is not None:
        return reason
    if held + cost > policy.budget:
        return (
            f"budget {format_size(policy.budget)} reached (slots hold {format_size(held)}, "
            f"next needs {format_size(cost)})"
        )
    taken = max(0, cost - spare)
    if pressure.mem_available - taken < policy.watermark:
        return (
            f"filling {format_size(taken)} more would take MemAvailable below the "
            f"watermark {format_size(policy.watermark)}"
        )
    return None


_SHRINK_ORDER = {"dirty": 0, "empty": 1, "free": 2}


def decide(
    slots: Sequence[Slot],
    held: Mapping[int, int],
    pressure: Pressure,
    policy: Policy,
    *,
    spare: int = 0,
    cooling: bool = False,
) -> Action:
    """The worker's next step.

    Under pressure or over budget: give back the slot that is worth least
    (dirty, then partly filled, then free; the highest index first).
    Otherwise scrub dirty slots, then fill empty ones while the budget and
    the watermark allow, unless `cooling` (memory was given back a moment
    ago: filling now would only bring the pressure back).
    """
    total = sum(held.values())
    reason = pressure_reason(pressure, policy)
    if reason is None and total > policy.budget:
        reason = f"slots hold {format_size(total)}, over the budget {format_size(policy.budget)}"
    if reason is not None:
        victims = [s for s in slots if s.state in _SHRINK_ORDER and held.get(s.index, 0) > 0]
        if not victims:
            return Action("idle", reason=f"{reason}; nothing left to give back")
        victim = min(victims, key=lambda s: (_SHRINK_ORDER[s.state], -s.index))
        return Action("shrink", victim.index, reason)
    for slot in slots:
        if slot.state == "dirty":
            return Action("scrub", slot.index, "released by its VM")
    for slot in slots:
        if slot.state == "empty":
            if cooling:
                return Action("idle", reason="not filling: cooling down after giving memory back")
            cost = max(0, slot.size - held.get(slot.index, 0))
            block = growth_block(pressure, policy, total, cost, spare)
            if block is not None:
                return Action("idle", reason=f"not filling: {block}")
            return Action("fill", slot.index)
    if all(s.state == "free" for s in slots):
        return Action("idle", reason="all slots filled")
    return Action("idle", reason="nothing to do")
