"""Launching and owning QEMU processes.

Every QEMU process is owned by a VM object.  An owned VM dies with its
owner: on close(), on a Python exception, at interpreter exit, on SIGTERM
(the CLI turns it into SystemExit) and, if Python itself is killed, by
PR_SET_PDEATHSIG.  Only `thinvm up` starts detached VMs, which outlive the
CLI and are stopped by `thinvm down`.
"""

import atexit
import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.guest.agent import AGENT_PORT, AgentClient
from thinvm.guest.image import (
    GuestImage,
    create_overlay,
    ensure_disk_image,
    ensure_image,
    guest_info,
)
from thinvm.host.locks import FileLock
from thinvm.host.memory import HostMemory, host_meminfo, process_memory
from thinvm.paths import cache_dir, write_json_atomic
from thinvm.pool import lease as pool_lease
from thinvm.pool.model import PoolEmpty
from thinvm.qemu import accel as accel_mod
from thinvm.qemu.builds import QemuBuild, find_build
from thinvm.qemu.monitor import Monitor
from thinvm.units import GiB, MiB, format_size

# The range balloon stays experimental in QEMU ("x-") until the virtio
# specification reserves its feature bit.
BALLOON_RANGES_PROPERTY = "x-ranges"
UNIX_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux
# QEMU's QMP monitors serve one client each, so a VM has several: the
# owner or a CLI command, the balance controller, and two more for
# commands that overlap (a `status` during a `migrate`).  A client takes a
# free one under a lock file (see Monitors in docs/protocol/agent.md).
QMP_MONITORS = 4
QMP_CONNECT_TIMEOUT = 10.0
# The virtio-mem device and its memory backend (docs/resize.md).  2 MiB
# blocks: QEMU's default on x86-64 (one THP), and the sub-block size
# Debian's 6.1 and 6.12 plug and unplug inside their 128 MiB memory blocks.
VIRTIO_MEM_ID = "vmem0dev"
VIRTIO_MEM_BACKEND_ID = "vmem0"
VIRTIO_MEM_BLOCK_SIZE = 2 * MiB
# Memory a guest hotplugs is onlined by its kernel, not by user space (the
# busybox guest has no udev), and into ZONE_MOVABLE, so that it can be
# unplugged again: Debian's 6.1 leaves hotplugged memory offline by default.
VIRTIO_MEM_KERNEL_ARGS = "memhp_default_state=online_movable"
MIN_MEMORY = 256 * MiB
# Guest images (VMConfig.image): the busybox initramfs (guest/image/build.sh)
# and the Debian 12 disk image (guest/image/build-disk.sh), whose balloon
# driver is ours (DKMS) unless the in-tree one is asked for.
GUEST_IMAGES = ("initramfs", "disk")
DISK_DRIVERS = ("thinvm", "stock")
DISK_FILE = "disk.qcow2"  # a disk guest's overlay, in its run directory
# A disk guest on the in-tree driver never loads ours: a swap after boot
# costs a module load and unload per run, and before our driver packed its
# queue list (guest/balloon, 2026-11-25) that rmmod died on 6.12.
NO_THINVM_DRIVER = "module_blacklist=thinvm_balloon"
INTREE_DRIVER = 'insmod "$(modinfo -F filename virtio_balloon)"'
PR_SET_PDEATHSIG = 1


# TCG's most capable CPU, without the two flags that make Linux move
# memory with byte-wise "rep movsb/stosb" (ERMS, FSRM): TCG runs those one
# byte per iteration, and every page a Debian kernel allocates is zeroed
# (init_on_alloc).  Filling 1 GiB of tmpfs in a guest cost 14-18 s of QEMU
# CPU with them and 5.7-9.1 s without.  Under KVM the host's CPU is used.
TCG_CPU_FEATURES_OFF = ("erms", "fsrm")
TCG_CPU = ",".join(["max", *(f"{flag}=off" for flag in TCG_CPU_FEATURES_OFF)])

# Every guest's console and timer arguments.  no_timer_check: the IO-APIC
# timer check counts ticks in a short delay loop; a vCPU of a loaded host
# can see none and panic ("IO-APIC + timer doesn't work!", seen in our CI
# under TCG, as OpenStack's and CirrOS' CIs did).  The disk image's own
# command line carries the same (guest/image/build-disk.sh).
GUEST_CONSOLE_ARGS = "console=ttyS0 no_timer_check"

# q35 without its HPET, as Nova and systemd's vmspawn start guests.  Linux
# uses the HPET only until the local APIC timer takes over, and then
# disables its interrupt but leaves the comparator periodic: QEMU keeps
# firing it at the guest's HZ in the main loop.  An idle 1 GiB busybox
# guest cost its QEMU 4.1-5.4% of a host CPU with the HPET and 0.5-0.7%
# without it, a Debian one 5.5-5.9% and 0.9-1.3% (TCG, 2026-11-27,
# docs/architecture.md): CPU a host of idle guests gets back.
MACHINE = "q35,hpet=off"


@dataclass
class BalloonOptions:
    """virtio-balloon-pci properties; enabled=False means no balloon device."""

    enabled: bool = True
    deflate_on_oom: bool = False
    free_page_hint: bool = False
    free_page_reporting: bool = False
    ranges: bool = False  # VIRTIO_BALLOON_F_RANGES (patched QEMU only)


@dataclass
class VMConfig:
    """Everything that decides how a guest is launched."""

    name: str = "thinvm"
    build: str = "stock"
    memory: int = 2 * GiB
    cpus: int = 1
    accel: str = "auto"
    kernel: str = "6.1"
    guest_driver: str = "stock"
    backend: str = "ram"
    prealloc: bool = False
    prealloc_threads: int = 1
    reserve: bool = True
    balloon: BalloonOptions = field(default_factory=BalloonOptions)
    append: str = ""
    extra_args: list[str] = field(default_factory=list)
    boot_timeout: float = 120.0
    # A memory cgroup directory (v1 or v2) QEMU runs in from its first
    # instruction, so every page it ever touches is charged there.
    memory_cgroup: str | None = None
    # The CPUs QEMU runs on, every thread of it (its affinity, set before
    # exec, is inherited); empty: any.  A benchmark puts the source and the
    # destination of a migration on CPUs of their own, as two hosts would.
    host_cpus: list[int] = field(default_factory=list)
    # A warm pool directory (thinvm.pool): RAM comes from one of its
    # pre-zeroed slots, or, when none fits, is preallocated as usual.
    pool: str | None = None
    # virtio-mem (docs/resize.md): how much memory the guest can grow by
    # beyond `memory` (0: no device), and how much of it is plugged at start.
    virtio_mem: int = 0
    virtio_mem_plugged: int = 0
    # What boots: "initramfs" (root on tmpfs) or "disk", the Debian disk
    # image, root on a qcow2 overlay of it (GUEST_IMAGES).
    image: str = "initramfs"
    # A disk guest's overlay: None makes a new one in the run directory,
    # removed with it.  The destination of a migration opens its source's
    # (VM.incoming_config), as on shared storage.
    disk: str | None = None

    @property
    def max_memory(self) -> int:
        """What the guest can have at most: base memory plus all of virtio-mem."""
        return self.memory + self.virtio_mem

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "VMConfig":
        data = dict(data)
        data["balloon"] = BalloonOptions(**data.get("balloon", {}))
        return cls(**data)


def check_virtio_mem(config: VMConfig) -> None:
    """Refuse a virtio-mem configuration QEMU would refuse less clearly."""
    if config.virtio_mem == 0:
        if config.virtio_mem_plugged:
            raise ThinvmError("--virtio-mem-plugged needs --virtio-mem SIZE")
        return
    block = VIRTIO_MEM_BLOCK_SIZE
    if config.virtio_mem < 0 or config.virtio_mem % block:
        raise ThinvmError(
            f"--virtio-mem {format_size(config.virtio_mem)} is not a positive multiple "
            f"of the {format_size(block)} block size"
        )
    if not 0 <= config.virtio_mem_plugged <= config.virtio_mem or config.virtio_mem_plugged % block:
        raise ThinvmError(
            f"--virtio-mem-plugged {format_size(config.virtio_mem_plugged)} must be a multiple "
            f"of {format_size(block)} between 0 and --virtio-mem {format_size(config.virtio_mem)}"
        )
    if config.backend not in ("ram", "memfd") or config.pool is not None:
        raise ThinvmError(
            "--virtio-mem needs guest RAM from --backend ram or memfd: thinvm backs the "
            "device like the RAM, and has no file-backed or warm pool virtio-mem"
        )


def check_memory_fits(config: VMConfig, pooled: bool = False) -> None:
    """Refuse guest sizes this host cannot back, before QEMU fails obscurely.

    `pooled`: the RAM is a warm pool slot, allocated already.
    """
    if config.memory < MIN_MEMORY:
        raise ThinvmError(
            f"guest memory {format_size(config.memory)} is too small: "
            f"the guest kernel needs at least {format_size(MIN_MEMORY)}"
        )
    meminfo = host_meminfo()
    prealloc = (config.prealloc or config.pool is not None) and not pooled
    if prealloc and config.memory > meminfo["MemAvailable"]:
        raise ThinvmError(
            f"cannot preallocate {format_size(config.memory)}: the host has only "
            f"{format_size(meminfo['MemAvailable'])} available; pass a smaller --memory"
        )
    # Untouched guest RAM costs nothing, but with reserve=on the kernel's
    # overcommit heuristic refuses a mapping larger than RAM + swap.
    limit = meminfo["MemTotal"] + meminfo.get("SwapTotal", 0)
    if config.reserve and config.max_memory > limit:
        raise ThinvmError(
            f"guest memory {format_size(config.max_memory)} cannot fit in this host's "
            f"{format_size(limit)} of RAM+swap: pass a smaller --memory, or --no-reserve "
            "to overcommit memory the guest will not touch"
        )


@functools.cache
def disk_image(kernel: str) -> tuple[GuestImage, Path]:
    """The Debian disk image's kernel and initrd, and its base disk, where
    guest/image/build-disk.sh caches them (built if missing or stale)."""
    # "Installed" in its own cache directory: nothing is copied.
    image = ensure_disk_image(kernel, cache_dir() / "disk")
    meta = {"kernel_version": image.kernel_version, "cmdline": image.cmdline}
    return GuestImage(image.vmlinuz, image.initrd, meta), image.disk


def _child_setup(die_with_parent: bool, cgroup: str | None, host_cpus: Sequence[int] = ()) -> None:
    """preexec_fn: join the cgroup; run on `host_cpus`; die if the Python process dies."""
    if cgroup is not None:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    if host_cpus:
        os.sched_setaffinity(0, host_cpus)
    if die_with_parent:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


_owned: set["VM"] = set()


def _close_all_owned() -> None:
    for vm in list(_owned):
        vm.kill()


atexit.register(_close_all_owned)


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so owners' cleanup runs (CLI only)."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


class VM:
    """One QEMU process with its QMP monitor and guest agent."""

    def __init__(
        self,
        config: VMConfig,
        *,
        incoming: bool = False,
        rundir: Path | None = None,
        detached: bool = False,
    ) -> None:
        self.config = config
        self.incoming = incoming
        self.detached = detached
        self._own_rundir = rundir is None
        self.rundir = rundir or Path(tempfile.mkdtemp(prefix=f"thinvm-{config.name}-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.monitor: Monitor | None = None
        self._monitor_lock: FileLock | None = None
        # A detached VM has other clients (CLI commands, the controller):
        # they take turns on its agent, one request at a time.
        agent_lock = self.rundir / "agent.lock" if detached else None
        self.agent = AgentClient(str(self.agent_socket), lock=agent_lock)
        self.build: QemuBuild | None = None
        self.image: GuestImage | None = None
        # A disk guest's root disk (VMConfig.disk, or the overlay it made).
        self.disk: Path | None = None
        self._intree_driver = False  # a disk guest swapped to virtio_balloon
        self.accel: str | None = None
        self.boot_seconds: float | None = None
        self.pool_lease: pool_lease.Lease | None = None
        self.pool_note = ""  # why a VM with config.pool got no slot
        # A balloon target an operator set with `thinvm balloon`: the
        # controller leaves the VM there until `thinvm balloon NAME auto`.
        self.operator_target: int | None = None

    # -- paths -------------------------------------------------------------
    @property
    def qmp_socket(self) -> Path:
        """The first QMP monitor's socket, the one the VM's owner uses."""
        return self.rundir / "qmp.sock"

    @property
    def qmp_sockets(self) -> list[Path]:
        """Every QMP monitor's socket: qmp.sock, qmp-1.sock, ..."""
        extra = [self.rundir / f"qmp-{i}.sock" for i in range(1, QMP_MONITORS)]
        return [self.qmp_socket, *extra]

    @property
    def agent_socket(self) -> Path:
        return self.rundir / "agent.sock"

    @property
    def serial_log(self) -> Path:
        return self.rundir / "serial.log"

    @property
    def qemu_log(self) -> Path:
        return self.rundir / "qemu.log"

    # -- command line ------------------------------------------------------
    def _memory_backend_args(self) -> list[str]:
        cfg = self.config
        backend, prealloc = cfg.backend, cfg.prealloc
        if self.pool_lease is not None:
            # Pre-zeroed and populated: preallocation only maps the pages.
            backend, prealloc = f"file:{self.pool_lease.path}", True
        elif cfg.pool is not None:
            prealloc = True  # no slot fits: preallocate as without the pool
        props = [f"id=mem0,size={cfg.memory}"]
        if backend == "ram":
            kind = "memory-backend-ram"
        elif backend == "memfd":
            kind = "memory-backend-memfd"
        elif backend.startswith("file:"):
            kind = "memory-backend-file"
            props.append(f"mem-path={backend[5:]},share=on")
        else:
            raise ThinvmError(f"unknown memory backend {backend!r}: use ram, memfd or file:PATH")
        if prealloc:
            props.append(f"prealloc=on,prealloc-threads={cfg.prealloc_threads}")
        if not cfg.reserve:
            props.append("reserve=off")
        return ["-object", f"{kind}," + ",".join(props)]

    def _memory_size_args(self) -> list[str]:
        """-m: base memory, and with virtio-mem room above it up to maxmem."""
        cfg = self.config
        size = f"{cfg.memory // MiB}M"
        if cfg.virtio_mem:
            size += f",maxmem={cfg.max_memory // MiB}M"
        return ["-m", size]

    def _virtio_mem_args(self) -> list[str]:
        cfg = self.config
        if not cfg.virtio_mem:
            return []
        kind = "memory-backend-memfd" if cfg.backend == "memfd" else "memory-backend-ram"
        backend = [f"id={VIRTIO_MEM_BACKEND_ID},size={cfg.virtio_mem}"]
        if not cfg.reserve:
            backend.append("reserve=off")
        device = [
            "virtio-mem-pci",
            f"id={VIRTIO_MEM_ID}",
            f"memdev={VIRTIO_MEM_BACKEND_ID}",
            f"block-size={VIRTIO_MEM_BLOCK_SIZE // MiB}M",
            f"requested-size={cfg.virtio_mem_plugged}",
        ]
        # QEMU refuses a preallocated backend here (virtio-mem would discard
        # it all at once): the device preallocates each block it plugs.
        if cfg.prealloc:
            device.append("prealloc=on")
        return ["-object", f"{kind}," + ",".join(backend), "-device", ",".join(device)]

    def _balloon_args(self) -> list[str]:
        opts = self.config.balloon
        if not opts.enabled:
            return []
        props = ["virtio-balloon-pci", "id=balloon0"]
        args: list[str] = []
        if opts.deflate_on_oom:
            props.append("deflate-on-oom=on")
        if opts.free_page_hint:
            # Hinting runs in its own iothread so it does not stall the vCPUs.
            args += ["-object", "iothread,id=balloon-iothread"]
            props += ["free-page-hint=on", "iothread=balloon-iothread"]
        if opts.free_page_reporting:
            props.append("free-page-reporting=on")
        if opts.ranges:
            props.append(f"{BALLOON_RANGES_PROPERTY}=on")
        return [*args, "-device", ",".join(props)]

    def _accel_args(self) -> list[str]:
        assert self.accel is not None
        if self.accel == "kvm":
            return ["-accel", "kvm", "-cpu", "host"]
        # A bounded translation cache keeps TCG's own RSS small and steady,
        # so host-RSS assertions measure guest memory, not the JIT.
        return ["-accel", "tcg,tb-size=256", "-cpu", TCG_CPU]

    def _qmp_args(self) -> list[str]:
        args: list[str] = []
        for sock in self.qmp_sockets:
            args += ["-qmp", f"unix:{sock},server=on,wait=off"]
        return args

    def _boot_args(self) -> list[str]:
        """Kernel, initrd and command line; a disk guest's root disk."""
        assert self.image is not None
        cfg = self.config
        base = GUEST_CONSOLE_ARGS
        drive: list[str] = []
        if self.disk is not None:
            base = str(self.image.meta["cmdline"])  # root=/dev/vda rw console=ttyS0 ...
            if cfg.guest_driver == "stock":
                base += f" {NO_THINVM_DRIVER}"
            # The first virtio disk (vda).  Default cache mode: both ends of
            # a migration run on this host and share its page cache.
            drive = ["-drive", f"file={self.disk},if=virtio,format=qcow2,discard=unmap"]
        hotplug = VIRTIO_MEM_KERNEL_ARGS if cfg.virtio_mem else ""
        # Leading arguments go before the config's own, so that those win.
        append = " ".join(
            a for a in (base, "panic=-1", hotplug, self._leading_append(), cfg.append) if a
        )
        kernel = ["-kernel", str(self._kernel()), "-initrd", str(self.image.initrd)]
        return [*kernel, "-append", append, *drive]

    # What a guest boots: the image's kernel and arguments.  The test suite's
    # guests boot otherwise (thinvm.testing.keptboot.KeptBootVM).
    def _kernel(self) -> Path:
        """The kernel QEMU boots: the image's bzImage."""
        assert self.image is not None
        return self.image.kernel

    def _leading_append(self) -> str:
        """Kernel arguments before the config's own (VMConfig.append wins)."""
        return ""

    def command_line(self) -> list[str]:
        """QEMU's arguments."""
        assert self.build is not None and self.image is not None
        cfg = self.config
        args = [
            str(self.build.binary),
            "-name",
            f"thinvm-{cfg.name}",
            "-machine",
            f"{MACHINE},memory-backend=mem0",
            *self._accel_args(),
            "-smp",
            str(cfg.cpus),
            *self._memory_size_args(),
            *self._memory_backend_args(),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            *self._boot_args(),
            "-serial",
            f"file:{self.serial_log}",
            *self._qmp_args(),
            "-device",
            "virtio-serial-pci,id=vser0",
            "-chardev",
            f"socket,id=agent0,path={self.agent_socket},server=on,wait=off",
            "-device",
            f"virtserialport,chardev=agent0,name={AGENT_PORT}",
            *self._balloon_args(),
            *self._virtio_mem_args(),
            "-pidfile",
            str(self.rundir / "qemu.pid"),
        ]
        if self.incoming:
            args += ["-incoming", "defer"]
        return [*args, *cfg.extra_args]

    # -- lifecycle ---------------------------------------------------------
    def _resolve(self) -> None:
        check_virtio_mem(self.config)
        self._take_pool_slot()
        try:
            check_memory_fits(self.config, pooled=self.pool_lease is not None)
            self.build = find_build(self.config.build)
            self.image = self._guest_image()
            self.accel = accel_mod.resolve(self.config.accel, self.build)
        except BaseException:
            self._return_pool_slot()
            raise

    def _guest_image(self) -> GuestImage:
        cfg = self.config
        if cfg.image == "initramfs":
            return ensure_image(cfg.kernel, cfg.guest_driver)
        if cfg.image != "disk":
            choices = " or ".join(GUEST_IMAGES)
            raise ThinvmError(f"unknown guest image {cfg.image!r}: choose {choices}")
        if cfg.guest_driver not in DISK_DRIVERS:
            raise ThinvmError(
                f"guest driver {cfg.guest_driver!r}: the Debian disk image runs ours "
                "(thinvm) or the in-tree one (stock)"
            )
        image, base = disk_image(cfg.kernel)
        self.disk = self._root_disk(base)
        return image

    def _root_disk(self, base: Path) -> Path:
        """The disk guest's overlay: the configured one, or a new one on `base`."""
        if self.config.disk is not None:
            disk = Path(self.config.disk)
            if not disk.is_file():
                raise ThinvmError(f"guest disk {disk} does not exist")
            return disk
        if self.incoming:
            raise ThinvmError(
                "the destination of a disk guest's migration opens its source's disk: "
                "start it with the source's incoming_config()"
            )
        disk = self.rundir / DISK_FILE
        create_overlay(base, disk)
        return disk

    def incoming_config(self) -> VMConfig:
        """The configuration of this VM's migration destination: the same,
        on the same root disk (a disk guest's overlay is shared storage)."""
        if self.disk is None:
            return self.config
        return replace(self.config, disk=str(self.disk))

    def _take_pool_slot(self) -> None:
        if self.config.pool is None or self.pool_lease is not None:
            return
        try:
            self.pool_lease = pool_lease.acquire(
                self.config.pool, self.config.memory, self.config.name
            )
        except PoolEmpty as exc:
            self.pool_note = f"{exc}: preallocating anonymous RAM instead"

    def _return_pool_slot(self) -> None:
        """QEMU is gone: its slot is scrubbed before anyone gets it again.

        Nothing to return without a lease or a QEMU that may hold one (no
        slot was taken): the pool is not touched, nor warned about.
        """
        if self.config.pool is not None and (self.pool_lease is not None or self.pid is not None):
            pool_lease.release_vm(self.config.pool, self.pool_lease, self.pid)
            self.pool_lease = None

    def _spawn(self) -> None:
        outside = set(self.config.host_cpus) - os.sched_getaffinity(0)
        if outside:
            raise ThinvmError(
                f"cannot run {self.config.name} on CPUs {sorted(outside)}: this process "
                f"may use {sorted(os.sched_getaffinity(0))} only"
            )
        log = open(self.qemu_log, "wb")  # noqa: SIM115 - handed to the child
        try:
            self.process = subprocess.Popen(
                self.command_line(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(
                    _child_setup,
                    not self.detached,
                    self.config.memory_cgroup,
                    self.config.host_cpus,
                ),
            )
        finally:
            log.close()
        self.pid = self.process.pid
        if not self.detached:
            _owned.add(self)
        if self.pool_lease is not None:
            self.pool_lease.bind(self.pid)

    def _qemu_output_tail(self) -> str:
        try:
            return self.qemu_log.read_text(errors="replace").strip()[-800:]
        except OSError:
            return ""

    def _qmp_timeout(self) -> float:
        """QEMU answers QMP only after preallocating RAM: allow for it."""
        base = 15.0
        if self.config.prealloc or self.config.pool is not None:
            base += 2.0 * self.config.memory / GiB  # at least 0.5 GiB/s
        return base

    def _wait_for_qmp(self) -> None:
        timeout = self._qmp_timeout()
        deadline = time.monotonic() + timeout
        # A new QEMU: nobody else knows its monitors yet.
        lock = FileLock(_monitor_lock_path(self.qmp_socket))
        if not lock.try_acquire():
            raise ThinvmError(f"{lock.path} is locked by another process: is the VM running?")
        self._monitor_lock = lock
        while True:
            if not self.alive():
                raise ThinvmError(f"QEMU exited at start: {self._qemu_output_tail()}")
            if self.qmp_socket.exists():
                monitor = Monitor(f"thinvm-{self.config.name}")
                try:
                    monitor.connect(str(self.qmp_socket), max(1.0, deadline - time.monotonic()))
                    self.monitor = monitor
                    return
                except ThinvmError:
                    # The socket file exists before QEMU listens on it: retry.
                    monitor.close()
            if time.monotonic() > deadline:
                raise ThinvmError(f"QEMU did not answer on QMP within {timeout:.0f} s")
            time.sleep(0.05)

    def check_socket_paths(self) -> None:
        """QEMU would fail late, and cryptically, on a socket path that does
        not fit in a UNIX socket address (sun_path, 108 bytes with its NUL)."""
        for sock in (*self.qmp_sockets, self.agent_socket):
            size = len(os.fsencode(sock))
            if size >= UNIX_PATH_MAX:
                raise ThinvmError(
                    f"socket path {sock} is {size} bytes, a UNIX socket takes at most "
                    f"{UNIX_PATH_MAX - 1}: set THINVM_RUN (or THINVM_CACHE) to a shorter directory"
                )

    def start(self, wait_agent: bool = True) -> "VM":
        """Launch QEMU; unless incoming, wait until the guest agent answers."""
        self.check_socket_paths()
        self.rundir.mkdir(parents=True, exist_ok=True)
        self._resolve()
        started = time.monotonic()
        try:
            self._boot(wait_agent)
        except BaseException:
            self.kill()
            raise
        if wait_agent and not self.incoming:
            self.boot_seconds = time.monotonic() - started
        return self

    def _boot(self, wait_agent: bool) -> None:
        """Run QEMU until it answers on QMP and, if `wait_agent` and not
        incoming, until the guest's agent does."""
        self._spawn()
        self._wait_for_qmp()
        if wait_agent and not self.incoming:
            self.wait_agent()

    def _serial_tail(self, lines: int = 15) -> str:
        try:
            text = self.serial_log.read_text(errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(empty)"

    def wait_agent(self, timeout: float | None = None) -> float:
        timeout = timeout or self.config.boot_timeout
        try:
            waited = self.agent.wait_ready(timeout)
        except ThinvmError as exc:
            # The log goes with the VM's directory: say how far it got.
            raise ThinvmError(
                f"{exc}; serial log: {self.serial_log}, ending:\n{self._serial_tail()}"
            ) from exc
        cfg = self.config
        if self.disk and cfg.guest_driver == "stock" and not (self.incoming or self._intree_driver):
            # Booted without a balloon driver (NO_THINVM_DRIVER); the package
            # blacklists the in-tree one for modprobe, so it goes in by file.
            # A migration's destination gets the guest with its driver.
            self.agent.check(INTREE_DRIVER)
            driver = guest_info(self.agent).get("balloon_driver")
            if driver != "virtio_balloon":
                raise ThinvmError(f"the in-tree balloon driver did not take the device ({driver})")
            self._intree_driver = True
        return waited

    def qmp(self, command: str, **args: Any) -> Any:
        if self.monitor is None:
            raise ThinvmError(f"VM {self.config.name} is not running")
        return self.monitor.cmd(command, **args)

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and _pid_alive(self.pid)

    def host_memory(self) -> HostMemory:
        assert self.pid is not None
        return process_memory(self.pid)

    def disconnect(self) -> None:
        """Close our QMP and agent connections; QEMU keeps running."""
        self.agent.close()
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self._monitor_lock is not None:
            self._monitor_lock.release()
            self._monitor_lock = None

    def connect_monitor(self, timeout: float = QMP_CONNECT_TIMEOUT) -> None:
        """Connect to a QMP monitor of the VM that no other client holds.

        Waits up to `timeout` for one to come free.  A monitor whose socket
        does not answer is skipped; if none answers, the first error is
        raised (`thinvm down` then kills the QEMU by pid).
        """
        deadline = time.monotonic() + timeout
        errors: list[ThinvmError] = []
        while True:
            for sock in self.qmp_sockets:
                lock = FileLock(_monitor_lock_path(sock))
                if not lock.try_acquire():
                    continue
                monitor = Monitor(f"thinvm-{self.config.name}")
                try:
                    monitor.connect(str(sock), max(1.0, deadline - time.monotonic()))
                except ThinvmError as exc:
                    monitor.close()
                    lock.release()
                    errors.append(exc)
                    continue
                self.monitor, self._monitor_lock = monitor, lock
                return
            if errors:
                raise errors[0]
            if time.monotonic() >= deadline:
                raise ThinvmError(
                    f"all {QMP_MONITORS} QMP monitors of VM {self.config.name!r} stayed in use "
                    f"for {timeout:.0f} s: retry when one of the other commands is done"
                )
            time.sleep(0.1)

    def kill(self) -> None:
        """Stop QEMU now and release everything (idempotent)."""
        _owned.discard(self)
        self.disconnect()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        elif self.pid is not None and _pid_alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
            _wait_pid_gone(self.pid, 5.0)
        self._return_pool_slot()
        if self._own_rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask QEMU to quit, then make sure it is gone."""
        if self.monitor is not None and self.alive():
            with contextlib.suppress(ThinvmError, OSError, TimeoutError):
                self.monitor.cmd("quit", timeout=timeout)
            if self.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout)
            elif self.pid is not None:
                # Not our child (thinvm up): wait all the same.  A QEMU
                # that quits removes its sockets and pid file by path on
                # the way out, and after a migration those paths may
                # already belong to the QEMU that took over the VM.
                _wait_pid_gone(self.pid, timeout)
        self.kill()

    def __enter__(self) -> "VM":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # -- detached VMs (thinvm up/down) -------------------------------------
    def save_state(self) -> None:
        """Write state.json whole or not at all: other clients read it any time."""
        state = {
            "config": self.config.to_json(),
            "pid": self.pid,
            "accel": self.accel,
            "build": self.config.build,
            "operator_target": self.operator_target,
        }
        write_json_atomic(self.rundir / "state.json", state)

    @classmethod
    def attach(cls, rundir: Path, monitor: bool = True) -> "VM":
        """Reconnect to a detached VM started by `thinvm up`.

        monitor=False: no QMP monitor, for a client that needs only the
        agent (it takes its turns there, and leaves the monitors to others).
        """
        state = read_state_file(rundir)
        vm = cls(VMConfig.from_json(state["config"]), rundir=rundir, detached=True)
        vm.pid = int(state["pid"])
        vm.accel = state.get("accel")
        vm.operator_target = state.get("operator_target")
        if not vm.alive():
            raise ThinvmError(
                f"VM {rundir.name!r} is not running any more (pid {vm.pid}); "
                f"see {vm.serial_log}, then 'thinvm down {rundir.name}'"
            )
        if monitor:
            vm.connect_monitor()
        return vm


def _monitor_lock_path(sock: Path) -> Path:
    return sock.with_suffix(".lock")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class UnreadableState(ThinvmError):
    """A detached VM's state.json exists but cannot be used: not JSON, or
    without a pid and config thinvm can read."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        name = path.parent.name
        super().__init__(
            f"VM {name!r} has an unreadable state file {path} ({reason}): "
            f"'thinvm down {name}' stops its QEMU and removes it"
        )


def read_state_file(rundir: Path) -> dict[str, Any]:
    """A detached VM's state.json, checked: a pid and a config VMConfig takes.

    Raises ThinvmError if there is none, UnreadableState if it is there
    but cannot be used (a partial write by an older thinvm, an edit, a
    disk error), so that no caller meets a JSON or KeyError traceback.
    """
    path = rundir / "state.json"
    if not path.exists():
        raise ThinvmError(f"no VM named {rundir.name!r}: start one with 'thinvm up'")
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        int(state["pid"])
        VMConfig.from_json(state["config"])
    except KeyError as exc:
        raise UnreadableState(path, f"no {exc} in it") from exc
    except (OSError, ValueError, TypeError) as exc:
        raise UnreadableState(path, str(exc) or type(exc).__name__) from exc
    return state


def kill_unreachable(rundir: Path) -> int | None:
    """Kill the QEMU of a detached VM that can no longer be reached over QMP.

    The QEMU is found by the pid in the VM's state file, else by the pid
    file QEMU wrote in the run directory, else as the process listening
    on one of its QMP sockets (its peer credentials), so that a VM whose
    state file is unreadable can still be stopped.  A pid is killed only
    if it runs a QEMU for this VM, so a reused pid is left alone.
    Returns the pid killed, or None.
    """
    for pid in _qemu_pid_candidates(rundir):
        if _is_qemu_of(pid, rundir.name):
            os.kill(pid, signal.SIGKILL)
            _wait_pid_gone(pid, 5.0)
            return pid
    return None


def _qemu_pid_candidates(rundir: Path) -> Iterator[int]:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        yield int(json.loads((rundir / "state.json").read_text())["pid"])
    with contextlib.suppress(OSError, ValueError):
        yield int((rundir / "qemu.pid").read_text().strip())
    for sock in sorted(rundir.glob("qmp*.sock")):
        if (pid := _listener_pid(sock)) is not None:
            yield pid


def _listener_pid(sock: Path) -> int | None:
    """The pid of the process listening on UNIX socket `sock` (SO_PEERCRED
    of a connection: the listener's credentials, even before it accepts)."""
    creds = struct.Struct("3i")  # struct ucred: pid, uid, gid
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(str(sock))
            pid, _uid, _gid = creds.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size)
            )
    except OSError:
        return None
    return pid if pid > 0 else None


def _is_qemu_of(pid: int, name: str) -> bool:
    """Whether `pid` runs a QEMU that thinvm started for VM `name` (-name thinvm-NAME)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"-name" in cmdline and f"thinvm-{name}".encode() in cmdline


def _wait_pid_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
