"""Mounted file systems, from /proc/mounts."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

PROC_MOUNTS = "/proc/mounts"


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: str


_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    r"""Undo the kernel's octal escapes (space \040, tab \011, newline \012, \ \134).

    Only those four are escaped; other bytes, UTF-8 included, appear as
    they are, so the escapes are replaced one by one rather than decoding
    the whole field as a Python string literal.
    """
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """Parse /proc/mounts text (fstab format: source point type options ...)."""
    result = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            result.append(Mount(unescape(fields[1]), fields[2], fields[3]))
    return result


def mounts() -> list[Mount]:
    return parse_mounts(Path(PROC_MOUNTS).read_text())


def containing_mount(path: str, candidates: list[Mount]) -> Mount | None:
    """The mount among `candidates` that an absolute, resolved path lives on.

    The longest mount point above it wins; on a tie (a file system mounted
    over another) the later one, which is the one visible.
    """
    best: Mount | None = None
    for m in candidates:
        point = m.point.rstrip("/") or "/"
        inside = path == point or path.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = m
    return best


def mount_of(path: str) -> Mount | None:
    """The mount a path lives on (symbolic links resolved)."""
    return containing_mount(os.path.realpath(path), mounts())
