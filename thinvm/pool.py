"""A warm pool of pre-zeroed, pre-populated guest RAM (docs/warm-pool.md).

Starting a VM with all of its RAM preallocated makes the kernel zero every
page while QEMU waits.  The pool pays for that ahead of time, at idle CPU
priority and in its own cgroup, in files that QEMU then maps with
`memory-backend-file,share=on,prealloc=on`:

- hugetlbfs slots: fallocate() allocates and zeroes every huge page, so
  QEMU's preallocation only maps them (2048 faults for 4 GiB);
- tmpfs slots: fallocate() plus a write fault on every page
  (MADV_POPULATE_WRITE), so the pages exist and are zero; QEMU still maps
  them 4 KiB at a time.

A slot moves through these states, recorded in `pool.json` and changed
only under the pool's file lock:

             fill             lease              VM gone
     empty --------> free ---------> leased ------------> dirty
       ^ ^             |                                    |
       | +-------------+ shrink: punch (pressure, budget)   |
       +----------------------------------------------------+
                   scrub: punch the whole file

A slot file can hold a guest's data only while it is leased or dirty.  The
only way back to free is a punch of the whole file that leaves no block
allocated (checked), with no process holding the file open or mapped
(checked), followed by a fill that only ever writes zeros.  A slot is
leased only when free.
"""

import argparse
import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from thinvm.errors import ThinvmError
from thinvm.host.memory import host_meminfo
from thinvm.paths import REPO, cache_dir
from thinvm.progress import ProgressLine
from thinvm.units import GiB, KiB, MiB, format_size

if TYPE_CHECKING:
    from thinvm.vm.machine import VM, VMConfig

KINDS = ("hugetlbfs", "tmpfs")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE_SIZE = 4 * KiB

STATE_FILE = "pool.json"
LOCK_FILE = "lock"
LOG_FILE = "daemon.log"
PSI_PATH = "/proc/pressure/memory"
TMPFS_DIR = "/dev/shm"
CGROUP_FS = Path("/sys/fs/cgroup")
# The pool's own processes (Python, page tables) on top of the slots.
CGROUP_HEADROOM = 256 * MiB
# Work units: between two, the filler re-checks budget, pressure and stop.
TMPFS_CHUNK = 64 * MiB
HUGETLBFS_CHUNK = 256 * MiB

DEFAULT_WATERMARK = 2 * GiB
DEFAULT_PSI_THRESHOLD = 10.0  # % of time some task stalled on memory, last 10 s
DEFAULT_INTERVAL = 2.0
DEFAULT_COOLDOWN = 30.0


class PoolError(ThinvmError):
    """The pool is missing, misconfigured, or cannot do what was asked."""


class PoolEmpty(PoolError):
    """No free slot fits; callers fall back to ordinary preallocation."""


def default_root() -> Path:
    return cache_dir() / "pool"


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


def parse_psi(text: str) -> float | None:
    """`some avg10` of a /proc/pressure file, in percent."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for item in fields[1:]:
                key, _, value = item.partition("=")
                if key == "avg10":
                    return float(value)
    return None


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


# -- host probes -------------------------------------------------------------


def proc_start_time(pid: int) -> int | None:
    """Start time of a live (not zombie) process, None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def owner_of(pid: int) -> Owner:
    start = proc_start_time(pid)
    if start is None:
        raise PoolError(f"process {pid} is gone")
    return Owner(pid, start)


def owner_alive(owner: Owner) -> bool:
    return proc_start_time(owner.pid) == owner.start


def process_age(pid: int) -> float:
    """Seconds since the process started (10 ms resolution)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    start = proc_start_time(pid)
    if start is None:
        raise PoolError(f"process {pid} is gone")
    return uptime - start / os.sysconf("SC_CLK_TCK")


def allocated(path: str) -> int:
    """Bytes a slot file really holds (punched holes do not count)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def read_pressure(policy: Policy) -> Pressure:
    try:
        psi = parse_psi(Path(policy.psi_path).read_text())
    except OSError:
        psi = None
    return Pressure(host_meminfo()["MemAvailable"], psi)


def users_of(path: str, exclude: int | None = None) -> list[int]:
    """Processes that have `path` open or mapped."""
    users = []
    wanted = (f" {path}\n", f" {path} (deleted)\n")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        with contextlib.suppress(OSError):
            maps = (entry / "maps").read_text()
            if any(w in maps for w in wanted):
                users.append(int(entry.name))
                continue
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == path:
                        users.append(int(entry.name))
                        break
    return users


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: str


def _unescape(text: str) -> str:
    return text.encode().decode("unicode_escape") if "\\" in text else text


def mounts() -> list[Mount]:
    result = []
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4:
            result.append(Mount(_unescape(fields[1]), fields[2], fields[3]))
    return result


def mount_of(path: str) -> Mount | None:
    """The mount a path lives on (the longest mount point above it)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts():
        point = m.point.rstrip("/") or "/"
        inside = real == point or real.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.point)):
            best = m
    return best


def _hugepage_dir(page_size: int) -> Path:
    return Path(f"/sys/kernel/mm/hugepages/hugepages-{page_size // KiB}kB")


def hugepages_free(page_size: int) -> int:
    """Huge pages of that size nobody has allocated or reserved."""
    d = _hugepage_dir(page_size)
    try:
        free = int((d / "free_hugepages").read_text())
        reserved = int((d / "resv_hugepages").read_text())
    except OSError:
        return 0
    return max(0, free - reserved)


def nr_hugepages(page_size: int) -> int:
    return int((_hugepage_dir(page_size) / "nr_hugepages").read_text())


def set_nr_hugepages(page_size: int, count: int) -> int:
    """Ask the kernel for `count` persistent huge pages; returns what it got."""
    path = _hugepage_dir(page_size) / "nr_hugepages"
    try:
        path.write_text(str(max(0, count)))
    except OSError as exc:
        raise PoolError(f"cannot set {path}: {exc.strerror} (run as root)") from exc
    return int(path.read_text())


# -- files -------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch(fd: int, offset: int, length: int) -> None:
    """Free the blocks of a range; it reads as zeros afterwards."""
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)


def populate_zeros(fd: int, offset: int, length: int) -> None:
    """Make every tmpfs page of the range exist and be zero.

    fallocate() on tmpfs allocates pages but leaves them to be cleared at
    their first fault; a write fault on every page does that now, in the
    pool's context, instead of in QEMU's.
    """
    with mmap.mmap(
        fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
    ) as m:
        try:
            m.madvise(MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: kernel older than 5.14
                raise
            for off in range(0, length, PAGE_SIZE):
                m[off] = 0


def fill_chunk(fd: int, kind: str, offset: int, length: int) -> None:
    """Allocate a range of a slot file as zeroed, populated pages."""
    fallocate(fd, 0, offset, length)  # hugetlbfs: allocates and zeroes
    if kind == "tmpfs":
        populate_zeros(fd, offset, length)


def is_zero(path: str, limit: int | None = None) -> bool:
    """Whether the file reads as zeros (its first `limit` bytes)."""
    zero = bytes(MiB)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while limit is None or done < limit:
            data = f.read(MiB)
            if not data:
                return True
            if data != zero[: len(data)]:
                return False
            done += len(data)
    return True


# -- cgroups and priority ----------------------------------------------------


@dataclass(frozen=True)
class CgroupUsage:
    path: str
    usage: int | None
    limit: int | None
    failcnt: int | None  # times the limit was hit
    cpu_seconds: float | None


def _cgroup_dirs(name: str) -> tuple[Path | None, Path | None, bool]:
    """(memory dir, cpu accounting dir, is v2) for a cgroup name."""
    if (CGROUP_FS / "memory" / "memory.limit_in_bytes").is_file():
        cpu = next(
            (
                CGROUP_FS / c / name
                for c in ("cpuacct", "cpu,cpuacct")
                if (CGROUP_FS / c / "cpuacct.usage").is_file()
            ),
            None,
        )
        return CGROUP_FS / "memory" / name, cpu, False
    controllers = CGROUP_FS / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split():
        return CGROUP_FS / name, CGROUP_FS / name, True
    return None, None, False


def cgroup_limit(kind: str, policy: Policy) -> int:
    """The pool's cgroup limit: tmpfs pages are charged there, huge pages are not."""
    return (policy.budget if kind == "tmpfs" else 0) + CGROUP_HEADROOM


def join_cgroup(name: str, limit: int) -> str | None:
    """Move this process into its memory (and CPU accounting) cgroup."""
    mem, cpu, _ = _cgroup_dirs(name)
    if mem is None:
        return None
    pid = str(os.getpid())
    for d in dict.fromkeys(p for p in (mem, cpu) if p is not None):
        d.mkdir(exist_ok=True)
        (d / "cgroup.procs").write_text(pid)
    set_cgroup_limit(name, limit)
    return str(mem)


def set_cgroup_limit(name: str, limit: int) -> None:
    mem, _, v2 = _cgroup_dirs(name)
    if mem is None:
        return
    limit_file = mem / ("memory.max" if v2 else "memory.limit_in_bytes")
    if _read_int(limit_file) == limit:
        return
    try:
        limit_file.write_text(str(limit))
    except OSError as exc:
        raise PoolError(
            f"cannot limit cgroup {mem} to {format_size(limit)}: {exc.strerror} "
            "(it holds more: the pool shrinks first)"
        ) from exc


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def cgroup_usage(name: str) -> CgroupUsage | None:
    mem, cpu, v2 = _cgroup_dirs(name)
    if mem is None or not mem.is_dir():
        return None
    cpu_seconds: float | None = None
    if v2:
        usage, limit = _read_int(mem / "memory.current"), _read_int(mem / "memory.max")
        failcnt = None
        with contextlib.suppress(OSError):
            events = dict(line.split() for line in (mem / "memory.events").read_text().splitlines())
            failcnt = int(events.get("max", 0))
        with contextlib.suppress(OSError):
            stat = dict(line.split() for line in (mem / "cpu.stat").read_text().splitlines())
            cpu_seconds = int(stat["usage_usec"]) / 1e6
    else:
        usage = _read_int(mem / "memory.usage_in_bytes")
        limit = _read_int(mem / "memory.limit_in_bytes")
        failcnt = _read_int(mem / "memory.failcnt")
        if cpu is not None:
            ns = _read_int(cpu / "cpuacct.usage")
            cpu_seconds = ns / 1e9 if ns is not None else None
    return CgroupUsage(str(mem), usage, limit, failcnt, cpu_seconds)


def remove_cgroup(name: str) -> None:
    mem, cpu, _ = _cgroup_dirs(name)
    for d in dict.fromkeys(p for p in (mem, cpu) if p is not None):
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: a worker is still leaving
                time.sleep(0.1)


def idle_priority() -> None:
    """SCHED_IDLE and nice 19: the pool only runs on otherwise idle CPUs."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))


# -- the pool on disk --------------------------------------------------------


@dataclass
class PoolSpec:
    """How to set a pool up; None fields keep the current (or default) value."""

    slots: list[int] | None = None  # one size per slot, bytes
    kind: str = "auto"  # auto | hugetlbfs | tmpfs
    directory: str | None = None  # where slot files go (on hugetlbfs or tmpfs)
    budget: int | None = None  # default: the sum of the slots
    watermark: int | None = None
    psi_threshold: float | None = None
    psi_path: str | None = None
    interval: float | None = None
    cooldown: float | None = None
    reserve_hugepages: bool = False  # root: mount hugetlbfs, grow vm.nr_hugepages
    cgroup: bool = True


_locked_here: set[tuple[str, int]] = set()  # (pool, thread) holding the lock


class Pool:
    """A pool directory: pool.json, its lock and the daemon log."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    @property
    def state_file(self) -> Path:
        return self.root / STATE_FILE

    @property
    def log_file(self) -> Path:
        return self.root / LOG_FILE

    @property
    def cgroup_name(self) -> str:
        return f"thinvm-{self.root.name}"

    def exists(self) -> bool:
        return self.state_file.is_file()

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        # flock() locks an open file: taking it again in the same thread
        # would wait for itself forever, so that is a bug, said loudly.
        key = (str(self.root.resolve()), threading.get_ident())
        if key in _locked_here:
            raise RuntimeError(f"pool lock {self.root} taken twice in one process")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _locked_here.add(key)
            try:
                yield
            finally:
                _locked_here.discard(key)

    def _load(self) -> PoolState:
        try:
            return PoolState.from_json(json.loads(self.state_file.read_text()))
        except FileNotFoundError:
            raise PoolError(
                f"no warm pool at {self.root}: start one with 'thinvm pool start'"
            ) from None

    def _store(self, state: PoolState) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n")
        os.replace(tmp, self.state_file)

    @contextlib.contextmanager
    def locked(self) -> Iterator[PoolState]:
        """The state, read and written back under the pool's lock."""
        with self._flock():
            state = self._load()
            before = state.to_json()
            yield state
            if state.to_json() != before:
                self._store(state)

    def read(self) -> PoolState:
        with self._flock():
            return self._load()

    def slot_path(self, directory: str, index: int) -> str:
        return os.path.join(directory, f"slot-{index}.mem")


def _pick_backing(pool: Pool, spec: PoolSpec, total: int) -> tuple[str, str, int, str | None]:
    """(kind, directory, page size, our own mount) for a new pool."""
    subdir = f"thinvm-{pool.root.name}"
    if spec.directory is not None:
        m = mount_of(spec.directory)
        if m is None or m.fstype not in KINDS:
            raise PoolError(f"{spec.directory} is on neither hugetlbfs nor tmpfs")
        if spec.kind != "auto" and spec.kind != m.fstype:
            raise PoolError(f"{spec.directory} is on {m.fstype}, not {spec.kind}")
        return m.fstype, spec.directory, _page_size(m, spec.directory), None
    if spec.kind not in ("auto", *KINDS):
        raise PoolError(f"unknown pool kind {spec.kind!r}: use auto, hugetlbfs or tmpfs")
    if spec.kind in ("auto", "hugetlbfs"):
        huge = [m for m in mounts() if m.fstype == "hugetlbfs"]
        usable = [m for m in huge if os.access(m.point, os.W_OK)]
        if usable:
            m = usable[0]
            size = _page_size(m, m.point)
            if (
                spec.kind == "hugetlbfs"
                or spec.reserve_hugepages
                or (hugepages_free(size) * size >= total)
            ):
                return "hugetlbfs", os.path.join(m.point, subdir), size, None
        elif spec.reserve_hugepages:
            point = pool.root / "hugetlbfs"
            point.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(
                ["mount", "-t", "hugetlbfs", "-o", "mode=0700", "none", str(point)],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise PoolError(f"cannot mount hugetlbfs on {point}: {proc.stderr.strip()}")
            size = os.statvfs(point).f_bsize
            return "hugetlbfs", str(point / subdir), size, str(point)
        elif spec.kind == "hugetlbfs":
            raise PoolError(
                "no hugetlbfs is mounted: mount one (mount -t hugetlbfs none /dev/hugepages) "
                "or pass --reserve-hugepages"
            )
    return "tmpfs", os.path.join(TMPFS_DIR, subdir), PAGE_SIZE, None


def _page_size(m: Mount, path: str) -> int:
    return os.statvfs(path).f_bsize if m.fstype == "hugetlbfs" else PAGE_SIZE


def configure(root: str | Path | None, spec: PoolSpec) -> PoolState:
    """Create the pool, or update the policy of an existing one."""
    pool = Pool(root)
    with pool._flock():
        if pool.exists():
            state = pool._load()
            sizes = [s.size for s in state.slots]
            if spec.slots is not None and sorted(spec.slots) != sorted(sizes):
                raise PoolError(
                    f"the pool at {pool.root} has slots {_describe_sizes(sizes)}: "
                    "'thinvm pool stop' first to change them"
                )
            if spec.kind not in ("auto", state.config.kind):
                raise PoolError(
                    f"the pool at {pool.root} is {state.config.kind}: "
                    "'thinvm pool stop' first to change it"
                )
            _apply_policy(state.config.policy, spec)
            pool._store(state)
            return state
        if not spec.slots:
            raise PoolError("a new pool needs slots: pass e.g. --slot 4G --count 2")
        kind, directory, page, mounted = _pick_backing(pool, spec, sum(spec.slots))
        bad = [s for s in spec.slots if s <= 0 or s % page]
        if bad:
            raise PoolError(
                f"slot size {format_size(bad[0])} is not a multiple of the "
                f"{kind} page size {format_size(page)}"
            )
        policy = Policy(budget=sum(spec.slots))
        _apply_policy(policy, spec)
        config = PoolConfig(
            kind=kind,
            directory=directory,
            page_size=page,
            policy=policy,
            cgroup=pool.cgroup_name if spec.cgroup else None,
            mounted=mounted,
            manage_hugepages=kind == "hugetlbfs" and spec.reserve_hugepages,
        )
        os.makedirs(directory, mode=0o700, exist_ok=True)
        slots = []
        for index, size in enumerate(spec.slots):
            path = pool.slot_path(directory, index)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                # A file left from an earlier pool may hold a guest's data.
                state_name = "dirty" if os.fstat(fd).st_blocks else "empty"
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
            slots.append(Slot(index=index, size=size, path=path, state=state_name))
        state = PoolState(config=config, slots=slots)
        pool._store(state)
        return state


def _apply_policy(policy: Policy, spec: PoolSpec) -> None:
    for name in ("budget", "watermark", "psi_threshold", "psi_path", "interval", "cooldown"):
        value = getattr(spec, name)
        if value is not None:
            setattr(policy, name, value)


def _describe_sizes(sizes: Sequence[int]) -> str:
    counts = Counter(sizes)
    return ", ".join(f"{n} x {format_size(size)}" for size, n in sorted(counts.items()))


# -- leases (the VM side) ----------------------------------------------------


@dataclass
class Lease:
    """A slot a VM maps; release() when its QEMU is gone."""

    root: Path
    index: int
    path: str
    size: int
    kind: str
    page_size: int
    token: str

    def bind(self, pid: int) -> None:
        """From now on the slot belongs to QEMU process `pid`."""
        start = proc_start_time(pid)
        if start is None:
            return  # QEMU died at once; the lease stays ours until VM.kill()
        with Pool(self.root).locked() as state:
            bind(state, self.index, self.token, Owner(pid, start))

    def release(self) -> None:
        release_vm(self.root, self, None)

    def describe(self) -> str:
        return f"warm pool slot {self.index} ({self.kind}, {format_size(self.size)})"


def acquire(root: str | Path | None, memory: int, vm: str) -> Lease:
    """Lease the best free slot for `memory`; PoolEmpty if there is none."""
    pool = Pool(root)
    if not pool.exists():
        raise PoolEmpty(f"no warm pool at {pool.root} (start one with 'thinvm pool start')")
    token = secrets.token_hex(8)
    with pool.locked() as state:
        reap(state, owner_alive)
        slot = take(state, memory, owner_of(os.getpid()), vm, token)
        cfg = state.config
    return Lease(pool.root, slot.index, slot.path, slot.size, cfg.kind, cfg.page_size, token)


def release_vm(root: str | Path | None, lease: Lease | None, pid: int | None) -> None:
    """A VM is gone (its QEMU reaped): mark its slot dirty and get it scrubbed.

    Called from VM.kill(), so it never raises; a lease it cannot return is
    found by the pool's reaper once its owner is dead.
    """
    pool = Pool(lease.root if lease is not None else root)
    try:
        if not pool.exists():
            return
        with pool.locked() as state:
            slot = release(state, token=lease.token if lease is not None else None, pid=pid)
            daemon = state.daemon
        if slot is not None:
            kick(pool.root, daemon)
    except (OSError, ThinvmError) as exc:
        print(f"thinvm: warning: could not return a warm pool slot: {exc}", file=sys.stderr)


_children: list[subprocess.Popen[bytes]] = []


def _reap_children() -> None:
    for child in list(_children):
        if child.poll() is not None:
            _children.remove(child)


def _spawn_worker(root: Path, once: bool) -> subprocess.Popen[bytes]:
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "thinvm.pool", "serve", str(root)]
    if once:
        cmd.append("--once")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with open(root / LOG_FILE, "ab") as log:
        child = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
            env=env,
        )
    _reap_children()
    _children.append(child)
    return child


def kick(root: Path, daemon: Owner | None) -> None:
    """Have dirty slots scrubbed now: wake the daemon, or start a one-shot worker."""
    if daemon is not None and owner_alive(daemon):
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon.pid, signal.SIGUSR1)
            return
    _spawn_worker(root, once=True)


# -- the worker (daemon or one-shot) -----------------------------------------


def _chunk(kind: str) -> int:
    return HUGETLBFS_CHUNK if kind == "hugetlbfs" else TMPFS_CHUNK


class PoolLog:
    """The worker's output: running figures on a progress line, events on lines of their own."""

    def __init__(self, prefix: str = "pool: ", stream: TextIO | None = None) -> None:
        self.prefix = prefix
        self.stream = stream
        self._line = ProgressLine(prefix, stream=stream)
        self._open = False

    def progress(self, text: str) -> None:
        self._line.update(text)
        self._open = True

    def event(self, text: str) -> None:
        self._line.done(text)
        self._line = ProgressLine(self.prefix, stream=self.stream)
        self._open = False

    def close(self) -> None:
        if self._open:
            self._line.done()
            self._open = False


class Worker:
    """Fills, scrubs and shrinks slots; one action per step."""

    def __init__(
        self,
        pool: Pool,
        stop: threading.Event,
        out: PoolLog | None = None,
    ) -> None:
        self.pool = pool
        self.stop = stop
        self.out = out
        self.me = owner_of(os.getpid())
        self.fill_after = 0.0  # monotonic time; set by a shrink

    def step(self) -> Action:
        current = self.pool.read().config
        self._sync_cgroup_limit(current, current.policy)
        with self.pool.locked() as state:
            reap(state, owner_alive)
            cfg = state.config
            held = {s.index: allocated(s.path) for s in state.slots}
            action = decide(
                state.slots,
                held,
                read_pressure(cfg.policy),
                cfg.policy,
                spare=self._spare(cfg, state.slots),
                cooling=time.monotonic() < self.fill_after,
            )
            state.note = f"{action.kind}: {action.reason}" if action.reason else action.kind
            if action.index is None:
                return action
            slot = state.slots[action.index]
            slot.state = "filling" if action.kind == "fill" else "scrubbing"
            slot.owner, slot.error = self.me, ""
            slot = replace(slot)
        try:
            if action.kind == "fill":
                done, why = self._fill(slot, cfg)
            else:
                error = self._scrub(slot)
        except BaseException:
            self._finish(slot, "dirty", "interrupted")  # content unknown: scrub again
            raise
        if action.kind == "fill":
            self._finish(slot, "free" if done else "empty", "" if done else why)
            return action if done else Action("idle", slot.index, why)
        self._finish(slot, "dirty" if error else "empty", error)
        if error:
            return Action("idle", slot.index, error)
        if action.kind == "shrink":
            self.fill_after = time.monotonic() + cfg.policy.cooldown
            self.log(f"slot {slot.index}: given back ({action.reason})")
            if cfg.manage_hugepages:
                self._give_back_hugepages(cfg)
        return action

    def progress(self, text: str) -> None:
        if self.out is not None:
            self.out.progress(text)

    def log(self, text: str) -> None:
        if self.out is not None:
            self.out.event(text)

    def _finish(self, slot: Slot, new_state: str, error: str) -> None:
        with self.pool.locked() as state:
            current = state.slots[slot.index]
            if current.owner == self.me and current.state in ("filling", "scrubbing"):
                current.state, current.owner, current.error = new_state, None, error

    def _held(self) -> int:
        return sum(allocated(s.path) for s in self.pool.read().slots)

    def _fill(self, slot: Slot, cfg: PoolConfig) -> tuple[bool, str]:
        chunk = _chunk(cfg.kind)
        label = f"slot {slot.index} ({cfg.kind}, {format_size(slot.size)})"
        started = time.monotonic()
        fd = os.open(slot.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != slot.size:
                os.ftruncate(fd, slot.size)
            for offset in range(0, slot.size, chunk):
                if self.stop.is_set():
                    return False, "stopped"
                length = min(chunk, slot.size - offset)
                # Filling is in order, so what the file holds is a prefix.
                have = os.fstat(fd).st_blocks * 512
                new = max(0, min(length, offset + length - have))
                if new:
                    policy = self.pool.read().config.policy  # may change at run time
                    self._sync_cgroup_limit(cfg, policy)
                    remaining = slot.size - have
                    block = growth_block(
                        read_pressure(policy), policy, self._held(), remaining, self._spare(cfg)
                    )
                    if block is not None:
                        return False, f"not filling: {block}"
                    if cfg.manage_hugepages:
                        self._reserve_hugepages(cfg, new)
                    elif cfg.kind == "hugetlbfs" and self._spare(cfg) < new:
                        return False, (
                            f"{label}: not enough free huge pages (the rest are in use or "
                            "owed to leased slots): raise vm.nr_hugepages or pass "
                            "--reserve-hugepages"
                        )
                fill_chunk(fd, cfg.kind, offset, length)
                done = offset + length
                rate = done / MiB / max(time.monotonic() - started, 1e-3)
                self.progress(
                    f"{label}: filled {format_size(done)} of {format_size(slot.size)} "
                    f"({rate:.0f} MiB/s)"
                )
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                hint = (
                    "not enough huge pages: raise vm.nr_hugepages or pass --reserve-hugepages"
                    if cfg.kind == "hugetlbfs"
                    else f"{cfg.directory} is full"
                )
                return False, f"{label}: {hint}"
            return False, f"{label}: {exc.strerror}"
        except PoolError as exc:
            return False, str(exc)
        finally:
            os.close(fd)
        seconds = time.monotonic() - started
        self.log(f"{label}: free, filled in {seconds:.2f} s")
        return True, ""

    def _scrub(self, slot: Slot) -> str:
        """Punch the whole file; '' if nothing of it is left, else why not."""
        users = users_of(slot.path, exclude=os.getpid())
        if users:
            return f"still open in process {', '.join(map(str, users))}: not scrubbed"
        try:
            fd = os.open(slot.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(slot.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size:
                punch(fd, 0, size)
            if size != slot.size:
                os.ftruncate(fd, slot.size)
            left = os.fstat(fd).st_blocks * 512
        except OSError as exc:
            return f"punching slot {slot.index}: {exc.strerror}"
        finally:
            os.close(fd)
        if left:
            return f"slot {slot.index} still holds {format_size(left)} after punching"
        self.log(f"slot {slot.index}: punched, nothing left allocated")
        return ""

    def _owed(self, cfg: PoolConfig, slots: Sequence[Slot]) -> int:
        """Huge pages punched out of leased slots (balloon, reporting).

        A guest may touch those again (deflate) and its QEMU then faults a
        free huge page into the file; were none left, QEMU would die of
        SIGBUS.  So the pool never fills with, nor gives back, that many.
        """
        if cfg.kind != "hugetlbfs":
            return 0
        leased = [s for s in slots if s.state == "leased"]
        return sum(-(-max(0, s.size - allocated(s.path)) // cfg.page_size) for s in leased)

    def _spare(self, cfg: PoolConfig, slots: Sequence[Slot] | None = None) -> int:
        """Bytes of free huge pages the pool may fill (no cost to the host).

        Pass `slots` when holding the pool's lock (it is not reentrant).
        """
        if cfg.kind != "hugetlbfs":
            return 0
        if slots is None:
            slots = self.pool.read().slots
        owed = self._owed(cfg, slots)
        return max(0, hugepages_free(cfg.page_size) - owed) * cfg.page_size

    def _sync_cgroup_limit(self, cfg: PoolConfig, policy: Policy) -> None:
        """Keep the cgroup limit at budget + headroom as the budget changes.

        Lowering fails while the slots still hold more (tmpfs pages cannot
        be reclaimed without swap); the shrink that follows makes room and
        the next call succeeds.
        """
        if cfg.cgroup is None:
            return
        with contextlib.suppress(PoolError):
            set_cgroup_limit(cfg.cgroup, cgroup_limit(cfg.kind, policy))

    def _reserve_hugepages(self, cfg: PoolConfig, cost: int) -> None:
        page_size = cfg.page_size
        need = -(-cost // page_size) - self._spare(cfg) // page_size
        if need <= 0:
            return
        before = nr_hugepages(page_size)
        after = set_nr_hugepages(page_size, before + need)
        with self.pool.locked() as state:
            state.hugepages_added += max(0, after - before)
        if after < before + need:
            raise PoolError(
                f"the kernel gave only {after - before} of {need} more "
                f"{format_size(page_size)} pages (memory too fragmented or too little free)"
            )

    def _give_back_hugepages(self, cfg: PoolConfig) -> None:
        """Shrink the kernel's huge page pool by what a shrink freed."""
        spare = self._spare(cfg) // cfg.page_size
        with self.pool.locked() as state:
            count = min(state.hugepages_added, spare)
            if count <= 0:
                return
            before = nr_hugepages(cfg.page_size)
            after = set_nr_hugepages(cfg.page_size, before - count)
            state.hugepages_added -= max(0, before - after)


def serve(
    root: str | Path | None,
    *,
    once: bool = False,
    out: PoolLog | None = None,
) -> PoolState:
    """Run the pool's worker in this process until stopped (or, once, until idle).

    The process drops to idle CPU priority and joins the pool's cgroup, so
    all of the zeroing is charged there.  SIGTERM/SIGINT stop it after the
    current chunk; SIGUSR1 wakes it (a slot was released).
    """
    pool = Pool(root)
    state = pool.read()
    cfg = state.config
    idle_priority()
    if cfg.cgroup is not None:
        with contextlib.suppress(PoolError):  # over the limit: shrinking comes first
            join_cgroup(cfg.cgroup, cgroup_limit(cfg.kind, cfg.policy))
    stop, wake = threading.Event(), threading.Event()

    def on_stop(_signum: int, _frame: object) -> None:
        stop.set()
        wake.set()

    def on_wake(_signum: int, _frame: object) -> None:
        wake.set()

    handlers = {signal.SIGTERM: on_stop, signal.SIGINT: on_stop, signal.SIGUSR1: on_wake}
    previous = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
    worker = Worker(pool, stop, out)
    try:
        if not once:
            with pool.locked() as state:
                reap(state, owner_alive)
                if state.daemon is not None and state.daemon != worker.me:
                    raise PoolError(f"a pool daemon runs already (pid {state.daemon.pid})")
                state.daemon = worker.me
        last_note = ""
        while not stop.is_set():
            action = worker.step()
            if action.kind == "shrink" and not once:
                # Let the host's pressure figures catch up before the next one.
                wake.wait(pool.read().config.policy.interval)
                wake.clear()
            if action.kind != "idle":
                continue
            if action.reason != last_note:
                worker.log(action.reason)
                last_note = action.reason
            if once:
                break
            wake.wait(pool.read().config.policy.interval)
            wake.clear()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(PoolError, OSError), pool.locked() as state:
            if state.daemon == worker.me:
                state.daemon = None
    return pool.read()


def spawn_daemon(root: str | Path | None, timeout: float = 30.0) -> int:
    """Start the daemon in the background; returns its pid once it runs."""
    pool = Pool(root)
    state = pool.read()
    if state.daemon is not None and owner_alive(state.daemon):
        raise PoolError(f"a pool daemon runs already (pid {state.daemon.pid})")
    child = _spawn_worker(pool.root, once=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon = pool.read().daemon
        if daemon is not None and daemon.pid == child.pid:
            return child.pid
        if child.poll() is not None:
            raise PoolError(f"the pool daemon exited at start: {_log_tail(pool)}")
        time.sleep(0.05)
    raise PoolError(f"the pool daemon did not start within {timeout:.0f} s: {_log_tail(pool)}")


def _log_tail(pool: Pool) -> str:
    try:
        return pool.log_file.read_text(errors="replace").strip()[-600:]
    except OSError:
        return "(no log)"


def wait_until(
    root: str | Path | None,
    ready: Callable[[PoolState], bool],
    timeout: float,
    what: str,
) -> PoolState:
    pool = Pool(root)
    deadline = time.monotonic() + timeout
    while True:
        state = pool.read()
        if ready(state):
            return state
        if time.monotonic() > deadline:
            raise PoolError(f"timed out after {timeout:.0f} s waiting for {what} ({state.note})")
        time.sleep(0.1)


def wait_free(root: str | Path | None, memory: int | None = None, timeout: float = 600.0) -> None:
    """Until a free slot holds `memory`, or (None) until every slot is free."""
    if memory is None:
        wait_until(root, lambda s: all(x.state == "free" for x in s.slots), timeout, "all slots")
    else:
        wait_until(
            root,
            lambda s: choose_slot(s.slots, memory) is not None,
            timeout,
            f"a free slot of {format_size(memory)}",
        )


@dataclass(frozen=True)
class StopReport:
    removed: int
    left_to_vms: list[str]


def stop(root: str | Path | None, *, force: bool = False, timeout: float = 60.0) -> StopReport:
    """Stop the daemon and give every slot's memory back; undo what the pool set up.

    Slots leased to running VMs stop the stop, unless `force`: then their
    files are unlinked now and their memory goes back when their QEMU exits.
    """
    pool = Pool(root)
    if not pool.exists():
        raise PoolError(f"no warm pool at {pool.root}")
    state = pool.read()
    leased = [
        s
        for s in state.slots
        if s.state == "leased" and s.owner is not None and owner_alive(s.owner)
    ]
    if leased and not force:
        names = ", ".join(
            f"slot {s.index} to {s.vm or 'a VM'} (pid {s.owner.pid})" for s in leased if s.owner
        )
        raise PoolError(f"slots are leased: {names}; stop those VMs first, or pass --force")
    _stop_workers(pool, state, timeout)
    with pool._flock():
        state = pool._load()
        for slot in state.slots:
            with contextlib.suppress(OSError):
                if slot.state != "leased":
                    fd = os.open(slot.path, os.O_RDWR | os.O_CLOEXEC)
                    try:
                        punch(fd, 0, os.fstat(fd).st_size)
                    finally:
                        os.close(fd)
                os.unlink(slot.path)
        cfg = state.config
        if cfg.manage_hugepages and state.hugepages_added:
            before = nr_hugepages(cfg.page_size)
            set_nr_hugepages(cfg.page_size, before - state.hugepages_added)
            state.hugepages_added = 0
        with contextlib.suppress(OSError):
            os.rmdir(cfg.directory)
        if cfg.mounted is not None:
            if subprocess.run(["umount", cfg.mounted], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", cfg.mounted], capture_output=True)
            with contextlib.suppress(OSError):
                os.rmdir(cfg.mounted)
        if cfg.cgroup is not None:
            remove_cgroup(cfg.cgroup)
        report = StopReport(len(state.slots), [s.vm for s in leased])
        pool.state_file.unlink()
    for name in (LOCK_FILE, LOG_FILE):
        with contextlib.suppress(OSError):
            (pool.root / name).unlink()
    with contextlib.suppress(OSError):
        pool.root.rmdir()
    return report


def _stop_workers(pool: Pool, state: PoolState, timeout: float) -> None:
    """SIGTERM the daemon and any one-shot worker, and wait for them to go."""
    workers = [state.daemon] if state.daemon else []
    workers += [s.owner for s in state.slots if s.state in ("filling", "scrubbing") and s.owner]
    for owner in workers:
        if owner is not None and owner_alive(owner):
            with contextlib.suppress(ProcessLookupError):
                os.kill(owner.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for owner in workers:
        while owner is not None and owner_alive(owner):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(owner.pid, signal.SIGKILL)
            time.sleep(0.05)
            _reap_children()
    for child in list(_children):
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)
    _reap_children()


# -- status ------------------------------------------------------------------


@dataclass(frozen=True)
class SlotStatus:
    index: int
    size: int
    state: str
    held: int  # bytes the file holds; less than size once punched
    vm: str
    pid: int | None
    error: str


@dataclass(frozen=True)
class PoolStatus:
    root: str
    kind: str
    directory: str
    page_size: int
    daemon_pid: int | None
    policy: Policy
    pressure: Pressure
    slots: list[SlotStatus]
    cgroup: CgroupUsage | None
    hugepages_added: int
    note: str

    @property
    def held(self) -> int:
        return sum(s.held for s in self.slots)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["held"] = self.held
        return data


def status(root: str | Path | None = None) -> PoolStatus:
    pool = Pool(root)
    state = pool.read()
    cfg = state.config
    daemon = state.daemon if state.daemon is not None and owner_alive(state.daemon) else None
    slots = [
        SlotStatus(
            s.index,
            s.size,
            s.state,
            allocated(s.path),
            s.vm if s.state == "leased" else "",
            s.owner.pid if s.owner is not None else None,
            s.error,
        )
        for s in state.slots
    ]
    return PoolStatus(
        root=str(pool.root),
        kind=cfg.kind,
        directory=cfg.directory,
        page_size=cfg.page_size,
        daemon_pid=daemon.pid if daemon else None,
        policy=cfg.policy,
        pressure=read_pressure(cfg.policy),
        slots=slots,
        cgroup=cgroup_usage(cfg.cgroup) if cfg.cgroup else None,
        hugepages_added=state.hugepages_added,
        note=state.note,
    )


def format_status(st: PoolStatus) -> list[str]:
    daemon = f"daemon pid {st.daemon_pid}" if st.daemon_pid else "no daemon"
    psi = st.pressure.psi_some_avg10
    lines = [
        f"pool {st.root}: {st.kind} ({format_size(st.page_size)} pages) in {st.directory}, "
        f"{daemon}",
        f"holds {format_size(st.held)} of budget {format_size(st.policy.budget)}; "
        f"MemAvailable {format_size(st.pressure.mem_available)} "
        f"(watermark {format_size(st.policy.watermark)}); PSI some avg10 "
        + (f"{psi:.2f}%" if psi is not None else "n/a")
        + f" (threshold {st.policy.psi_threshold:g}%)",
    ]
    if st.cgroup is not None:
        cg = st.cgroup
        usage = format_size(cg.usage) if cg.usage is not None else "?"
        limit = format_size(cg.limit) if cg.limit is not None else "none"
        cpu = f", CPU {cg.cpu_seconds:.2f} s" if cg.cpu_seconds is not None else ""
        lines.append(
            f"cgroup {cg.path}: {usage} charged, limit {limit}, "
            f"limit hit {cg.failcnt or 0} times{cpu}"
        )
    if st.hugepages_added:
        lines.append(f"huge pages added to the kernel's pool: {st.hugepages_added}")
    for s in st.slots:
        line = (
            f"  slot {s.index}: {format_size(s.size):>10}  {s.state:9} holds {format_size(s.held)}"
        )
        if s.state in ("leased", "free") and s.held < s.size:
            line += f" ({format_size(s.size - s.held)} punched: balloon or free page reporting)"
        if s.state == "leased":
            line += f", VM {s.vm or '?'} (pid {s.pid})"
        if s.error:
            line += f"  [{s.error}]"
        lines.append(line)
    if st.note:
        lines.append(f"last: {st.note}")
    return lines


# -- starting VMs from the pool (library and benchmarks) ---------------------


@dataclass
class PoolStart:
    """A VM started from a warm slot, and how long it took."""

    vm: "VM"
    lease: str  # which slot, or why the VM fell back to ordinary preallocation
    pooled: bool
    qmp_s: float  # QEMU process start -> QMP answers (preallocation done)
    agent_s: float  # QEMU process start -> guest agent answers
    wait_slot_s: float  # waiting for a free slot (fill or scrub), before launch


def start_from_pool(
    config: "VMConfig", root: str | Path | None = None, *, wait_slot: float = 600.0
) -> PoolStart:
    """Start a VM on a warm slot, timed like the `start` benchmark.

    Waits (up to `wait_slot` s, not counted) until a fitting slot is free,
    then launches; times are measured from the QEMU process's start.  The
    caller owns the VM (use it as a context manager); its slot is scrubbed
    in the background once it is shut down.
    """
    from thinvm.vm.machine import VM

    pool = Pool(root)
    started = time.monotonic()
    wait_free(pool.root, config.memory, wait_slot)
    waited = time.monotonic() - started
    vm = VM(replace(config, pool=str(pool.root)))
    vm.start(wait_agent=False)
    try:
        assert vm.pid is not None
        qmp_s = process_age(vm.pid)
        vm.wait_agent()
        agent_s = process_age(vm.pid)
    except BaseException:
        vm.kill()
        raise
    lease = vm.pool_lease.describe() if vm.pool_lease is not None else vm.pool_note
    return PoolStart(vm, lease, vm.pool_lease is not None, qmp_s, agent_s, waited)


@contextlib.contextmanager
def temporary_pool(
    kind: str,
    slot_size: int,
    count: int = 1,
    *,
    tag: str | None = None,
    budget: int | None = None,
    watermark: int = 0,
    daemon: bool = True,
    fill_timeout: float = 600.0,
) -> Iterator[Pool]:
    """A private pool for tests and benchmarks, gone afterwards.

    hugetlbfs pools mount their own hugetlbfs and grow vm.nr_hugepages as
    they fill; stopping shrinks it back, unmounts and removes the cgroup.
    With `daemon`, a background daemon fills it (waited for) and scrubs.
    """
    name = f"pool-{tag or os.getpid()}"
    root = cache_dir() / "pools" / name
    spec = PoolSpec(
        slots=[slot_size] * count,
        kind=kind,
        budget=budget,
        watermark=watermark,
        reserve_hugepages=kind == "hugetlbfs",
    )
    if Pool(root).exists():
        stop(root, force=True)
    configure(root, spec)
    try:
        if daemon:
            spawn_daemon(root)
            if budget is None:
                wait_free(root, timeout=fill_timeout)
        yield Pool(root)
    finally:
        stop(root, force=True)


# -- python -m thinvm.pool serve ROOT [--once] --------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thinvm.pool")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the pool worker (the daemon, or --once)")
    p.add_argument("root")
    p.add_argument("--once", action="store_true", help="exit when there is nothing to do")
    args = parser.parse_args(argv)
    out = PoolLog(prefix=f"pool [{os.getpid()}]: ")
    try:
        serve(args.root, once=args.once, out=out)
    except ThinvmError as exc:
        print(f"thinvm pool: error: {exc}", file=sys.stderr)
        return 1
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    # Run the canonical module, not a second copy of it named __main__.
    from thinvm.pool import main as _main

    sys.exit(_main())
