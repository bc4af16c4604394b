"""Pressure stall information (PSI) for memory: the host's and a cgroup's.

Documentation/accounting/psi.rst: a pressure file holds a `some` line
(share of time at least one task stalled on memory) and, for memory, a
`full` line (share of time all non-idle tasks stalled at once), each with
10, 60 and 300 s running averages in percent and a total in microseconds.
"""

from dataclasses import dataclass
from pathlib import Path

PSI_MEMORY = "/proc/pressure/memory"


@dataclass(frozen=True)
class Psi:
    """One memory pressure file; averages in percent, totals in microseconds."""

    some_avg10: float
    some_avg60: float
    some_avg300: float
    some_total_us: int
    full_avg10: float | None  # None: the file has no `full` line
    full_avg60: float | None
    full_avg300: float | None
    full_total_us: int | None


_Line = tuple[float, float, float, int]


def _parse_line(fields: list[str]) -> _Line | None:
    values = dict(item.partition("=")[::2] for item in fields)
    try:
        return (
            float(values["avg10"]),
            float(values["avg60"]),
            float(values["avg300"]),
            int(values["total"]),
        )
    except (KeyError, ValueError):
        return None


def parse_psi(text: str) -> Psi | None:
    """Parse a pressure file; None if it has no complete `some` line.

    A `full` line that is present but incomplete makes the whole text
    malformed (None) rather than silently reading as "no full line".
    """
    lines: dict[str, _Line | None] = {}
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] in ("some", "full"):
            lines[fields[0]] = _parse_line(fields[1:])
    some = lines.get("some")
    if some is None or ("full" in lines and lines["full"] is None):
        return None
    full = lines.get("full")
    return Psi(
        *some,
        full_avg10=full[0] if full else None,
        full_avg60=full[1] if full else None,
        full_avg300=full[2] if full else None,
        full_total_us=full[3] if full else None,
    )


def read_psi(path: str = PSI_MEMORY) -> Psi | None:
    """The pressure file at `path`; None when missing or unreadable.

    Kernels built without PSI have no file; kernels booted with psi=0 have
    one whose read fails with EOPNOTSUPP.
    """
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return parse_psi(text)


def read_cgroup_psi(cgroup_dir: Path) -> Psi | None:
    """A cgroup v2 group's `memory.pressure`; None on cgroup v1 (no such file)."""
    return read_psi(str(Path(cgroup_dir) / "memory.pressure"))
