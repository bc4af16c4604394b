"""What this lab host charges for fresh memory during a run (issue 48).

The machines these benchmarks run on are themselves guests that report
free memory to their hypervisor: memory left free for ~2 s is taken back
and costs ~2.2 s of CPU per GiB to fault in again, against ~0.09 s when
it was freed moments before (thinvm.host.memory.warm_free_memory).  A
destination QEMU faulting in what it receives pays whichever the host
charges at that moment, and a warm-up before the migration can expire
before a slow variant gets to use it.  So during each measured migration
a probe faults in a few MiB every second and records the price per GiB:
a variant whose destination ran on cold memory shows it, next to its CPU
seconds, instead of hiding in them.
"""

import statistics
import threading
from types import TracebackType

from thinvm.bench.types import Metrics
from thinvm.host.memory import fault_cost

PROBE_INTERVAL_S = 1.0


class FaultCostWatch:
    """Samples thinvm.host.memory.fault_cost while open: at the start, then
    every PROBE_INTERVAL_S, and once more at the end."""

    def __init__(self, interval: float = PROBE_INTERVAL_S) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(fault_cost())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "FaultCostWatch":
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.samples.append(fault_cost())

    @property
    def metrics(self) -> Metrics:
        """The median and the worst price per GiB seen during the run."""
        if not self.samples:
            return {"host_fault_s_per_gib": None, "host_fault_max_s_per_gib": None}
        return {
            "host_fault_s_per_gib": round(statistics.median(self.samples), 3),
            "host_fault_max_s_per_gib": round(max(self.samples), 3),
        }
