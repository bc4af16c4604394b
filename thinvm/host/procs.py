"""Processes on the host: identity over time, age, who holds a file, CPU time."""

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from thinvm.host import HostError
from thinvm.host.taskstats import ExitListener, TaskstatsUnavailable


class ProcessGone(HostError):
    """The process has exited (or is a zombie)."""


def parse_stat_start(stat: str) -> int | None:
    """Start time (clock ticks after boot) from /proc/PID/stat text; None for a zombie.

    The command name (field 2) may hold spaces and parentheses, so the
    fields are counted from the last ')'.
    """
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of proc(5)


def proc_start_time(pid: int) -> int | None:
    """Start time of a live (not zombie) process, None if there is none.

    Together with the pid it tells a process apart from a later one that
    got the same pid.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return parse_stat_start(text)


def process_alive(pid: int, start: int) -> bool:
    """Whether the process that started at `start` still runs under `pid`."""
    return proc_start_time(pid) == start


def process_age(pid: int) -> float:
    """Seconds since the process started (10 ms resolution)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    start = proc_start_time(pid)
    if start is None:
        raise ProcessGone(f"process {pid} is gone")
    return uptime - start / os.sysconf("SC_CLK_TCK")


def users_of(path: str, exclude: int | None = None) -> list[int]:
    """Processes that have `path` open or mapped (`exclude`: a pid to skip)."""
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


# -- CPU time per thread -------------------------------------------------------


@dataclass(frozen=True)
class ThreadCpu:
    """One thread's name (comm) and CPU time so far (user + system, seconds)."""

    name: str
    cpu_s: float


def parse_task_stat(stat: str, ticks_per_s: int) -> ThreadCpu:
    """Name and utime + stime of /proc/PID/task/TID/stat text.

    The name sits between the first '(' and the last ')' and may hold both;
    utime and stime are fields 14 and 15 of proc(5), counted from that ')'.
    """
    head, _, tail = stat.rpartition(")")
    fields = tail.split()
    ticks = int(fields[11]) + int(fields[12])
    return ThreadCpu(head.partition("(")[2], ticks / ticks_per_s)


def process_cpu(pid: int, proc: Path = Path("/proc")) -> float | None:
    """CPU seconds of a whole process so far, None once it is gone.

    Unlike the sum over its live threads, this includes the threads that
    have exited: the kernel adds their time to the process's when they go.
    """
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return parse_task_stat(stat, os.sysconf("SC_CLK_TCK")).cpu_s


def thread_cpu(pid: int, proc: Path = Path("/proc")) -> dict[int, ThreadCpu]:
    """CPU time of every live thread of `pid` by thread id; {} once it is gone.

    Threads that exit while the task directory is read are left out.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    threads: dict[int, ThreadCpu] = {}
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        with contextlib.suppress(OSError, ValueError, IndexError):
            threads[int(task.name)] = parse_task_stat((task / "stat").read_text(), ticks)
    return threads


class ThreadCpuSampler:
    """CPU seconds each thread of a process used between start() and stop().

    Threads that exit in between (a migration's multifd channels do, as it
    completes) still count, under their own names: the kernel sends each
    one's total as it exits (thinvm.host.taskstats), and `exact` says it
    did for the whole span.  Where it will not (not root, no taskstats),
    `exit_error` says why and the sampler estimates: a background thread
    samples /proc every `interval` seconds and keeps each thread's last
    value, so a thread that exits between two samples is not in used() at
    all and what one used after its last sample is missing; both are in
    `process_cpu_s`, the whole process's time over the same span.  Either
    way `exited` names the threads that went.  Threads born in between
    count from zero.  Use as a context manager, or call start() and stop().
    """

    def __init__(
        self,
        pid: int,
        interval: float = 0.1,
        proc: Path = Path("/proc"),
        count_exits: bool = True,
    ) -> None:
        self.pid, self.interval, self.proc = pid, interval, proc
        self._before: dict[int, ThreadCpu] = {}
        self._last: dict[int, ThreadCpu] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process_before: float | None = None
        self._exits: ExitListener | None = ExitListener({pid}) if count_exits else None
        self.exit_error: str | None = None if count_exits else "not asked to count exits"
        self.process_cpu_s: float | None = None  # set by stop()
        self.exited: set[int] = set()  # set by stop()

    @property
    def exact(self) -> bool:
        """Whether every thread that exited was counted from its own exit record."""
        return self.exit_error is None

    def start(self) -> "ThreadCpuSampler":
        self._listen_for_exits()  # first, so no thread exits unheard after the first sample
        self._process_before = process_cpu(self.pid, self.proc)
        self._before = thread_cpu(self.pid, self.proc)
        self._last = dict(self._before)
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[int, ThreadCpu]:
        """Stop sampling; the CPU time each thread used since start()."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        live = self._sample()
        after = process_cpu(self.pid, self.proc)
        if after is not None and self._process_before is not None:
            self.process_cpu_s = round(after - self._process_before, 6)
        # Every thread gone from the last sample has sent its record by now.
        exits = self._exits.close() if self._exits is not None else {}
        if self._exits is not None and self._exits.lost:
            self.exit_error = "the kernel dropped exit records (receive buffer full)"
        self.exited = (set(self._last) - set(live)) | set(exits)
        return self.used()

    def used(self) -> dict[int, ThreadCpu]:
        """CPU time per thread since start(): as it exited, else as of the latest sample.

        A thread id the kernel gave a second thread within the span (only
        after a wrap of pid_max) would be counted as one thread.
        """
        with self._lock:
            last = dict(self._last)
        exits = self._exits.records() if self._exits is not None else {}
        now = last | {tid: ThreadCpu(e.name, e.cpu_s) for tid, e in exits.items()}
        return {
            tid: ThreadCpu(thread.name, round(max(0.0, thread.cpu_s - self._cpu_before(tid)), 6))
            for tid, thread in now.items()
        }

    def _listen_for_exits(self) -> None:
        if self._exits is None:
            return
        try:
            self._exits.open()
        except TaskstatsUnavailable as err:
            self._exits, self.exit_error = None, str(err)

    def _cpu_before(self, tid: int) -> float:
        before = self._before.get(tid)
        return before.cpu_s if before is not None else 0.0

    def _sample(self) -> dict[int, ThreadCpu]:
        now = thread_cpu(self.pid, self.proc)
        with self._lock:
            self._last.update(now)
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "ThreadCpuSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- finding processes ---------------------------------------------------------


def parse_stat_ppid(stat: str) -> int:
    """Parent pid (field 4 of proc(5)) from /proc/PID/stat text."""
    return int(stat.rsplit(")", 1)[1].split()[1])


def parse_stat_state(stat: str) -> str:
    """State letter (field 3 of proc(5)) from /proc/PID/stat text."""
    return stat.rsplit(")", 1)[1].split()[0]


def processes_named(prefix: str, proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> parent pid of every live process whose name (comm) starts
    with `prefix`.

    comm holds at most 15 characters: "qemu-system-x86_64" shows as
    "qemu-system-x86", so match on a prefix of that.  A process that has
    exited but is not yet reaped (zombie, dead) runs nothing and has no
    command line left: it is not counted.  Orphans wait for this
    machine's PID 1, which reaps them 1-2 s late.
    """
    found: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            exited = parse_stat_state(stat) in ("Z", "X")
            if stat.partition("(")[2].startswith(prefix) and not exited:
                found[int(entry.name)] = parse_stat_ppid(stat)
    return found


def descends_from(pid: int, ancestor: int, proc: Path = Path("/proc")) -> bool:
    """Whether `ancestor` is `pid` or one of its parents, grandparents ..."""
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        if pid == ancestor:
            return True
        seen.add(pid)
        try:
            pid = parse_stat_ppid((proc / str(pid) / "stat").read_text())
        except (OSError, ValueError, IndexError):
            return False
    return pid == ancestor
