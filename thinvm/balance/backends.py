"""Where samples come from and where targets go: thinvm VMs, libvirt, the host.

A VM backend lists the VMs it manages, samples them and sets balloon
targets.  A host source says how much memory the guests share.  Both are
small so the daemon, the tests and the benchmark can swap them.
"""

import contextlib
import functools
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from thinvm.balance.model import (
    Backing,
    BadGuestData,
    GuestStats,
    HostSample,
    Reclaimer,
    VmSample,
    parse_guest_stats,
    stress_from_vmstat,
)
from thinvm.balance.reclaimers import GuestReclaimers
from thinvm.errors import ThinvmError
from thinvm.guest.agent import AGENT_PORT, AgentClient, channel_lock, libvirt_agent_socket
from thinvm.host.cgroups import cgroup_usage
from thinvm.host.memory import host_meminfo, parse_vmstat, process_memory
from thinvm.host.pressure import Psi, read_cgroup_psi, read_psi
from thinvm.host.procs import proc_start_time
from thinvm.units import GiB, KiB, MiB, format_size
from thinvm.vm import balloon, migrate, registry, resize
from thinvm.vm.machine import VM, UnreadableState, VMConfig
from thinvm.vm.resize import Lever, VirtioMem

STATS_POLL_SECONDS = 1  # how often guests send balloon statistics
VIRSH_TIMEOUT = 30.0  # seconds: a virsh call that takes longer is a failed call
# A libvirt domain's stress counters, read through its agent each cycle.
VMSTAT_COMMAND = "cat /proc/vmstat"
AGENT_STATS_TIMEOUT = 2.0
T = TypeVar("T")


def describe_error(exc: BaseException) -> str:
    """An error for the log: thinvm's own errors say what went wrong; any
    other exception also names its type, so a bug can be found from it."""
    if isinstance(exc, ThinvmError | BadGuestData):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class HeldByOperator(ThinvmError):
    """An operator set the VM's target after the cycle sampled it: not changed."""


class VmGone(ThinvmError):
    """The VM stopped or migrated away after the cycle sampled it."""


class VmBackend(Protocol):
    name: str

    def sample(self) -> list[VmSample]:
        """Every VM managed.  A VM that cannot be sampled is left out of the
        list and its error kept for sample_errors(): one guest never keeps
        the others from being sampled."""
        ...

    def sample_errors(self) -> list[str]:
        """The per-VM errors since the last call, each "NAME: what went wrong"."""
        ...

    def set_target(self, vm: str, target: int) -> None: ...

    def set_reclaim(self, vm: str, on: bool) -> None: ...

    def trim(self, vm: str, max_bytes: int) -> bool: ...

    def close(self) -> None: ...


class HostSource(Protocol):
    def sample(self) -> HostSample: ...


# -- host sources --------------------------------------------------------------


def _with_psi(total: int, available: int, swap_used: int, psi: Psi | None) -> HostSample:
    return HostSample(
        total=total,
        available=available,
        swap_used=swap_used,
        psi_some_avg10=psi.some_avg10 if psi else None,
        psi_full_avg10=psi.full_avg10 if psi else None,
        psi_some_avg60=psi.some_avg60 if psi else None,
        psi_full_avg60=psi.full_avg60 if psi else None,
    )


class WholeHost:
    """The machine: MemTotal, MemAvailable, swap in use, /proc/pressure/memory."""

    def sample(self) -> HostSample:
        info = host_meminfo()
        swap_used = info.get("SwapTotal", 0) - info.get("SwapFree", 0)
        return _with_psi(info["MemTotal"], info["MemAvailable"], swap_used, read_psi())


class CgroupBudget:
    """A memory cgroup holding the guests: its limit is what they share.

    Pressure comes from the cgroup's own memory.pressure on cgroup v2; v1
    has none, so the host's PSI stands in.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def sample(self) -> HostSample:
        usage = cgroup_usage(self.name)
        if usage is None or usage.usage is None:
            raise ThinvmError(f"memory cgroup {self.name!r} does not exist: create it first")
        info = host_meminfo()
        limit = usage.limit if usage.limit is not None and usage.limit < info["MemTotal"] else None
        total = limit if limit is not None else info["MemTotal"]
        available = min(total - usage.usage, info["MemAvailable"])
        psi = read_cgroup_psi(Path(usage.path)) or read_psi()
        return _with_psi(total, available, usage.swap or 0, psi)


class RssBudget:
    """A budget of `limit` bytes for the combined host RSS of the guests.

    No kernel enforces it: it tells the policy how much memory it may give
    out, as a smaller host would, without making the real host swap.  The
    real host's MemAvailable still caps it, and PSI is the real host's.
    """

    def __init__(self, limit: int, pids: Callable[[], Sequence[int]]) -> None:
        self.limit = limit
        self.pids = pids

    def used(self) -> int:
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                total += process_memory(pid).rss
        return total

    def sample(self) -> HostSample:
        info = host_meminfo()
        available = min(self.limit - self.used(), info["MemAvailable"])
        return _with_psi(self.limit, available, 0, read_psi())


class DomainRssBudget(RssBudget):
    """An RssBudget for libvirt domains: their RSS as libvirt reports it
    (`balloon.rss`), so no QEMU pid needs to be known.  The local host's
    MemAvailable and PSI stand in for the domains' host, as with WholeHost:
    use it with a local URI."""

    def __init__(self, limit: int, backend: "LibvirtBackend") -> None:
        super().__init__(limit, lambda: ())
        self.backend = backend

    def used(self) -> int:
        return self.backend.rss()


# -- thinvm VMs ----------------------------------------------------------------


def hugetlb_of_rollup(text: str) -> int:
    """Bytes of hugetlbfs pages a process maps, from its /proc/PID/smaps_rollup."""
    total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name in ("Shared_Hugetlb", "Private_Hugetlb") and fields:
            total += int(fields[0]) * KiB
    return total


def _maps_hugetlb(pid: int | None) -> bool:
    """Whether the process (a QEMU) has RAM on hugetlbfs: a warm pool slot
    or a file: backend there, whatever its path is called."""
    if pid is None:
        return False
    try:
        return hugetlb_of_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text()) > 0
    except OSError:
        return False


def _backing_of(config: VMConfig, rss_thp: int, pid: int | None = None) -> Backing:
    backend = str(config.backend)
    if (config.pool is not None or backend.startswith("file:")) and _maps_hugetlb(pid):
        return Backing.HUGETLBFS
    if config.pool is not None:
        return Backing.POOL
    if backend.startswith("file:") and "huge" in backend:
        return Backing.HUGETLBFS
    return Backing.THP if rss_thp > 0 else Backing.ANONYMOUS


def _virtio_mem(vm: VM) -> VirtioMem | None:
    """The VM's virtio-mem device (thinvm.vm.resize), or None without one."""
    return resize.virtio_mem_status(vm) if vm.config.virtio_mem else None


def _process_identity(pid: int | None) -> str | None:
    """Which QEMU process this is: its pid and start time (a later process
    may get the same pid, never the same pid and start time)."""
    start = proc_start_time(pid) if pid is not None else None
    return f"pid {pid} started {start}" if start is not None else None


class ThinvmBackend:
    """VMs started by thinvm and left running detached (`thinvm up`);
    GivenVmsBackend drives VM objects handed to it instead.

    Talks QMP through each VM's monitor (thinvm.vm.balloon).  Turns on
    statistics polling on a VM that has it off, since without statistics
    the controller never shrinks a guest.

    A detached VM is used alongside everyone else's commands: the
    controller holds one QMP monitor of its own (the VM has several), and
    it talks to a VM only under the VM's name lock (thinvm.vm.registry),
    so a migration's switchover or a `down` happens between two of its
    cycles, never in the middle of one; afterwards it attaches to the QEMU
    that took the name over.
    """

    name = "thinvm"

    def __init__(
        self,
        names: Sequence[str] = (),
        log: Callable[[str], None] = lambda _line: None,
    ) -> None:
        self.log = log
        self._names = set(names)  # only these detached VMs; empty: all
        self._attached: dict[str, VM] = {}
        self._errors: list[str] = []  # per VM, since sample_errors() last took them
        self.reclaimers = GuestReclaimers(log, self._errors)

    def _managed(self) -> list[str]:
        # A VM mid-switchover is missing from the listing for a moment:
        # the ones attached already are looked at again under their lock.
        names = set(registry.names()) | set(self._attached)
        if self._names:
            names &= self._names
        return sorted(names)

    def _attach(self, name: str) -> VM | None:
        """The VM called `name`, attached; None if it is gone.  Needs its name lock."""
        vm = self._attached.get(name)
        unreadable: UnreadableState | None = None
        try:
            state = registry.read_state(name)
        except UnreadableState as exc:
            state, unreadable = None, exc
        except ThinvmError:
            state = None
        if vm is not None and (state is None or state.get("pid") != vm.pid or not vm.alive()):
            self._attached.pop(name).disconnect()  # stopped, or replaced by a migration
            vm = None
        if unreadable is not None:
            # Not gone: a VM we cannot manage (a state file of another
            # thinvm version, an edit) is that VM's error, said every cycle.
            raise unreadable
        if state is None:
            return None
        if vm is None:
            vm = VM.attach(registry.rundir(name))
            self._attached[name] = vm
        vm.operator_target = state.get("operator_target")
        return vm

    def _each_vm(self, func: Callable[[VM], T]) -> list[T]:
        """func(vm) for every VM managed, each under its name lock if detached.

        Whatever goes wrong with one VM (its QEMU, its guest, its state
        file) is kept as that VM's error and the others are served: a guest
        is not trusted, and the controller serves every VM of the host, so
        any exception counts here, a bug in reading a reply included."""
        results = []
        for name, call in self._calls(func):
            try:
                results.append(call())
            except VmGone:
                continue
            except Exception as exc:
                self._errors.append(f"{name}: not sampled: {describe_error(exc)}")
        return results

    def _calls(self, func: Callable[[VM], T]) -> list[tuple[str, Callable[[], T]]]:
        return [(name, functools.partial(self._with_vm, name, func)) for name in self._managed()]

    def pids(self) -> list[int]:
        return [pid for pid in self._each_vm(lambda vm: vm.pid) if pid is not None]

    def sample(self) -> list[VmSample]:
        return self._each_vm(self._sample_one)

    def sample_errors(self) -> list[str]:
        errors, self._errors = self._errors, []
        return errors

    def _sample_one(self, vm: VM) -> VmSample:
        name, config = vm.config.name, vm.config
        mem = vm.host_memory()
        vmem = _virtio_mem(vm)
        identity = _process_identity(vm.pid)
        if not config.balloon.enabled and vmem is None:
            return VmSample(name, config.memory, None, host_rss=mem.rss, identity=identity)
        levers: list[Lever] = []
        stats = None
        actual = config.memory
        if config.balloon.enabled:
            levers.append(Lever.BALLOON)
            actual = balloon.query(vm).actual
            balloon.ensure_stats(vm, STATS_POLL_SECONDS)
            stats = self._guest_stats(name, balloon.stats(vm))
        if vmem is not None:
            levers.append(Lever.VIRTIO_MEM)
            actual += vmem.plugged
        # A source that finished migrating waits in `postmigrate` for its
        # switchover: a target sent to it would be lost.
        migrating = migrate.in_progress(vm)
        held = vm.operator_target
        if held is not None and vmem is not None:
            # 'thinvm resize' records a total, 'thinvm balloon' a balloon
            # target: either way the VM stays where the operator put it, and
            # the controller carries on from the size it has.
            held = actual
        return VmSample(
            name=name,
            max_memory=config.max_memory,
            actual=actual,
            stats=stats,
            migrating=migrating,
            backing=_backing_of(config, mem.anon_huge, vm.pid),
            host_rss=mem.rss,
            reporting=config.balloon.enabled and config.balloon.free_page_reporting,
            held=held,
            reclaimer=self._reclaimer_of(vm),
            levers=tuple(levers),
            virtio_mem=vmem,
            identity=identity,
        )

    def _guest_stats(self, name: str, reply: dict[str, Any]) -> GuestStats | None:
        """The balloon statistics, or None (never shrink) if the guest sent
        values that cannot be right: an error of that VM, not of the cycle."""
        try:
            return parse_guest_stats(reply, now=time.time())
        except BadGuestData as exc:
            self._errors.append(f"{name}: balloon statistics ignored: {exc}")
            return None

    def _reclaimer_of(self, vm: VM) -> Reclaimer | None:
        """The guest reclaimer, asked of reporting guests only: without
        reporting, what it frees stays with the guest, so trim first never
        applies and the agent is left alone."""
        if not vm.config.balloon.free_page_reporting:
            return None
        return self.reclaimers.reclaimer(vm.config.name, vm.agent)

    def _with_vm(self, name: str, func: Callable[[VM], T]) -> T:
        """func(the VM called `name`), under its name lock."""
        with registry.name_lock(name):
            machine = self._attach(name)
            if machine is None:
                raise VmGone(f"VM {name!r} is gone")
            return func(machine)

    def set_target(self, vm: str, target: int) -> None:
        def send(machine: VM) -> None:
            self._check_not_held(machine)
            resize.apply_total(machine, target)

        self._with_vm(vm, send)

    def _check_not_held(self, machine: VM) -> None:
        """HeldByOperator if an operator set a target (`thinvm balloon` or
        `resize`, read from the state file under the name lock) between
        this cycle's sample and now."""
        if machine.operator_target is not None:
            raise HeldByOperator(
                f"held at {format_size(machine.operator_target)} by an operator "
                "(thinvm balloon or resize) since this cycle's sample"
            )

    def set_reclaim(self, vm: str, on: bool) -> None:
        self._with_vm(vm, lambda m: self.reclaimers.set_background(vm, m.agent, on))

    def trim(self, vm: str, max_bytes: int) -> bool:
        """Start a bounded trim of `vm`'s guest in the background (see
        GuestReclaimers.trim); False if one is still running."""
        machine = self._with_vm(vm, lambda m: m)
        return self.reclaimers.trim(vm, machine.agent, max_bytes)

    def close(self) -> None:
        self.reclaimers.close()
        for vm in self._attached.values():
            vm.disconnect()
        self._attached.clear()


class GivenVmsBackend(ThinvmBackend):
    """VM objects handed in (the benchmarks, the tests): driven as they are,
    with no registry, no name lock and no attaching.  Nobody else resizes
    them, so there is no operator's hold to respect."""

    def __init__(self, vms: Sequence[VM], log: Callable[[str], None] = lambda _line: None) -> None:
        super().__init__(log=log)
        self._vms = list(vms)

    def _calls(self, func: Callable[[VM], T]) -> list[tuple[str, Callable[[], T]]]:
        return [(vm.config.name, functools.partial(func, vm)) for vm in self._vms if vm.alive()]

    def _with_vm(self, name: str, func: Callable[[VM], T]) -> T:
        for machine in self._vms:
            if machine.config.name == name and machine.alive():
                return func(machine)
        raise VmGone(f"VM {name!r} is gone")

    def _check_not_held(self, machine: VM) -> None:
        # No state file an operator could have written since the sample:
        # the hold a sample saw (VM.operator_target) is all there is.
        return None


# -- libvirt -------------------------------------------------------------------


@dataclass(frozen=True)
class DomainStats:
    """One domain's `virsh domstats --balloon` block, in bytes."""

    name: str
    values: dict[str, int]


def parse_domstats(text: str) -> list[DomainStats]:
    """Parse `virsh domstats --balloon` (KiB except faults and last-update)."""
    domains: list[DomainStats] = []
    name, values = "", dict[str, int]()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Domain:"):
            if name:
                domains.append(DomainStats(name, values))
            name, values = line.split(":", 1)[1].strip().strip("'"), {}
        elif "=" in line and name:
            key, _, value = line.partition("=")
            with contextlib.suppress(ValueError):
                values[key.strip()] = int(value)
    if name:
        domains.append(DomainStats(name, values))
    return domains


# libvirt's balloon stats -> QMP's names (libvirt reports KiB; faults are counts).
_LIBVIRT_TO_QMP = {
    "balloon.unused": "stat-free-memory",
    "balloon.usable": "stat-available-memory",
    "balloon.available": "stat-total-memory",
    "balloon.disk_caches": "stat-disk-caches",
    "balloon.swap_in": "stat-swap-in",
    "balloon.swap_out": "stat-swap-out",
}
_COUNTS = {"balloon.major_fault": "stat-major-faults"}


# libvirt's scaled units (formatdomain: "unit"), KiB when absent.
_LIBVIRT_UNITS = {
    "b": 1, "bytes": 1,
    "k": KiB, "KiB": KiB, "KB": 1000,
    "M": MiB, "MiB": MiB, "MB": 1000**2,
    "G": GiB, "GiB": GiB, "GB": 1000**3,
}  # fmt: skip


def _libvirt_size(elem: ET.Element | None, attr: str | None = None) -> int:
    """A size element (or attribute `attr` of one) of libvirt XML, in bytes."""
    if elem is None:
        return 0
    text = elem.get(attr) if attr else elem.text
    unit = elem.get("unit", "KiB")
    if text is None or unit not in _LIBVIRT_UNITS:
        raise ThinvmError(f"libvirt XML: cannot read a size from <{elem.tag}> ({text!r} {unit})")
    return int(text) * _LIBVIRT_UNITS[unit]


@dataclass(frozen=True)
class DomainVirtioMem:
    """A domain's virtio-mem device: its alias (for update-memory-device)
    and its sizes, as the live domain XML has them; `balloon` is what the
    balloon leaves the guest of its base memory."""

    alias: str
    device: VirtioMem
    balloon: int


def parse_virtio_mem(xml: str) -> DomainVirtioMem | None:
    """The virtio-mem device of a live domain XML (`virsh dumpxml`), or None.

    The base memory, what the guest can never unplug, is its NUMA cells'
    memory (libvirt needs a NUMA node for virtio-mem); `current` is what
    the guest has plugged (live XML only).  libvirt 11.3 counts plugged
    memory in `<currentMemory>` (and domstats' `balloon.current`) but takes
    `setmem` sizes for the balloon alone, within the base: with 512 MiB
    plugged into a 512 MiB base, `setmem 400M` gave 912 MiB current and
    QEMU's balloon 400 MiB.  The controller drives one device: a domain
    with several is driven through its first."""
    root = ET.fromstring(xml)
    memory = root.find("devices/memory[@model='virtio-mem']")
    if memory is None:
        return None
    alias = memory.find("alias")
    if alias is None or not alias.get("name"):
        raise ThinvmError("libvirt XML: a virtio-mem device without an alias")
    cells = root.findall("cpu/numa/cell")
    devices = root.findall("devices/memory")
    base = sum(_libvirt_size(cell, "memory") for cell in cells) or (
        _libvirt_size(root.find("memory"))
        - sum(_libvirt_size(d.find("target/size")) for d in devices)
    )
    plugged = _libvirt_size(memory.find("target/current"))
    device = VirtioMem(
        base=base,
        plugged=plugged,
        requested=_libvirt_size(memory.find("target/requested")),
        block_size=_libvirt_size(memory.find("target/block")),
        max_size=_libvirt_size(memory.find("target/size")),
    )
    current = root.find("currentMemory")
    balloon = _libvirt_size(current) - plugged if current is not None else base
    return DomainVirtioMem(alias=str(alias.get("name")), device=device, balloon=balloon)


def parse_backing(xml: str) -> Backing:
    """How a domain's RAM is backed on the host, from its domain XML.

    `<memoryBacking><hugepages/>` puts it on hugetlbfs; `<locked/>` mlocks
    it, as a VFIO device (`<hostdev>` of a PCI device or an mdev) pins it.
    A balloon frees nothing of pinned RAM, and of hugetlbfs RAM only whole
    huge pages, which the host may hand to someone else: a later deflate
    then finds no huge page to fault in and QEMU dies of SIGBUS."""
    root = ET.fromstring(xml)
    if root.find("memoryBacking/hugepages") is not None:
        return Backing.HUGETLBFS
    if root.find("memoryBacking/locked") is not None:
        return Backing.PINNED
    for hostdev in root.findall("devices/hostdev"):
        if hostdev.get("mode", "subsystem") == "subsystem" and hostdev.get("type") in (
            "pci",
            "mdev",
        ):
            return Backing.PINNED
    return Backing.ANONYMOUS


def parse_reporting(xml: str) -> bool:
    """Whether a domain's balloon reports free pages: libvirt's
    `freePageReporting` attribute where the XML has one, else the machine
    type's default (on in pc-q35-10.0-thinvm, QEMU 0019; off in QEMU's)."""
    root = ET.fromstring(xml)
    balloon = root.find("devices/memballoon")
    if balloon is None or balloon.get("model", "virtio") == "none":
        return False
    setting = balloon.get("freePageReporting")
    if setting is not None:
        return setting == "on"
    machine = root.find("os/type")
    return machine is not None and (machine.get("machine") or "").endswith("-thinvm")


def domain_identity(xml: str) -> str | None:
    """Which run of a domain a live domain XML is: its UUID (a domain
    defined anew has another) and its domain id (libvirt gives a domain a
    new one each time it starts).  None for XML without a UUID."""
    root = ET.fromstring(xml)
    uuid = (root.findtext("uuid") or "").strip()
    if not uuid:
        return None
    return f"uuid {uuid} id {root.get('id', '-')}"


def domain_sample(
    dom: DomainStats,
    now: float,
    migrating: bool = False,
    virtio_mem: VirtioMem | None = None,
    backing: Backing = Backing.ANONYMOUS,
    identity: str | None = None,
) -> VmSample:
    """A VmSample from libvirt's balloon statistics of one domain (and its
    virtio-mem device: libvirt's `balloon.current` already counts what the
    guest has plugged, and the guest can have all of the device).
    BadGuestData if the guest's statistics cannot be right."""
    v = dom.values
    stats: dict[str, int] = {q: v[k] * KiB for k, q in _LIBVIRT_TO_QMP.items() if k in v}
    stats.update({q: v[k] for k, q in _COUNTS.items() if k in v})
    guest = parse_guest_stats({"last-update": v.get("balloon.last-update", 0), "stats": stats}, now)
    actual = v.get("balloon.current", 0) * KiB or None
    maximum = v.get("balloon.maximum", 0) * KiB or (actual or 0)
    levers: tuple[Lever, ...] = (Lever.BALLOON,)
    if virtio_mem is not None:
        levers = (Lever.BALLOON, Lever.VIRTIO_MEM)
        actual = actual or virtio_mem.total
        maximum = virtio_mem.base + virtio_mem.max_size
    return VmSample(
        name=dom.name,
        max_memory=maximum,
        actual=actual,
        stats=guest,
        migrating=migrating,
        host_rss=v["balloon.rss"] * KiB if "balloon.rss" in v else None,
        levers=levers,
        virtio_mem=virtio_mem,
        backing=backing,
        identity=identity,
    )


def migrating_from_jobinfo(text: str) -> bool:
    """`virsh domjobinfo`: an active job whose operation is a migration."""
    pairs = (line.partition(":") for line in text.splitlines())
    fields = {key.strip(): value.strip() for key, _, value in pairs}
    return fields.get("Job type", "None") != "None" and "igration" in fields.get("Operation", "")


class LibvirtBackend:
    """libvirt domains through `virsh -c URI` (domstats, domjobinfo, dumpxml;
    setmem, or update-memory-device for a domain with virtio-mem).

    virsh keeps the controller free of the libvirt Python binding, which
    needs libvirt's headers to build; it costs a process per call, which
    is nothing at one cycle every few seconds.  libvirt (11.3) does not
    pass on Linux 6.12's stall and reclaim statistics: for a domain with
    our agent's channel they are read from the guest's /proc/vmstat
    through the agent, as the 6.12 driver computes them; without the
    channel the thinvm policy sees only free/available memory.

    A domain with our agent's channel (`thinvm fleet xml` writes it:
    `<channel type='unix'>`, target name org.thinvm.agent, the path left
    to libvirt) has its guest reclaimer driven as thinvm's own VMs have:
    background mode switched on, bounded trims under host pressure.  The
    controller runs on the host, where libvirt's socket paths are valid;
    `outside` maps a path on the host to where this controller sees it,
    for one that sees the host's files elsewhere (a container with the
    host's root mounted; a simulated cluster host, thinvm.fleet.cluster's
    Host.outside); by default the paths are the controller's own.
    """

    name = "libvirt"

    def __init__(
        self,
        uri: str,
        stats_period: int = STATS_POLL_SECONDS,
        names: Sequence[str] = (),
        log: Callable[[str], None] = lambda _line: None,
        outside: Callable[[str], Path] = Path,
    ) -> None:
        self.uri = uri
        self.log = log
        self._names = set(names)
        self.stats_period = stats_period
        self.outside = outside
        self._period_set: set[str] = set()
        self._virtio_mem: dict[str, DomainVirtioMem] = {}
        self._errors: list[str] = []
        self._agents: dict[str, AgentClient] = {}  # by domain, of its current run
        self.reclaimers = GuestReclaimers(log, self._errors)

    def _virsh(self, *args: str) -> str:
        command = f"virsh {' '.join(args)}"
        try:
            done = subprocess.run(
                ["virsh", "-c", self.uri, *args],
                capture_output=True,
                text=True,
                timeout=VIRSH_TIMEOUT,
                check=False,
            )
        except FileNotFoundError as exc:
            raise ThinvmError("virsh not found: install libvirt-clients") from exc
        except subprocess.TimeoutExpired as exc:
            raise ThinvmError(
                f"{command}: no answer from {self.uri} within {VIRSH_TIMEOUT:.0f} s"
            ) from exc
        except OSError as exc:
            raise ThinvmError(f"{command}: cannot run virsh: {exc}") from exc
        if done.returncode != 0:
            raise ThinvmError(f"{command}: {done.stderr.strip() or done.stdout}")
        return done.stdout

    def _domains(self) -> list[DomainStats]:
        domains = parse_domstats(self._virsh("domstats", "--balloon", "--list-running"))
        if self._names:
            domains = [dom for dom in domains if dom.name in self._names]
        return domains

    def sample(self) -> list[VmSample]:
        now = time.time()
        samples = []
        domains = self._domains()
        for gone in set(self._agents) - {dom.name for dom in domains}:
            self._drop_agent(gone)
        for dom in domains:
            try:
                samples.append(self._sample_one(dom, now))
            except Exception as exc:
                # Gone since domstats (migrated away, shut down), XML we
                # cannot read, a virsh that hangs, statistics that cannot be
                # right: leave it out of this cycle, not the others.  Any
                # exception, as in ThinvmBackend._each_vm.
                self._virtio_mem.pop(dom.name, None)
                self._errors.append(f"{dom.name}: not sampled: {describe_error(exc)}")
        return samples

    def sample_errors(self) -> list[str]:
        errors, self._errors = self._errors, []
        return errors

    def _sample_one(self, dom: DomainStats, now: float) -> VmSample:
        if dom.name not in self._period_set:
            with contextlib.suppress(ThinvmError):
                period = str(self.stats_period)
                self._virsh("dommemstat", dom.name, "--period", period, "--live")
            self._period_set.add(dom.name)
        try:
            migrating = migrating_from_jobinfo(self._virsh("domjobinfo", dom.name))
        except ThinvmError:
            migrating = False
        xml = self._virsh("dumpxml", dom.name)
        vmem = parse_virtio_mem(xml)
        if vmem is None:
            self._virtio_mem.pop(dom.name, None)
        else:
            self._virtio_mem[dom.name] = vmem
        device = vmem.device if vmem else None
        backing, identity = parse_backing(xml), domain_identity(xml)
        sample = domain_sample(dom, now, migrating, device, backing=backing, identity=identity)
        reporting = parse_reporting(xml)
        agent = self._agent(dom.name, xml)
        # As with thinvm's VMs: without reporting what the reclaimer frees
        # stays with the guest, so the agent is left alone.
        reclaimer = self.reclaimers.reclaimer(dom.name, agent) if agent and reporting else None
        stats = sample.stats
        if agent is not None and stats is not None and not stats.counters():
            stats = stats.with_stress(self._stress_of(dom.name, agent))
        return replace(sample, reporting=reporting, reclaimer=reclaimer, stats=stats)

    def _stress_of(self, name: str, agent: AgentClient) -> dict[str, int]:
        """The guest's stall and reclaim counters through its agent, which
        libvirt does not pass on (Linux 6.12 balloon statistics); none if
        the agent is busy or cannot answer, the balloon's alone then."""
        try:
            text = agent.check(VMSTAT_COMMAND, timeout=AGENT_STATS_TIMEOUT).stdout
            return stress_from_vmstat(parse_vmstat(text))
        except BadGuestData as exc:
            self._errors.append(f"{name}: {exc}")
        except (ThinvmError, OSError):
            pass  # busy with a trim, or restarting: the next cycle asks again
        return {}

    def _agent(self, name: str, xml: str) -> AgentClient | None:
        """A client of the domain's agent channel, None without one.  A new
        socket path (libvirt's per domain id) is a new run of the domain:
        what its reclaimer said before does not hold."""
        path = libvirt_agent_socket(xml)
        if path is None:
            self._drop_agent(name)
            return None
        seen = str(self.outside(path))
        if not Path(seen).exists():
            # Not there (yet): the domain is starting, or this controller
            # does not see the host's paths (outside).  The balloon only.
            self._drop_agent(name)
            return None
        client = self._agents.get(name)
        if client is None or client.path != seen:
            self._drop_agent(name)
            client = AgentClient(seen, lock=channel_lock(seen))
            self._agents[name] = client
        return client

    def _drop_agent(self, name: str) -> None:
        client = self._agents.pop(name, None)
        if client is not None:
            client.close()
        self.reclaimers.forget(name)

    def _agent_of(self, vm: str) -> AgentClient:
        client = self._agents.get(vm)
        if client is None:
            raise ThinvmError(f"{vm}: no {AGENT_PORT} channel in its domain XML (thinvm fleet xml)")
        return client

    def rss(self) -> int:
        """The host RSS of the domains managed (libvirt's `balloon.rss`)."""
        return sum(dom.values.get("balloon.rss", 0) for dom in self._domains()) * KiB

    def set_target(self, vm: str, target: int) -> None:
        """virtio-mem's `requested-size` where the domain has the device (its
        balloon then gives all the base memory back), else the balloon."""
        vmem = self._virtio_mem.get(vm)
        if vmem is None:
            self._setmem(vm, target)
            return
        requested = vmem.device.requested_for(target)
        self._virsh(
            "update-memory-device", vm, "--alias", vmem.alias,
            "--requested-size", str(requested // KiB), "--live",
        )  # fmt: skip
        if vmem.balloon < vmem.device.base:
            self._setmem(vm, vmem.device.base)

    def _setmem(self, vm: str, size: int) -> None:
        self._virsh("setmem", vm, str(size // KiB), "--live")  # KiB

    def set_reclaim(self, vm: str, on: bool) -> None:
        self.reclaimers.set_background(vm, self._agent_of(vm), on)

    def trim(self, vm: str, max_bytes: int) -> bool:
        return self.reclaimers.trim(vm, self._agent_of(vm), max_bytes)

    def close(self) -> None:
        self.reclaimers.close()
        for name in list(self._agents):
            self._drop_agent(name)
