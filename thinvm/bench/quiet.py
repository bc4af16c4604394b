"""The quiet gate: a run starts only when the machine is quiet, or after a bounded wait.

On a shared 2-core machine another engineer's QEMU build or TCG guest
doubles a migration's wall time; numbers taken then compare the neighbours,
not the variants.  Before every run the harness waits until the 1-minute
load average is below `max_load` and no QEMU runs that is not the harness's
own, for at most `max_wait_s`; then it runs anyway and records that the
machine was not quiet.  While the run goes on, it looks for other QEMUs
every `poll_s` (the load average is the run's own then, so it is only
recorded).  A run is quiet when the gate was met at its start and no other
QEMU appeared during it; what was seen goes into the run's record, so a
reader can tell a quiet result from a noisy one.

The harness's own QEMUs are its descendants, and the guests a benchmark
starts through a simulated cluster's libvirtd, which are not: their
libvirt names start with OWN_LIBVIRT_GUEST (thinvm.bench.scenarios.fleet).
"""

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from thinvm.host.procs import descends_from, processes_named

QEMU_PREFIX = "qemu-system"  # comm of qemu-system-x86_64 and friends, cut to 15 chars
OWN_LIBVIRT_GUEST = b"guest=bench-"  # in the -name libvirt gives a benchmark's guest


@dataclass(frozen=True)
class QuietGate:
    """When the machine counts as quiet, and how long to wait for it."""

    # What the records since 2026-11-25 ran with.  Another engineer's build
    # keeps this 2-CPU machine's 1-minute average at 2 or more, which 1.5
    # catches; our own previous run, which kept both CPUs busy, decays below
    # 1.5 in about 20 s (below 1.0 only after about 45 s, a quarter of an
    # hour more per 20-run record for no gain).  Another QEMU, busy or
    # idle, is caught by name, not by load.  Within a minute a busy machine
    # stays busy: the run starts then, recorded as not quiet.
    max_load: float = 1.5
    max_wait_s: float = 60.0
    poll_s: float = 5.0

    def as_record(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Observation:
    load: float  # 1-minute load average
    other_qemu: int  # QEMU processes that are not the harness's own


def read_cmdline(pid: int) -> bytes | None:
    """A process's command line; None once it has exited.

    An exiting process keeps its /proc entry for a moment with an empty
    command line (a zombie has no address space to read it from).
    """
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes() or None
    return None


def is_foreign_qemu(pid: int, own: int) -> bool:
    if descends_from(pid, own):
        return False
    # Read after the ancestry walk: a QEMU that exits between being listed
    # and being looked at (our cluster's guests do, at every run's end) has
    # no command line left and is not counted as somebody else's.
    cmdline = read_cmdline(pid)
    return cmdline is not None and OWN_LIBVIRT_GUEST not in cmdline


def foreign_qemu_count(own: int | None = None) -> int:
    """QEMU processes on the host that `own` (default: this process) did not
    start, directly or through a benchmark cluster's libvirtd."""
    own = os.getpid() if own is None else own
    return sum(1 for pid in processes_named(QEMU_PREFIX) if is_foreign_qemu(pid, own))


def observe() -> Observation:
    return Observation(round(os.getloadavg()[0], 2), foreign_qemu_count())


def is_quiet(seen: Observation, gate: QuietGate) -> bool:
    return seen.load < gate.max_load and seen.other_qemu == 0


def wait_quiet(
    gate: QuietGate,
    look: Callable[[], Observation] = observe,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    on_wait: Callable[[Observation, float], None] = lambda _seen, _waited: None,
) -> dict[str, object]:
    """Wait (bounded) for a quiet machine; what was seen when the run starts.

    {"load", "other_qemu", "waited_s", "quiet"}: quiet is False when the
    wait ran out and the run started anyway.
    """
    start = clock()
    while True:
        seen = look()
        waited = clock() - start
        if is_quiet(seen, gate) or waited >= gate.max_wait_s:
            return {
                "load": seen.load,
                "other_qemu": seen.other_qemu,
                "waited_s": round(waited, 1),
                "quiet": is_quiet(seen, gate),
            }
        on_wait(seen, waited)
        sleep(min(gate.poll_s, gate.max_wait_s - waited))


class RunWatch:
    """Looks for other QEMUs every `poll_s` while a run goes on."""

    def __init__(self, poll_s: float, count: Callable[[], int] = foreign_qemu_count) -> None:
        self.poll_s, self.count = poll_s, count
        self.most_other_qemu = 0
        self.looks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="quiet-watch", daemon=True)

    def _watch(self) -> None:
        while True:
            self.most_other_qemu = max(self.most_other_qemu, self.count())
            self.looks += 1
            if self._stop.wait(self.poll_s):
                return

    def __enter__(self) -> "RunWatch":
        self._thread.start()
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def as_record(self) -> dict[str, object]:
        return {"other_qemu_during": self.most_other_qemu, "looks_during": self.looks}


def run_was_quiet(quiet: dict[str, object]) -> bool:
    """A run's record: quiet at its start, and no other QEMU during it
    (records made before the watch count by their start alone)."""
    return bool(quiet.get("quiet")) and not quiet.get("other_qemu_during")


def gate_records(result: dict[str, Any]) -> list[dict[str, Any]]:
    """What the quiet gate recorded for each of a record's runs (none for
    records made before the gate)."""
    return [r["quiet"] for r in result.get("runs", []) if "quiet" in r]


def gate_watched(result: dict[str, Any]) -> str:
    """How a record's runs were kept quiet, for its line in the scenario
    table: the rules of issue 48 watch the machine during each run, so a
    record made before the watch, or with no gate at all, says so."""
    seen = gate_records(result)
    if not result.get("load", {}).get("gate") or not seen:
        return "no quiet gate"
    if all("other_qemu_during" in s for s in seen):
        return ""
    return "quiet gate at each run's start only"
