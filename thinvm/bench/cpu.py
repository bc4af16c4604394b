"""CPU seconds a migration costs each QEMU, split by the kind of thread.

Wall time on a shared 2-core machine says as much about the neighbours as
about the migration; CPU seconds say what the migration itself cost.  QEMU
names its threads when started with `-name debug-threads=on` (every
benchmark guest is: thinvm.bench.types.GUEST_ARGS).  QEMU 10.0's names
(migration/migration.h, accel/): vCPUs "CPU 0/TCG", "CPU 0/KVM" (or
"ALL CPUs/TCG" with one TCG thread for all), the migration thread
"mig/src/main" and its helpers "mig/src/return", "mig/dst/listen" ...,
multifd channels "mig/src/send_N" and "mig/dst/recv_N" (older QEMUs:
"live_migration", "multifdsend_N", "multifdrecv_N").  Everything else is
"other": the main thread, which on the destination also loads the main
migration stream (precopy loads it in a coroutine of the main loop), I/O,
RCU and worker threads.  /proc and the kernel's exit records both give a
thread's name as its comm, at most 15 characters ("mig/src/send_123"
shows as "mig/src/send_12"); every pattern here matches names so cut.
"""

import re
from collections.abc import Collection, Mapping
from types import TracebackType

from thinvm.bench.types import Metrics
from thinvm.host.procs import ThreadCpu, ThreadCpuSampler

KINDS = ("migration", "vcpu", "multifd", "other")
_PATTERNS = (
    ("multifd", re.compile(r"^(mig/src/send_\d+|mig/dst/recv_\d+|multifd(send|recv)_\d+)$")),
    ("vcpu", re.compile(r"^(CPU \d+/\w+|ALL CPUs/TCG)$")),
    ("migration", re.compile(r"^(mig/|live_migration$|return path$|postcopy/)")),
)


def thread_kind(name: str) -> str:
    """migration, vcpu, multifd or other, from a QEMU thread's name."""
    return next((kind for kind, pattern in _PATTERNS if pattern.match(name)), "other")


def cpu_metrics(
    side: str,
    used: Mapping[int, ThreadCpu],
    process_s: float | None = None,
    exited: Collection[int] = (),
    exact: bool = False,
) -> Metrics:
    """{side}_cpu_s and {side}_{kind}_cpu_s of every kind, in seconds.

    `process_s` is the whole process's CPU time over the same span; the
    kinds add up to it.  With `exact`, `used` holds every thread that
    exited as its exit record counted it (ThreadCpuSampler.exact), so what
    is left over is /proc's rounding to 10 ms ticks and goes to other.
    Otherwise the rest also holds what `exited` threads used after their
    last sample, and what threads used that exited unseen: it goes to the
    kinds of the threads that exited, in proportion to what was seen of
    them (to other if none was).  {side}_cpu_split_exact says which: 1 or 0.
    """
    totals = dict.fromkeys(KINDS, 0.0)
    for thread in used.values():
        totals[thread_kind(thread.name)] += thread.cpu_s
    residue = max(0.0, (process_s or 0.0) - sum(totals.values()))
    shares = {"other": 1.0} if exact else _exited_shares(used, exited)
    for kind, share in shares.items():
        totals[kind] += residue * share
    metrics: Metrics = {f"{side}_cpu_s": round(sum(totals.values()), 3)}
    metrics.update({f"{side}_{kind}_cpu_s": round(totals[kind], 3) for kind in KINDS})
    metrics[f"{side}_cpu_split_exact"] = int(exact)
    return metrics


def _exited_shares(used: Mapping[int, ThreadCpu], exited: Collection[int]) -> dict[str, float]:
    """Kind -> its share of the time seen of the threads that exited."""
    seen = [used[tid] for tid in exited if tid in used]
    total = sum(t.cpu_s for t in seen)
    if not seen or total == 0:
        return {"other": 1.0}
    shares = dict.fromkeys(KINDS, 0.0)
    for thread in seen:
        shares[thread_kind(thread.name)] += thread.cpu_s / total
    return shares


def metric_names(side: str) -> list[str]:
    """The names cpu_metrics(side, ...) reports."""
    return [
        f"{side}_cpu_s",
        *(f"{side}_{kind}_cpu_s" for kind in KINDS),
        f"{side}_cpu_split_exact",
    ]


class MigrationCpu:
    """Samples the source's and destination's threads while a migration runs.

    Enter just before the `migrate` command; call src_done() once the source
    reports completion and dst_done() once the destination runs (it may still
    be loading when the source is done).  Whatever was not marked done is
    stopped on exit.  `metrics` then holds src_* and dst_* figures.
    """

    def __init__(self, src_pid: int | None, dst_pid: int | None) -> None:
        self._samplers = {
            side: ThreadCpuSampler(pid)
            for side, pid in (("src", src_pid), ("dst", dst_pid))
            if pid is not None
        }
        self.metrics: Metrics = {}

    def __enter__(self) -> "MigrationCpu":
        for sampler in self._samplers.values():
            sampler.start()
        return self

    def src_done(self) -> None:
        self._done("src")

    def dst_done(self) -> None:
        self._done("dst")

    def _done(self, side: str) -> None:
        sampler = self._samplers.pop(side, None)
        if sampler is not None:
            used = sampler.stop()
            self.metrics.update(
                cpu_metrics(side, used, sampler.process_cpu_s, sampler.exited, sampler.exact)
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for side in list(self._samplers):
            self._done(side)
