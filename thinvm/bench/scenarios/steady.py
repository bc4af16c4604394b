"""reclaim-steady: does an idle guest that read a data set once stay trimmed?

A Debian guest (the disk image with thinvm-guest-agent as packaged) reads
a data set from a second disk once, then idles; the host samples its
QEMU's RSS for a fixed window.  Variants differ in the guest reclaimer's
background mode, which the packaged agent turns on by default, and in
the QEMU and balloon driver under it:

- stock-reporting: Debian's QEMU, the in-tree driver, free page
  reporting; the reclaimer switched off (what stock gives);
- stock-reclaimer: the same with the reclaimer on (our guest side alone,
  on stock QEMU: the anchor thinvm's host side must beat);
- thinvm: the patched QEMU, our driver with page ranges, reporting, the
  reclaimer on.

With `--param reader=loop` the guest does not idle: it reads its data
set again and again for the whole window (a guest that reads files all
the time, issue 47's case for the reclaimer's CPU bound), and
`reader_passes` counts the whole reads it finished.

The reclaimer's CPU comes from its counters (`RECLAIM status`):
`reclaimer_thread_cpu_pct` is all of its background thread's CPU
(`thread_cpu_ms`, idle ticks included) as a share of one vCPU over the
window (the package's bound is 2%); `reclaim_work_cpu_s` the part its
reclaim steps and compactions took (`cpu_ms`; records before 2026-11-28
22:00 UTC gave only this, as `reclaimer_cpu_s` and `reclaimer_cpu_pct`).
"""

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from thinvm.bench.scenarios.common import Candidate
from thinvm.bench.scenarios.params import float_param, size_param
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.workingset import DEBIAN_BOOT_TIMEOUT, DataDisk, mount_command
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.guest import trim, workload
from thinvm.host.procs import process_cpu
from thinvm.units import MiB, format_size
from thinvm.vm.machine import VM
from thinvm.vm.stack import Stack

NAME = "reclaim-steady"
SAMPLE_SECONDS = 10.0
# RSS within this much of the window's last sample counts as settled.
SETTLED_WITHIN = 64 * MiB


def _variants() -> list[tuple[Candidate, bool]]:
    stock = Stack(reporting=True)
    thinvm = Stack(build="patched", driver="thinvm", reporting=True, ranges=True)
    return [
        (Candidate("stock-reporting", stock, "Debian's QEMU, in-tree driver, reporting"), False),
        (
            Candidate(
                "stock-reclaimer", stock, "Debian's QEMU, in-tree driver, reporting, reclaimer on"
            ),
            True,
        ),
        (
            Candidate(
                "thinvm", thinvm, "patched QEMU, our driver (ranges), reporting, reclaimer on"
            ),
            True,
        ),
    ]


READERS = ("none", "loop")
READER_PASSES = "/run/thinvm-bench-reader"  # one line per whole read


def reader_param(params: dict[str, str]) -> str:
    reader = params["reader"]
    if reader not in READERS:
        raise ThinvmError(f"--param reader={reader}: choose {' or '.join(READERS)}")
    return reader


def reader_command(source: str) -> str:
    """The guest shell line that reads `source` over and over, in the
    background, counting whole reads in READER_PASSES."""
    loop = f"while dd if={source} of=/dev/null bs=1M 2>/dev/null; do echo >>{READER_PASSES}; done"
    return f": >{READER_PASSES}; ({loop}) >/dev/null 2>&1 </dev/null &"


def reader_passes(vm: VM) -> int:
    return int(vm.agent.check(f"wc -l <{READER_PASSES}").stdout.strip() or 0)


def qemu_cpu_seconds(vm: VM) -> float:
    """The whole QEMU process's CPU seconds so far (thinvm.host.procs)."""
    seconds = process_cpu(vm.pid or 0)
    if seconds is None:
        raise ThinvmError(f"{vm.config.name}: its QEMU is gone")
    return seconds


def sample_rss(vm: VM, seconds: float, ctx: RunContext) -> list[tuple[float, int]]:
    """(seconds since the window opened, QEMU RSS) every SAMPLE_SECONDS."""
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        rss = vm.host_memory().rss
        samples.append((round(elapsed, 1), rss))
        ctx.step(f"idle {elapsed:.0f}/{seconds:.0f} s, host RSS {format_size(rss)}")
        if elapsed >= seconds:
            return samples
        time.sleep(min(SAMPLE_SECONDS, seconds - elapsed))


def window_figures(samples: list[tuple[float, int]]) -> Metrics:
    """Last, time-weighted mean and peak RSS of a window, and when it settled
    (the first sample from which RSS stays within SETTLED_WITHIN of the last)."""
    last = samples[-1][1]
    weighted = sum((t1 - t0) * (r0 + r1) / 2 for (t0, r0), (t1, r1) in itertools.pairwise(samples))
    span = samples[-1][0] - samples[0][0]
    settled = samples[0][0]
    for i in range(len(samples) - 1, -1, -1):
        if abs(samples[i][1] - last) > SETTLED_WITHIN:
            settled = samples[i + 1][0]
            break
    return {
        "rss_end_bytes": last,
        "rss_mean_bytes": int(weighted / span) if span > 0 else last,
        "rss_peak_bytes": max(r for _, r in samples),
        "settled_s": settled,
    }


def steady_run(
    opts: BenchOptions,
    size: int,
    data: int,
    minutes: float,
    candidate: Candidate,
    background: bool,
    disk: DataDisk,
    reader: str = "none",
) -> Callable[[RunContext], Metrics]:
    def run(ctx: RunContext) -> Metrics:
        config = opts.vm_config("b-steady", size, candidate.stack)
        config.image, config.boot_timeout = "disk", DEBIAN_BOOT_TIMEOUT
        config.extra_args += disk.args()
        with VM(config).start() as vm:
            assert vm.pid is not None
            ctx.note("boot_s", vm.boot_seconds)
            trim.set_background(vm.agent, background)
            vm.agent.check(mount_command(disk.source))
            ctx.step(f"guest reads its {format_size(data)} data set once")
            vm.agent.check(workload.read_disk_command(data, source=disk.source.path), timeout=600)
            cached = workload.meminfo(vm.agent)["Cached"]
            if reader == "loop":
                vm.agent.check(reader_command(disk.source.path))
            qemu_cpu, clock = qemu_cpu_seconds(vm), trim.ReclaimerClock.read(vm.agent)
            window = minutes * 60
            samples = sample_rss(vm, window, ctx)
            qemu_cpu = qemu_cpu_seconds(vm) - qemu_cpu
            reclaimer = trim.reclaimer_usage([clock], [trim.ReclaimerClock.read(vm.agent)], window)
            ctx.note("rss_samples", samples)
            figures = window_figures(samples)
            if reader == "loop":
                figures["reader_passes"] = reader_passes(vm)
            return {
                **figures,
                "rss_after_read_bytes": samples[0][1],
                "cache_after_read_bytes": cached,
                "cache_end_bytes": workload.meminfo(vm.agent)["Cached"],
                "qemu_cpu_s": round(qemu_cpu, 2),
                **reclaimer,
            }

    return run


def make_reclaim_steady(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    data = size_param(params, "data")
    minutes = float_param(params, "minutes")
    if data + 1024 * MiB > size:
        raise ThinvmError(f"--param data={format_size(data)} leaves under 1 GiB of a "
                          f"{format_size(size)} guest")  # fmt: skip
    reader = reader_param(params)
    disk = DataDisk(data, "debian")
    variants = [
        Variant(c.name, steady_run(opts, size, data, minutes, c, bg, disk, reader), c.description)
        for c, bg in _variants()
    ]

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        with disk.made():
            yield

    return Scenario(
        name=NAME,
        title="an idle guest that read a data set once: does it stay trimmed?",
        description=(
            f"A {format_size(size)} Debian guest (the disk image, thinvm-guest-agent as "
            f"packaged) reads a {format_size(data)} file once from a second disk, then "
            f"{IDLES[reader]} {minutes:g} min while the host samples its QEMU's RSS every "
            f"{SAMPLE_SECONDS:g} s. **stock-reporting**: Debian's QEMU, the in-tree driver, "
            "free page reporting, the guest reclaimer switched off; **stock-reclaimer**: the "
            "same with the reclaimer's background mode on (the package's default): our "
            "guest side on stock QEMU; **thinvm**: patched QEMU, our driver with page ranges, "
            "reporting, reclaimer on. `rss_end_bytes` is the window's last sample, "
            "`rss_mean_bytes` its time-weighted mean, `settled_s` when RSS came within "
            f"{format_size(SETTLED_WITHIN)} of the end for good; `reclaimer_cpu_pct` the "
            "reclaimer thread's CPU (its own counter) as a share of one vCPU over the "
            "window, `qemu_cpu_s` the QEMU process's CPU over it."
        ),
        variants=variants,
        baseline="stock-reporting",
        main_metric="rss_end_bytes",
        second_metric="rss_mean_bytes",
        params={**steady_params(size, data, minutes), "reader": reader},
        context=session,
        targets=TARGETS,
    )


IDLES = {"none": "idles", "loop": "reads it over and over (`reader=loop`) for"}


def steady_params(size: int, data: int, minutes: float) -> dict[str, Any]:
    return {"size": format_size(size), "data": format_size(data), "minutes": minutes}


# None stated as a ratio: the package's bound is absolute (the reclaimer
# at most 2% of a vCPU, reclaimer_cpu_pct), read from the table.
TARGETS: list[Target] = []

SPEC = ScenarioSpec(
    name=NAME,
    title="idle Debian guest that read a data set once: reporting, + reclaimer, thinvm",
    make=make_reclaim_steady,
    default_size="4G",
    size_help="guest RAM",
    default_runs=5,
    params={"data": "2G", "minutes": "10", "reader": "none"},
)
