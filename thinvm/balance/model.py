"""What the balance controller sees and decides: plain data, no I/O.

Sizes are bytes, times are seconds.  A *target* (and `actual`) is
the memory the guest keeps, whatever the lever: outside the balloon, as
QMP's `balloon` command and `query-balloon` use it, plus, on a VM with
virtio-mem, what the device has plugged.  A lower target shrinks the
guest, a higher one grows it; the backend turns it into a balloon target
or a virtio-mem `requested-size`.  The virtio-mem device and the levers
are thinvm.vm.resize's model (Lever, VirtioMem), with its rounding rule.
"""

from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from thinvm.units import MiB
from thinvm.vm.resize import Lever, VirtioMem

# QEMU reports a statistic the guest did not send as (uint64)-1.
UNSET_STAT = (1 << 64) - 1
# The largest count or size a guest may report; more (2^63 bytes is 8 EiB)
# means the guest sent garbage.
COUNT_MAX = (1 << 63) - 1

# hw/virtio/virtio-balloon.c balloon_stat_names (QEMU 10.0) -> our names.
# The last six come from Linux 6.12 guests only; 6.1 guests leave them unset.
STAT_NAMES = {
    "stat-total-memory": "total",
    "stat-free-memory": "free",
    "stat-available-memory": "available",
    "stat-disk-caches": "caches",
    "stat-swap-in": "swap_in",
    "stat-swap-out": "swap_out",
    "stat-major-faults": "major_faults",
    "stat-oom-kills": "oom_kills",
    "stat-alloc-stalls": "alloc_stalls",
    "stat-async-scans": "async_scans",
    "stat-direct-scans": "direct_scans",
    "stat-async-reclaims": "async_reclaims",
    "stat-direct-reclaims": "direct_reclaims",
}

# Counters whose growth means the guest is short of memory right now.
STRESS_COUNTERS = ("oom_kills", "alloc_stalls", "direct_scans", "direct_reclaims")


class Backing(StrEnum):
    """How a VM's RAM is backed on the host: decides what a balloon can free."""

    ANONYMOUS = "anonymous"
    THP = "thp"
    HUGETLBFS = "hugetlbfs"
    POOL = "pool"  # a warm pool slot file (tmpfs or hugetlbfs)
    PINNED = "pinned"  # VFIO or mlock: discards are blocked


@dataclass(frozen=True)
class GuestStats:
    """One virtio-balloon statistics report; None = the guest did not send it."""

    age: float  # seconds since the guest sent it
    total: int | None = None
    free: int | None = None
    available: int | None = None
    caches: int | None = None
    swap_in: int | None = None
    swap_out: int | None = None
    major_faults: int | None = None
    oom_kills: int | None = None
    alloc_stalls: int | None = None
    async_scans: int | None = None
    direct_scans: int | None = None
    async_reclaims: int | None = None
    direct_reclaims: int | None = None

    def with_stress(self, stress: dict[str, int]) -> "GuestStats":
        """These statistics with the stress counters they lack taken from
        `stress` (stress_from_vmstat); those the balloon sent are kept."""
        missing = {k: v for k, v in stress.items() if getattr(self, k) is None}
        return replace(self, **missing)

    def counters(self) -> dict[str, int]:
        """The stress counters this guest reports (6.12+), by name."""
        values = {name: getattr(self, name) for name in STRESS_COUNTERS}
        return {name: value for name, value in values.items() if value is not None}


# Linux 6.12's virtio-balloon driver reports its stress statistics from
# the guest's vm events (update_balloon_vm_stats()): the same counters
# /proc/vmstat shows, so a guest whose statistics do not reach the
# controller (libvirt passes on none of them) can be read through the agent.
VMSTAT_STRESS = {
    "oom_kills": "oom_kill",
    "async_scans": "pgscan_kswapd",
    "direct_scans": "pgscan_direct",
    "async_reclaims": "pgsteal_kswapd",
    "direct_reclaims": "pgsteal_direct",
}
ALLOC_STALL_PREFIX = "allocstall_"  # one per zone; the driver sums them


def stress_from_vmstat(counters: dict[str, int]) -> dict[str, int]:
    """The stress counters of GuestStats from a guest's /proc/vmstat, as
    its 6.12 balloon driver would report them; BadGuestData if one cannot
    be right (the guest is not trusted)."""
    found = {name: counters[key] for name, key in VMSTAT_STRESS.items() if key in counters}
    stalls = [v for k, v in counters.items() if k.startswith(ALLOC_STALL_PREFIX)]
    if stalls:
        found["alloc_stalls"] = sum(stalls)
    return {name: guest_count(value, f"vmstat {name}") for name, value in found.items()}


class BadGuestData(ValueError):
    """A guest reported something that cannot be right: a count that is not
    a whole number, is negative or is beyond any memory.  A guest is not
    trusted; what it sent is left out and the controller carries on."""


def guest_count(value: object, what: str) -> int:
    """A count or size a guest reported, checked: an int in [0, COUNT_MAX]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= COUNT_MAX:
        raise BadGuestData(f"{what} {value!r} is not a count")
    return value


def guest_flag(value: object, what: str) -> bool:
    """A yes/no a guest reported, checked: a JSON boolean."""
    if not isinstance(value, bool):
        raise BadGuestData(f"{what} {value!r} is not true or false")
    return value


def parse_guest_stats(reply: dict[str, Any], now: float) -> GuestStats | None:
    """QMP `qom-get .../guest-stats` -> GuestStats; None if never reported.

    `last-update` is the host's wall clock (seconds) when the last report
    arrived; 0 means the guest has not reported since the device started.
    A value the guest could not have meant (BadGuestData) is an error, so
    the controller can say which guest sent it.
    """
    last_update = guest_count(reply.get("last-update", 0) or 0, "last-update")
    raw = reply.get("stats") or {}
    if last_update <= 0:
        return None
    if not isinstance(raw, dict):
        raise BadGuestData(f"balloon statistics {raw!r} are not an object")
    values: dict[str, int | None] = {}
    for qemu_name, name in STAT_NAMES.items():
        value = raw.get(qemu_name)
        unset = value is None or value in (UNSET_STAT, -1)
        values[name] = None if unset else guest_count(value, qemu_name)
    total, free, available = values["total"], values["free"], values["available"]
    if total is None or free is None:
        return None
    if free > total or (available is not None and available > total):
        raise BadGuestData(
            f"guest statistics say {free} free and {available} available of {total} bytes"
        )
    return GuestStats(age=max(0.0, now - last_update), **values)


@dataclass(frozen=True)
class HostSample:
    """The memory the guests share: the whole host or a budget (cgroup)."""

    total: int  # MemTotal, or the budget's limit
    available: int  # MemAvailable, or limit - usage
    swap_used: int = 0
    psi_some_avg10: float | None = None  # percent; None: no PSI
    psi_full_avg10: float | None = None
    psi_some_avg60: float | None = None
    psi_full_avg60: float | None = None


@dataclass(frozen=True)
class VmSample:
    """One VM as the backend saw it this cycle."""

    name: str
    max_memory: int  # the most the guest can keep: RAM, plus all of virtio-mem
    # The memory the guest keeps: balloon `actual` (the base memory without
    # a balloon) plus what virtio-mem has plugged.  None: no lever / no answer.
    actual: int | None
    stats: GuestStats | None = None
    migrating: bool = False
    backing: Backing = Backing.ANONYMOUS
    host_rss: int | None = None
    reporting: bool = False  # free page reporting on: its free memory is the host's already
    # A target an operator set (`thinvm balloon`): the controller leaves the
    # VM there, whatever the policy, until the operator hands it back.
    held: int | None = None
    # The guest's reclaimer (docs/working-set.md): None if the backend
    # cannot reach it (no agent, an old agent, a libvirt domain).
    reclaimer: "Reclaimer | None" = None
    # The levers the VM has; the controller drives virtio-mem where there is
    # one (the balloon of such a VM then only reports statistics).
    levers: tuple[Lever, ...] = (Lever.BALLOON,)
    virtio_mem: VirtioMem | None = None
    # Which incarnation of the VM this is (its QEMU process, or libvirt's
    # UUID and domain id): a VM re-created under the same name has another.
    # None: the backend cannot tell.
    identity: str | None = None

    @property
    def lever(self) -> Lever:
        """The lever the controller drives on this VM."""
        return Lever.VIRTIO_MEM if self.virtio_mem is not None else Lever.BALLOON

    def round(self, target: int) -> int:
        """`target` as the VM's lever can give it: whole virtio-mem blocks
        above the base memory, or whole 2 MiB units of balloon."""
        if self.virtio_mem is not None:
            return self.virtio_mem.round(target)
        return round_target(target)

    def fit(self, limits: "VmLimits") -> "VmLimits":
        """The operator's limits as this VM's lever can keep them: virtio-mem
        never takes a guest below its base memory, and moves whole blocks."""
        vmem = self.virtio_mem
        if vmem is None:
            return limits
        ceiling = vmem.round(min(limits.ceiling, self.max_memory))
        above = max(0, limits.floor - vmem.base)
        floor = vmem.base + -(-above // vmem.block_size) * vmem.block_size
        return replace(limits, floor=min(floor, ceiling), ceiling=ceiling)


@dataclass(frozen=True)
class Reclaimer:
    """The guest agent's cold-memory reclaimer, as its counters last said."""

    available: bool  # memory.reclaim is usable in the guest
    background: bool  # continuous, pressure-gated reclaim is on
    reclaimed_bytes: int = 0
    backoffs: int = 0  # held back for stalls or refaults: the working set was reached
    refault_pages: int = 0
    compactions: int = 0
    cpu_ms: int = 0  # guest CPU its steps and compactions took
    # Times the background thread had memory freed in one go reported at
    # once (0 without our balloon driver, or from an older agent).
    freed_reports: int = 0
    # The page cache a recent trim could not take (the agent's floor, which
    # counts the active file list the balloon statistics do not carry, or
    # what was left when refaults, pressure or no progress stopped it); 0
    # when no trim said so lately.
    cache_floor: int = 0

    @classmethod
    def from_counters(cls, counters: object) -> "Reclaimer":
        """The agent's counters object (docs/protocol/agent.md), checked:
        BadGuestData if it is not one."""
        if not isinstance(counters, dict):
            raise BadGuestData(f"reclaimer counters {counters!r} are not an object")

        def count(name: str) -> int:
            return guest_count(counters.get(name, 0), name)

        return cls(
            available=guest_flag(counters.get("available", False), "available"),
            background=guest_flag(counters.get("background", False), "background"),
            reclaimed_bytes=count("reclaimed_bytes"),
            backoffs=count("backoffs"),
            refault_pages=count("refault_pages"),
            compactions=count("compactions"),
            cpu_ms=count("cpu_ms"),
            freed_reports=count("freed_reports"),
        )


@dataclass(frozen=True)
class VmLimits:
    """The operator's contract for one VM."""

    floor: int  # never balloon the guest below this
    ceiling: int  # never give it more than this (<= max_memory)
    shares: int = 1000  # weight when host memory is split; 0 = leave alone

    @classmethod
    def default_for(cls, max_memory: int) -> "VmLimits":
        """A quarter of its RAM (at least 256 MiB) is a guest's floor by default."""
        return cls(floor=min(max_memory, max(256 * MiB, max_memory // 4)), ceiling=max_memory)


@dataclass(frozen=True)
class VmState:
    """What the controller remembers about a VM between cycles."""

    target: int | None = None  # the last target we set
    last_actual: int | None = None
    actual_steady_s: float = 0.0  # how long `actual` has stayed at last_actual, as seen
    last_used: int | None = None
    counters: dict[str, int] = field(default_factory=dict)
    stuck_cycles: int = 0  # cycles the target was not followed
    given_up_until: int = 0  # cycle before which we do not ask again
    calm_cycles: int = 0  # cycles since the guest last showed stress or growth
    peak_growth: int = 0  # largest recent growth of used memory in one cycle (decaying)
    cooldown_until: int = 0  # no shrinking before this cycle
    history: tuple[tuple[int, int], ...] = ()  # (actual, free) samples, oldest first
    working_set: int | None = None  # estimate: what the guest uses and would refault
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["history"] = [list(item) for item in self.history]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "VmState":
        """A state as to_json() wrote it; ValueError for one of another
        shape (another thinvm version's), which would fail the policy later."""
        data = dict(data)
        data["history"] = tuple(tuple(item) for item in data.get("history", ()))
        known = {f for f in cls.__dataclass_fields__}
        state = cls(**{k: v for k, v in data.items() if k in known})
        state._check()
        return state

    def _check(self) -> None:
        def count(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        optional = (self.target, self.last_actual, self.last_used, self.working_set)
        counts = (self.stuck_cycles, self.given_up_until, self.calm_cycles, self.peak_growth,
                  self.cooldown_until)  # fmt: skip
        valid = (
            all(value is None or count(value) for value in optional)
            and all(count(value) for value in counts)
            and isinstance(self.actual_steady_s, int | float)
            and isinstance(self.counters, dict)
            and all(isinstance(k, str) and count(v) for k, v in self.counters.items())
            and all(len(item) == 2 and all(map(count, item)) for item in self.history)
            and isinstance(self.reason, str)
        )
        if not valid:
            raise ValueError(f"a saved VM state of another shape: {self}")

    def but(self, **changes: Any) -> "VmState":
        return replace(self, **changes)


@dataclass(frozen=True)
class Decision:
    """Set `vm`'s target to `target` (None: leave it), because `reason`.

    The target is the memory the guest keeps, for either lever."""

    vm: str
    target: int | None
    reason: str
    # Switch the guest's background reclaimer on (True) or off (False);
    # None: leave it.  Independent of the balloon target.
    reclaim: bool | None = None
    # Ask the guest to trim this many bytes of cold memory now (bounded in
    # time, asynchronous): the host is short and the guest has cold cache.
    trim: int | None = None

    @property
    def acts(self) -> bool:
        return self.target is not None


@dataclass(frozen=True)
class Plan:
    """A policy's output for one cycle: decisions and the state to remember."""

    decisions: list[Decision]
    states: dict[str, VmState]


def round_target(size: int, granule: int = 2 * MiB) -> int:
    """Targets in whole 2 MiB units, so a THP-backed guest frees whole huge pages."""
    return max(granule, size - size % granule)
