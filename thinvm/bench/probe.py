"""Host-side probes for benchmarks: syscall counters, network namespaces,
memory cgroups.

SyscallCounter counts the madvise and fallocate calls QEMU makes while a
block runs; that is how many discard requests the host kernel got.  Two
backends:

- perf: `perf stat` on the kernel's syscall tracepoints, counted in the
  kernel.  Costs almost nothing, and can tell MADV_DONTNEED from
  MADV_WILLNEED.  The default where the tracepoints exist.
- strace: `strace -f -c -p PID`.  Works everywhere, but ptrace stops the
  traced process on every system call, which slows QEMU down a lot (a
  balloon inflation by ~3x), so do not time the same run.
"""

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from thinvm.errors import ThinvmError

COUNTERS = ("auto", "perf", "strace")
ATTACH_SECONDS = 0.3

# madvise advice values that drop memory (asm-generic/mman-common.h).
MADV_DONTNEED = 4
MADV_FREE = 8
MADV_REMOVE = 9
_DISCARD_FILTER = f"behavior == {MADV_DONTNEED} || behavior == {MADV_FREE} || " + (
    f"behavior == {MADV_REMOVE}"
)
# perf prints one line per event, in the order given on its command line.
_PERF_EVENTS = (
    ("madvise_discard", "syscalls:sys_enter_madvise", _DISCARD_FILTER),
    ("madvise", "syscalls:sys_enter_madvise", None),
    ("fallocate", "syscalls:sys_enter_fallocate", None),
)


@functools.cache
def _perf_works() -> bool:
    if shutil.which("perf") is None:
        return False
    proc = subprocess.run(
        ["perf", "stat", "-x,", "-e", "syscalls:sys_enter_madvise", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode == 0


def counter_backend(requested: str = "auto") -> str:
    """Resolve 'auto' to perf (tracepoints) or strace; check the tool exists."""
    if requested not in COUNTERS:
        raise ThinvmError(f"unknown counter {requested!r}: choose one of {', '.join(COUNTERS)}")
    if requested in ("auto", "perf") and _perf_works():
        return "perf"
    if requested == "perf":
        raise ThinvmError(
            "perf cannot count syscalls:sys_enter_madvise here (no perf, no tracepoints, "
            "or not root): pass --counter strace"
        )
    if shutil.which("strace") is None:
        raise ThinvmError("neither perf nor strace is usable: install strace")
    return "strace"


def parse_perf_csv(text: str, names: Sequence[str]) -> dict[str, int]:
    """Counts from `perf stat -x,` output; events appear in command-line order."""
    counts: dict[str, int] = {}
    values = [
        line.split(",")[0]
        for line in text.splitlines()
        if line.count(",") >= 2 and not line.startswith("#")
    ]
    for name, value in zip(names, values, strict=False):
        # "<not counted>": the event never ran, i.e. no such call happened.
        counts[name] = int(value) if value.strip().isdigit() else 0
    return counts


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls per syscall from the table `strace -c` prints when it detaches.

    % time     seconds  usecs/call     calls    errors syscall
    ------ ----------- ----------- --------- --------- ----------------
    100.00    2.958586           3    917615           madvise
    """
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[-1] == "total" or not fields[3].isdigit():
            continue
        try:
            float(fields[0])
        except ValueError:
            continue
        counts[fields[-1]] = int(fields[3])
    return counts


@dataclass(frozen=True)
class SyscallCounts:
    backend: str
    madvise: int
    fallocate: int
    # madvise calls that drop memory (DONTNEED/FREE/REMOVE) plus fallocate.
    # strace cannot see the advice, so there every madvise counts.
    discard: int


class SyscallCounter:
    """Count madvise/fallocate calls of processes while a block runs.

    with SyscallCounter([vm.pid]) as counter:
        do_the_operation()
    counter.counts.discard
    """

    def __init__(self, pids: Sequence[int], backend: str = "auto") -> None:
        if not pids:
            raise ThinvmError("SyscallCounter needs at least one process id")
        self.pids = list(pids)
        self.backend = counter_backend(backend)
        self.counts: SyscallCounts | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._out = Path(tempfile.mkstemp(prefix="thinvm-count-")[1])

    def _command(self) -> list[str]:
        pids = ",".join(str(p) for p in self.pids)
        if self.backend == "perf":
            cmd = ["perf", "stat", "-x,", "-o", str(self._out)]
            for _, event, flt in _PERF_EVENTS:
                cmd += ["-e", event] + (["--filter", flt] if flt else [])
            return [*cmd, "-p", pids]
        return [
            "strace",
            "-f",
            "-c",
            "-e",
            "trace=madvise,fallocate",
            "-o",
            str(self._out),
            *[arg for p in self.pids for arg in ("-p", str(p))],
        ]

    def __enter__(self) -> "SyscallCounter":
        self._proc = subprocess.Popen(
            self._command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Neither tool says when it has attached to every thread; both
        # take a few milliseconds.
        time.sleep(ATTACH_SECONDS)
        if self._proc.poll() is not None:
            err = self._proc.stderr.read() if self._proc.stderr else ""
            self._cleanup()
            raise ThinvmError(f"{self.backend} could not attach to {self.pids}: {err.strip()}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        try:
            _, err = self._proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        text = self._out.read_text() if self._out.exists() else ""
        self._cleanup()
        if exc_type is not None:
            return
        if self.backend == "perf":
            raw = parse_perf_csv(text, [name for name, _, _ in _PERF_EVENTS])
            if len(raw) != len(_PERF_EVENTS):
                raise ThinvmError(f"perf printed no counts: {err.strip()[-300:]}")
            self.counts = SyscallCounts(
                "perf", raw["madvise"], raw["fallocate"], raw["madvise_discard"] + raw["fallocate"]
            )
        else:
            raw = parse_strace_summary(text)
            madvise, fallocate = raw.get("madvise", 0), raw.get("fallocate", 0)
            self.counts = SyscallCounts("strace", madvise, fallocate, madvise + fallocate)

    def _cleanup(self) -> None:
        with contextlib.suppress(OSError):
            self._out.unlink()


# -- network namespaces ------------------------------------------------------

CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ThinvmError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ThinvmError(f"tc {' '.join(args)} failed: {proc.stderr.strip()}")


@dataclass(frozen=True)
class VethLink:
    """Two network namespaces joined by a veth pair shaped to `rate`."""

    src_ns: str
    dst_ns: str
    src_ip: str
    dst_ip: str
    rate: str


@contextlib.contextmanager
def veth_link(rate: str = "10gbit", tag: str | None = None) -> Iterator[VethLink]:
    """Create netns <tag>-src and <tag>-dst, a veth pair between them, and a
    token bucket of `rate` on both ends; remove them all afterwards."""
    if os.geteuid() != 0:
        raise ThinvmError("the network scenario needs root (network namespaces, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ThinvmError(f"the network scenario needs {tool} (Debian package iproute2)")
    tag = tag or f"tvb{os.getpid() % 100000}"
    link = VethLink(f"{tag}-src", f"{tag}-dst", "10.231.0.1", "10.231.0.2", rate)
    created: list[str] = []
    try:
        for ns in (link.src_ns, link.dst_ns):
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"{tag}a", "netns", link.src_ns, "type", "veth", "peer", "name",
            f"{tag}b", "netns", link.dst_ns)  # fmt: skip
        for ns, dev, addr in (
            (link.src_ns, f"{tag}a", link.src_ip),
            (link.dst_ns, f"{tag}b", link.dst_ip),
        ):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            # A token bucket at line rate; 4 MiB of burst keeps tbf accurate
            # at 10 Gbit/s with a 250 Hz timer.
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "4mb", "latency", "20ms")  # fmt: skip
        yield link
    finally:
        for ns in reversed(created):
            with contextlib.suppress(ThinvmError):
                _ip("netns", "del", ns)


@contextlib.contextmanager
def in_netns(name: str | None) -> Iterator[None]:
    """Run the block (and every process it starts) in network namespace `name`.

    Only the calling thread switches (setns(2) is per thread); children
    forked from it inherit the namespace.  Unix sockets (QMP, the agent)
    work across namespaces because they are bound to paths.
    """
    if name is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise ThinvmError(f"setns into {name}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise ThinvmError(
                    f"cannot return to the original network namespace: "
                    f"{os.strerror(ctypes.get_errno())}"
                )
    finally:
        os.close(target)
        os.close(own)


# -- memory cgroups (v1) -----------------------------------------------------

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path

    def usage(self) -> int:
        return int((self.path / "memory.usage_in_bytes").read_text())

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


def _own_memory_cgroup() -> Path:
    for line in Path("/proc/thread-self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1_MEMORY / path.lstrip("/")
    return CGROUP_V1_MEMORY


@contextlib.contextmanager
def memory_cgroup(limit: int, name: str | None = None) -> Iterator[MemoryCgroup]:
    """A fresh cgroup-v1 memory cgroup limited to `limit` bytes, removed after."""
    if not (CGROUP_V1_MEMORY / "memory.limit_in_bytes").is_file():
        raise ThinvmError(
            f"no cgroup-v1 memory controller at {CGROUP_V1_MEMORY}: the budget scenario needs one"
        )
    path = CGROUP_V1_MEMORY / (name or f"thinvm-bench-{os.getpid()}")
    path.mkdir(exist_ok=True)
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit))
        yield MemoryCgroup(path)
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                # Tasks still exiting (their VMs were just killed).
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)


@contextlib.contextmanager
def spawn_in(cgroup: MemoryCgroup) -> Iterator[None]:
    """Processes started in the block belong to `cgroup`.

    Moves only the calling thread (cgroup v1 `tasks` takes thread ids); a
    child inherits its parent thread's cgroup at fork.  Memory the thread
    allocates meanwhile is charged there too, so keep the block short.
    """
    original = _own_memory_cgroup()
    tid = str(threading.get_native_id())
    (cgroup.path / "tasks").write_text(tid)
    try:
        yield
    finally:
        (original / "tasks").write_text(tid)
