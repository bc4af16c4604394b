"""Where a libvirt migration's time goes (issue 47): thinvm's own steps and
libvirt's domain events on both hosts, on one clock.

`virsh migrate` returns when libvirt's whole job is over: the source
connects to the destination, the destination starts its QEMU, memory
moves, the guest pauses, the destination resumes it, the source QEMU is
torn down and the definitions move.  libvirt's `domjobinfo --completed`
keeps only the elapsed time and the downtime of that.  A trace watches
`virsh event --all --loop --timestamp` on the source and on the
destination while the migration runs (lifecycle changes, migration
iterations, job completion, as libvirt emits them), and puts thinvm's own
marks (checks, the `virsh migrate` call, reading the statistics) among
them: the gaps between consecutive marks say which side spent the time.

The watchers' connections are opened before the first mark, so their
TLS handshakes are not in the trace.  Their timestamps are virsh's, taken
as the event arrives on this machine's clock, the same one as ours.
"""

import contextlib
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

from thinvm.fleet.cluster import Host

# virsh needs a moment after it starts to have connected and registered
# for events; a migration started before that would lose its first ones.
WATCH_READY_S = 0.5
_EVENT_RE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+[+-]\d{4}): event '(?P<kind>[^']+)'"
    r" for domain '?(?P<domain>[^':]+)'?:?\s*(?P<detail>.*)$"
)


@dataclass(frozen=True)
class Mark:
    """One instant of a migration: wall-clock seconds, where, what."""

    at: float
    where: str  # a host's name, or "thinvm"
    what: str


def parse_event(line: str, host: str, domain: str) -> Mark | None:
    """A `virsh event --timestamp` line about `domain` as a Mark, or None."""
    match = _EVENT_RE.match(line.strip())
    if match is None or match["domain"] != domain:
        return None
    at = datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S.%f%z").timestamp()
    detail = " ".join(match["detail"].split())
    return Mark(at, host, f"{match['kind']}: {detail}" if detail else match["kind"])


class EventWatch:
    """`virsh event --all --loop --timestamp` on one host, for one domain,
    while the context is open; its events as marks afterwards."""

    def __init__(self, host: Host, domain: str) -> None:
        self.host, self.domain = host, domain
        self.marks: list[Mark] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "EventWatch":
        # Every domain's events, filtered here: `--domain` needs the domain
        # to exist already, which it does not on the destination.
        cmd = ["virsh", "-q", "-c", self.host.uri, "event", "--all", "--loop", "--timestamp"]
        self._proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        return self

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            mark = parse_event(line, self.host.name, self.domain)
            if mark is not None:
                self.marks.append(mark)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            # Events still in flight when virsh migrate returns (the
            # source's last lifecycle change) get a moment to arrive.
            time.sleep(0.2)
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)


@dataclass
class Trace:
    """The marks of one migration, ours and libvirt's."""

    marks: list[Mark] = field(default_factory=list)

    def mark(self, what: str) -> None:
        self.marks.append(Mark(time.time(), "thinvm", what))

    @contextlib.contextmanager
    def watching(self, hosts: list[Host], domain: str) -> Any:
        """Watch libvirt's events for `domain` on `hosts` meanwhile."""
        with contextlib.ExitStack() as stack:
            watches = [stack.enter_context(EventWatch(h, domain)) for h in hosts]
            time.sleep(WATCH_READY_S)
            try:
                yield self
            finally:
                stack.close()
                for watch in watches:
                    self.marks.extend(watch.marks)

    def steps(self) -> list[dict[str, Any]]:
        """The marks in order: seconds since the first, since the one
        before, where and what."""
        ordered = sorted(self.marks, key=lambda m: m.at)
        if not ordered:
            return []
        first = ordered[0].at
        steps = []
        for i, mark in enumerate(ordered):
            gap = mark.at - ordered[i - 1].at if i else 0.0
            steps.append(
                {
                    "t_s": round(mark.at - first, 3),
                    "gap_s": round(gap, 3),
                    "where": mark.where,
                    "what": mark.what,
                }
            )
        return steps

    def phases(self, source: str, destination: str) -> dict[str, float]:
        """Milliseconds per phase of a migration from `source` to
        `destination`, cut at the instants both sides agree on (PHASES);
        a phase whose marks are missing is left out."""
        return phases(self.marks, source, destination)

    def lines(self) -> list[str]:
        """The steps as a table for people."""
        rows = [f"{'t (s)':>8} {'+ (s)':>7}  {'where':<8} what"]
        for step in self.steps():
            rows.append(
                f"{step['t_s']:8.3f} {step['gap_s']:7.3f}  {step['where']:<8} {step['what']}"
            )
        return rows


# The instants that cut a traced migration into phases: (where, what it
# starts with), where is "thinvm", "source" or "destination".  Between
# "virsh migrate called" and the first migration-iteration event libvirt
# connects to the destination, starts its QEMU, and QEMU sets the
# migration up (TLS handshakes, the first dirty sync); the first iteration
# event is QEMU's first pass starting (MIGRATION_PASS).
CUTS = {
    "checks": ("thinvm", "checks"),
    "called": ("thinvm", "virsh migrate called"),
    "first_pass": ("source", "migration-iteration"),
    "paused": ("source", "lifecycle: Suspended"),
    "resumed": ("destination", "lifecycle: Resumed"),
    "returned": ("thinvm", "virsh migrate returned"),
    "stats": ("thinvm", "job statistics read"),
}
# Phase name: (from cut, to cut), and whose time it is.
PHASES = {
    "trace_checks_ms": ("checks", "called"),  # ours: route, XML, capability checks
    "trace_setup_ms": ("called", "first_pass"),  # libvirt + QEMU: connect, start, set up
    "trace_live_ms": ("first_pass", "paused"),  # QEMU: memory moves, guest runs
    "trace_paused_ms": ("paused", "resumed"),  # QEMU + libvirt: the guest stopped
    "trace_finish_ms": ("resumed", "returned"),  # libvirt: confirm, tear down, undefine
    "trace_stats_ms": ("returned", "stats"),  # ours: domjobinfo on the destination
}


def phases(marks: list[Mark], source: str, destination: str) -> dict[str, float]:
    """The PHASES of one migration's marks, in milliseconds."""
    hosts = {"thinvm": "thinvm", "source": source, "destination": destination}
    ordered = sorted(marks, key=lambda m: m.at)
    instants: dict[str, float] = {}
    for cut, (where, starts) in CUTS.items():
        found = [m.at for m in ordered if m.where == hosts[where] and m.what.startswith(starts)]
        if found:
            instants[cut] = found[0]
    return {
        name: round((instants[end] - instants[begin]) * 1000, 1)
        for name, (begin, end) in PHASES.items()
        if begin in instants and end in instants and instants[end] >= instants[begin]
    }
