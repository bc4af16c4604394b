"""Named memory cgroups (v1 or v2) with a limit: create, join, limit, measure, remove.

A name is a directory right under the memory controller's root (v1:
/sys/fs/cgroup/memory/NAME, with CPU accounting in the cpuacct hierarchy;
v2: /sys/fs/cgroup/NAME, or /sys/fs/cgroup/unified/NAME on a hybrid host
whose memory controller is on its cgroup2 hierarchy).  The warm pool charges its zeroing to one; the
balance controller can hold guests in one.
"""

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from thinvm.host import HostError
from thinvm.units import format_size

CGROUP_FS = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# Where cgroup2 may be mounted under CGROUP_FS: the whole tree, or beside
# the v1 hierarchies (systemd's hybrid layout).
V2_MOUNTS = ("", "unified")


@dataclass(frozen=True)
class Cgroup:
    """Where a named cgroup lives (whether or not it exists yet)."""

    memory: Path
    cpu: Path | None  # CPU accounting directory (v1: cpuacct), None if there is none
    v2: bool

    @property
    def dirs(self) -> list[Path]:
        """The directories to create and remove, each once."""
        return list(dict.fromkeys(p for p in (self.memory, self.cpu) if p is not None))


@dataclass(frozen=True)
class CgroupUsage:
    path: str
    usage: int | None  # bytes charged (v1: usage_in_bytes, v2: memory.current)
    limit: int | None  # None: unlimited
    failcnt: int | None  # times the limit was hit
    cpu_seconds: float | None
    swap: int | None = None  # bytes swapped out; None where not accounted


def find_cgroup(name: str) -> Cgroup | None:
    """The memory cgroup called `name`; None if no memory controller is mounted.

    A controller is on one hierarchy at a time: v2 where a cgroup2 root
    lists it, else v1's.
    """
    for mount in V2_MOUNTS:
        root = CGROUP_FS / mount
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            return Cgroup(root / name, root / name, v2=True)
    if (CGROUP_FS / "memory" / "memory.limit_in_bytes").is_file():
        cpu = next(
            (
                CGROUP_FS / c / name
                for c in ("cpuacct", "cpu,cpuacct")
                if (CGROUP_FS / c / "cpuacct.usage").is_file()
            ),
            None,
        )
        return Cgroup(CGROUP_FS / "memory" / name, cpu, v2=False)
    return None


def make_dirs(cg: Cgroup) -> None:
    """Create the cgroup's directories (existing is fine); v2: with memory.* files."""
    if cg.v2:
        enable_memory_controller(cg.memory.parent)
    for d in cg.dirs:
        d.mkdir(exist_ok=True)


def enable_memory_controller(parent: Path) -> None:
    """v2: a child cgroup has memory.max and the rest only once its parent's
    cgroup.subtree_control lists the memory controller."""
    control = parent / "cgroup.subtree_control"
    try:
        if "memory" in control.read_text().split():
            return
        control.write_text("+memory")
    except OSError as exc:
        raise HostError(
            f"cannot enable the memory controller in {control}: {exc.strerror} "
            "(the kernel refuses it in a cgroup other than the root that holds processes "
            "itself: run thinvm where the memory controller is delegated to it)"
        ) from exc


def create_cgroup(name: str, limit: int | None = None) -> str | None:
    """Create the cgroup (existing is fine), optionally limited; its memory dir, or None."""
    cg = find_cgroup(name)
    if cg is None:
        return None
    make_dirs(cg)
    if limit is not None:
        set_cgroup_limit(name, limit)
    return str(cg.memory)


def add_process(name: str, pid: int) -> None:
    """Move a process (all its threads) into an existing cgroup.

    On v1 the memory it holds already stays charged where it was; only new
    allocations are charged here.
    """
    cg = find_cgroup(name)
    if cg is None:
        return
    for d in cg.dirs:
        (d / "cgroup.procs").write_text(str(pid))


def join_cgroup(name: str, limit: int) -> str | None:
    """Move this process into its memory (and CPU accounting) cgroup, then limit it.

    The limit comes last: if the cgroup (left from an earlier run) holds
    more than `limit`, setting it fails (HostError) with this process
    already inside, so its caller can shrink first and retry.
    """
    cg = find_cgroup(name)
    if cg is None:
        return None
    pid = str(os.getpid())
    make_dirs(cg)
    for d in cg.dirs:
        (d / "cgroup.procs").write_text(pid)
    set_cgroup_limit(name, limit)
    return str(cg.memory)


def set_cgroup_limit(name: str, limit: int | None) -> None:
    """Set the memory limit (None: none); HostError if the cgroup holds more
    and cannot reclaim it."""
    cg = find_cgroup(name)
    if cg is None:
        return
    limit_file = cg.memory / ("memory.max" if cg.v2 else "memory.limit_in_bytes")
    if read_int(limit_file) == limit:
        return
    unlimited = "max" if cg.v2 else "-1"
    try:
        limit_file.write_text(unlimited if limit is None else str(limit))
    except OSError as exc:
        if limit is None:
            raise HostError(f"cannot lift the limit of cgroup {cg.memory}: {exc.strerror}") from exc
        raise HostError(
            f"cannot limit cgroup {cg.memory} to {format_size(limit)}: {exc.strerror} "
            "(it holds more: free some first)"
        ) from exc


def read_int(path: Path) -> int | None:
    """A cgroup file holding one number; None if unreadable or "max"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def parse_keyed(text: str) -> dict[str, int]:
    """A flat keyed cgroup file ("key value" lines: memory.events, cpu.stat)."""
    values = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("-").isdigit():
            values[fields[0]] = int(fields[1])
    return values


def _read_keyed(path: Path) -> dict[str, int] | None:
    try:
        return parse_keyed(path.read_text())
    except OSError:
        return None


def cgroup_usage(name: str) -> CgroupUsage | None:
    """What the cgroup holds and may hold; None if it does not exist."""
    cg = find_cgroup(name)
    if cg is None or not cg.memory.is_dir():
        return None
    mem = cg.memory
    if cg.v2:
        events = _read_keyed(mem / "memory.events")
        stat = _read_keyed(mem / "cpu.stat")
        return CgroupUsage(
            str(mem),
            read_int(mem / "memory.current"),
            read_int(mem / "memory.max"),
            events.get("max", 0) if events is not None else None,
            stat["usage_usec"] / 1e6 if stat and "usage_usec" in stat else None,
            read_int(mem / "memory.swap.current"),
        )
    usage = read_int(mem / "memory.usage_in_bytes")
    # memsw (memory + swap) exists only with swap accounting compiled in and enabled.
    memsw = read_int(mem / "memory.memsw.usage_in_bytes")
    ns = read_int(cg.cpu / "cpuacct.usage") if cg.cpu is not None else None
    return CgroupUsage(
        str(mem),
        usage,
        read_int(mem / "memory.limit_in_bytes"),
        read_int(mem / "memory.failcnt"),
        ns / 1e9 if ns is not None else None,
        max(0, memsw - usage) if memsw is not None and usage is not None else None,
    )


def remove_cgroup(name: str) -> None:
    """Remove the cgroup; waits up to 5 s per directory for processes leaving it."""
    cg = find_cgroup(name)
    if cg is None:
        return
    for d in cg.dirs:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: a process is still leaving
                time.sleep(0.1)


def own_cgroup(cg: Cgroup) -> Path:
    """This process's cgroup in the hierarchy of `cg`'s memory controller."""
    root = cg.memory.parent
    for line in PROC_SELF_CGROUP.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controllers == "") if cg.v2 else ("memory" in controllers.split(",")):
            return root / path.lstrip("/")
    return root


def release_processes(name: str) -> None:
    """Move the processes left in the cgroup (v1: its memory hierarchy) to
    this process's own cgroup, so that it can be removed while they run on,
    charged where their owner is."""
    cg = find_cgroup(name)
    if cg is None:
        return
    try:
        pids = (cg.memory / "cgroup.procs").read_text().split()
    except OSError:
        return  # not there: nothing to move
    own = own_cgroup(cg) / "cgroup.procs"
    for pid in pids:
        _write_pid(own, pid)


def _write_pid(procs: Path, pid: str) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        procs.write_text(pid)
