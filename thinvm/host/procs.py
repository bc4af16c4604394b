"""Processes on the host: identity over time, age, who holds a file."""

import contextlib
import os
from pathlib import Path

from thinvm.host import HostError


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
