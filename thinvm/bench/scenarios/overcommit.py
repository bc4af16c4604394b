"""overcommit: seed 004's memhog experiment, scaled to a 2-core TCG host.

N guests whose RAM adds up to well over a host budget (a cgroup-v1 memory
cgroup, with a swap file so going over it is slow, not fatal) each run a
phased workload: read a slice of their disk once (page cache nobody reads
again, as a booted, updated system holds), grow a working set in steps,
hold it, free it, idle, repeat; guests start staggered so their peaks do
not all coincide.  The same workload runs under five setups and, first,
without any budget (the completion-time reference).

With `--param sweep=3,4,5,6` every variant adds guests under the same
budget until one does not fit, so `fit_guests` is measured, not inferred.

Plot of the cgroup's memory over time, one line per variant:
`python -m thinvm.bench.scenarios.overcommit plot bench/results/overcommit-STAMP.json`.
"""

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinvm.balance.backends import CgroupBudget, GivenVmsBackend, HostSource, VmBackend
from thinvm.balance.daemon import Controller, CycleReport
from thinvm.balance.model import Reclaimer, VmLimits
from thinvm.balance.policies import Policy, ThinvmParams, ThinvmPolicy, make_policy
from thinvm.bench.probe import MemoryCgroup, memory_cgroup, spawn_in
from thinvm.bench.scenarios.common import timed_by_agent
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.guest import trim as guest_trim
from thinvm.guest import workload as guest_workload
from thinvm.guest.agent import AgentClient
from thinvm.host.memory import host_meminfo, parse_vmstat
from thinvm.host.procs import process_cpu
from thinvm.units import MiB, format_size, parse_size
from thinvm.vm.machine import VM, VMConfig

FLOOR = 256 * MiB  # thinvm's: its policy reads the guest's own pressure
# The anchors (pvestatd, MOM) shrink toward free-memory targets only, so
# their deployments set a balloon minimum at what the guest needs: here the
# guest's working set at its peak (see anchor_floor()).
ANCHOR_POLICIES = ("proxmox", "mom")
SLOW = 1.2  # a guest whose work took longer than this x unconstrained did not "fit"
CONTROLLER_LOG_LINES = 400  # the controller's last actions kept in a run's record


@dataclass
class Workload:
    """One guest's phased memhog: rounds of grow / hold / free / idle."""

    rounds: int
    wss: int  # working set at the peak, bytes
    step: int  # grown per step, bytes
    step_pause: float
    hold: float
    idle: float
    read: int = 0  # read once from the guest's disk each round, bytes
    # Re-read after every growth step: the first bytes of the disk, which
    # the first round read (the guest's own hot files), bytes.
    reread: int = 0

    def __post_init__(self) -> None:
        if self.reread > self.read:
            raise ThinvmError(
                f"reread={format_size(self.reread)} is more than read="
                f"{format_size(self.read)}: the hot files are part of what the guest read"
            )

    @property
    def disk_size(self) -> int:
        return self.rounds * self.read

    @property
    def steps(self) -> int:
        return max(1, self.wss // self.step)


@dataclass(frozen=True)
class Guest:
    """One guest as the workload and the final readings reach it: its
    agent (a thinvm VM's, or a libvirt domain's channel) and whether its
    QEMU still runs.  `disk`: the guest's device of the scratch disk."""

    name: str
    agent: AgentClient
    alive: Callable[[], bool]
    disk: str = guest_workload.SCRATCH_DEVICE

    @classmethod
    def of(cls, vm: VM) -> "Guest":
        return cls(vm.config.name, vm.agent, vm.alive)


@dataclass
class GuestRun:
    name: str
    step_seconds: list[float] = field(default_factory=list)
    finished: bool = False
    error: str = ""
    oom_kills: int | None = None
    read_bytes: int = 0
    stall_us: int | None = None  # the guest's PSI memory `some` total at the end
    reread_seconds: list[float] = field(default_factory=list)
    file_refaults: int | None = None  # workingset_refault_file at the end

    @property
    def work_seconds(self) -> float:
        """Growth steps and re-reads: both slow down when memory is short."""
        return sum(self.step_seconds) + sum(self.reread_seconds)


def run_phases(
    guest: Guest, work: Workload, delay: float, out: GuestRun, stop: threading.Event
) -> None:
    """The workload of one guest, through its agent (never its QMP monitor)."""
    agent = guest.agent
    try:
        if work.read:
            guest_workload.hold_disk_open(agent, guest.disk)
        if stop.wait(delay):
            return
        for round_ in range(work.rounds):
            if work.read:
                guest_workload.read_disk(
                    agent, work.read, skip=round_ * work.read, source=guest.disk
                )
                out.read_bytes += work.read
            for k in range(work.steps):
                cmd = f"thinvm-mem hold {work.step // MiB} --pidfile /run/ph-{k}.pid"
                out.step_seconds.append(timed_by_agent(agent, cmd))
                if work.reread:
                    hot = guest_workload.read_disk_command(work.reread, source=guest.disk)
                    out.reread_seconds.append(timed_by_agent(agent, hot))
                if stop.wait(work.step_pause):
                    return
            if stop.wait(work.hold):
                return
            # A holder removes its own pid file when it exits, so a file the
            # glob found may be gone by the time rm gets to it (busybox's
            # rm -f still complains then): that is not a failure.
            agent.check(
                "for f in /run/ph-*.pid; do kill $(cat $f) 2>/dev/null; "
                "rm -f $f 2>/dev/null; done; true",
                timeout=60,
            )
            if stop.wait(work.idle):
                return
        out.finished = True
    except ThinvmError as exc:
        out.error = str(exc)[:300]


def guest_stall_us(agent: AgentClient) -> int | None:
    """Microseconds some task in the guest stalled on memory (PSI), ever."""
    try:
        text = agent.check("cat /proc/pressure/memory", timeout=30).stdout
    except ThinvmError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(f.split("=", 1) for f in line.split()[1:])
            return int(fields.get("total", 0))
    return None


def host_swapins() -> int:
    return parse_vmstat(Path("/proc/vmstat").read_text()).get("pswpin", 0)


def guest_vmstat(agent: AgentClient) -> str | None:
    try:
        return agent.check("cat /proc/vmstat", timeout=30).stdout
    except ThinvmError:
        return None


def swap_used() -> int:
    info = host_meminfo()
    return info.get("SwapTotal", 0) - info.get("SwapFree", 0)


# /var/tmp rather than /tmp, which may be a tmpfs (no swap files there).
RUN_FILES_PARENT = Path("/var/tmp")


@dataclass
class RunFiles:
    """Where one run's swap file and scratch disk live: a fresh directory of ours alone.

    /var/tmp is everyone's: a file under a name known in advance could be
    made, and kept open, by another user before the run, who would then
    read what the host swaps or the guests' disk.  mkdtemp makes the
    directory with a random name and mode 0700, and the files in it are
    created exclusively.
    """

    directory: Path | None = None

    @property
    def disk(self) -> Path:
        if self.directory is None:
            raise ThinvmError("the overcommit run's files are not set up yet")
        return self.directory / "disk.img"


def create_private_file(path: Path, size: int) -> None:
    """A new file of `size` allocated bytes (no holes: swap needs none), mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


@contextlib.contextmanager
def swap_file(size: int, directory: Path) -> Iterator[Path | None]:
    """A swap file in `directory` (a private one: RunFiles); switched off and removed after."""
    if size <= 0:
        yield None
        return
    path = directory / "swap"
    try:
        try:
            create_private_file(path, size)
        except OSError as exc:
            raise ThinvmError(f"cannot make swap file {path}: {exc.strerror}") from exc
        subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
        subprocess.run(["swapon", str(path)], check=True, capture_output=True)
        yield path
    except subprocess.CalledProcessError as exc:
        raise ThinvmError(f"swap file {path}: {exc.stderr.decode().strip()}") from exc
    finally:
        subprocess.run(["swapoff", str(path)], check=False, capture_output=True)
        path.unlink(missing_ok=True)


@dataclass
class Setup:
    """What one variant changes: the budget, reporting, the controller, and
    whether the guests' own reclaimer runs (our agent's background mode,
    which needs no host side: stock QEMU plus our guest is an anchor too)."""

    limited: bool
    reporting: bool
    policy: str | None
    reclaimer: bool = False

    @property
    def sets_bar(self) -> bool:
        """The time reference: no budget, and reporting like every budgeted
        row.  A row without budget or reporting runs beside it (what
        reporting costs the reference) without moving the bar."""
        return not self.limited and self.reporting


@dataclass
class Shared:
    """State across the variants of one scenario run."""

    # The unconstrained run's completion, by number of guests: the work
    # seconds of its slowest guest.  Its median would fail guests that are
    # merely late in the stagger (at 6 guests, 2 of the unconstrained
    # run's own guests were over 1.2x its median).
    reference_work: dict[int, float] = field(default_factory=dict)

    def reference(self, count: int) -> tuple[float, int] | None:
        """The time bar's reference for `count` guests and the count it was
        measured at.  The unconstrained run only runs the sweep's counts;
        below them (a sweep going down) the smallest count above stands in:
        more guests share the same CPUs, so its slowest guest is slower and
        the bar more lenient, which favours the variant judged, never
        thinvm against an anchor."""
        if count in self.reference_work:
            return self.reference_work[count], count
        above = [n for n in self.reference_work if n > count]
        return (self.reference_work[min(above)], min(above)) if above else None


def _boot(cgroup: MemoryCgroup, stack: contextlib.ExitStack, config: VMConfig) -> VM:
    vm = VM(config)
    with spawn_in(cgroup):
        vm.start(wait_agent=False)
    stack.callback(vm.kill)
    vm.wait_agent()
    return vm


class Sampler:
    """The cgroup's memory and the host's swap, once a second, and each
    QEMU's CPU seconds (the last reading of one the OOM killer took stays)."""

    def __init__(self, cgroup: MemoryCgroup, swap_before: int, pids: list[int]) -> None:
        self.cgroup, self.swap_before = cgroup, swap_before
        self.start = time.monotonic()
        self.t: list[float] = []
        self.usage: list[int] = []
        self.swap: list[int] = []
        self.qemu_cpu = dict.fromkeys(pids, 0.0)
        self._next = 0.0

    def maybe_sample(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + 1.0
        self.t.append(round(now - self.start, 1))
        self.usage.append(self.cgroup.usage())
        self.swap.append(max(0, swap_used() - self.swap_before))
        self.sample_cpu()

    def sample_cpu(self) -> None:
        for pid in self.qemu_cpu:
            seconds = process_cpu(pid)
            if seconds is not None:
                self.qemu_cpu[pid] = seconds


@dataclass(frozen=True)
class Plan:
    """The scenario's parameters, parsed once."""

    size: int
    guests: int
    counts: list[int]  # guest counts tried in turn (one: no sweep)
    budget: int
    swap: int
    stagger: float
    interval: float
    deadline: float
    work: Workload

    @classmethod
    def parse(cls, params: dict[str, str], size: int) -> "Plan":
        guests = int(params["guests"])
        work = Workload(
            rounds=int(params["rounds"]),
            wss=parse_size(params["wss"]),
            step=parse_size(params["step"]),
            step_pause=float(params["step_pause"]),
            hold=float(params["hold"]),
            idle=float(params["idle"]),
            read=parse_size(params.get("read", "0")),
            reread=parse_size(params.get("reread", "0")),
        )
        return cls(
            size=size,
            guests=guests,
            counts=_sweep_counts(params.get("sweep", ""), guests),
            budget=parse_size(params["budget"]),
            swap=parse_size(params["swap"]),
            stagger=float(params["stagger"]),
            interval=float(params["interval"]),
            deadline=float(params["deadline"]),
            work=work,
        )


class Overcommit:
    """One variant's measurement: N guests under the budget, or the sweep."""

    def __init__(self, opts: BenchOptions, plan: Plan) -> None:
        self.opts, self.plan = opts, plan
        self.shared = Shared()
        self.files = RunFiles()

    def config(self, name: str, setup: Setup) -> VMConfig:
        cfg = self.opts.vm_config(name, self.plan.size, reporting=setup.reporting)
        if self.plan.work.read:
            cfg.extra_args.extend(guest_workload.disk_args(self.files.disk, direct=True))
        return cfg

    def measure(self, setup: Setup, ctx: RunContext) -> Metrics:
        """One guest count, or the sweep: more guests until one does not fit."""
        counts = self.plan.counts
        if len(counts) == 1:
            return self.measure_count(setup, ctx, counts[0])
        per_count: dict[int, Metrics] = {}
        guests: dict[str, Any] = {}

        def run(count: int) -> bool:
            per_count[count] = self.measure_count(setup, ctx, count)
            guests[str(count)] = ctx.info.get("guests")
            return _all_fit(per_count[count], count)

        for count in counts:  # up, while every guest fits
            if not run(count) and setup.limited:
                break
        if setup.limited and not any(_all_fit(m, n) for n, m in per_count.items()):
            # Not even the first count fit: go down until one does, so that
            # the largest count that fits is measured, never inferred from
            # how many of a larger count happened to finish.
            for count in range(min(counts) - 1, 0, -1):
                if run(count):
                    break
        ctx.note("sweep", {str(n): m for n, m in per_count.items()})
        ctx.note("sweep_guests", guests)
        return _sweep_metrics(setup, per_count)

    def measure_count(self, setup: Setup, ctx: RunContext, count: int) -> Metrics:
        plan = self.plan
        limit = plan.budget if setup.limited else 64 * plan.size * count
        swap_before, swapins_before = swap_used(), host_swapins()
        with memory_cgroup(limit) as cgroup, contextlib.ExitStack() as stack:
            vms: list[VM] = []
            for i in range(count):
                ctx.step(f"{count} guests: booting guest {i + 1}")
                vms.append(_boot(cgroup, stack, self.config(f"oc{i}", setup)))
            guests = [Guest.of(vm) for vm in vms]
            if setup.reclaimer:
                _reclaim_in_background(guests)
            runs = [GuestRun(g.name) for g in guests]
            # Its last actions only: a long run logs a line per action.
            log: deque[str] = deque(maxlen=CONTROLLER_LOG_LINES)
            controller = _controller(setup, vms, cgroup, plan, log)
            levers = Levers()
            sampler = Sampler(cgroup, swap_before, [vm.pid or 0 for vm in vms])
            run_guests(guests, runs, controller, levers, sampler, ctx, plan)
            sampler.sample_cpu()
            if controller is not None:
                # What it did and why (targets set, trims, reclaimers
                # switched): which guest the balloon took from, and when.
                ctx.note("controller_log", list(log))
            # The reclaimers' final counters wherever one ran: under a
            # controller, or on its own (stock-reclaimer).
            reclaimed = controller is not None or setup.reclaimer
            alive = collect_final(guests, runs, levers if reclaimed else None)
            host_ooms = cgroup.oom_kills()
            peak = cgroup.max_usage()
        swapins = host_swapins() - swapins_before
        metrics = count_metrics(
            setup, count, runs, alive, host_ooms, peak, sampler, controller, ctx, self.shared,
            swapins,
        )  # fmt: skip
        return {**metrics, **levers.metrics()}


def run_guests(
    guests: list[Guest],
    runs: list[GuestRun],
    controller: Controller | None,
    levers: "Levers",
    sampler: Sampler,
    ctx: RunContext,
    plan: Plan,
) -> None:
    """Every guest's phases in a thread of its own, started `stagger`
    apart, while the controller (if any) and the sampler run."""
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=run_phases,
            args=(guest, plan.work, i * plan.stagger, runs[i], stop),
            daemon=True,
        )
        for i, guest in enumerate(guests)
    ]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    try:
        _drive(controller, levers, sampler, threads, started + plan.deadline, ctx, runs)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        if controller is not None:
            controller.backend.close()


def collect_final(guests: list[Guest], runs: list[GuestRun], levers: "Levers | None") -> list[bool]:
    """The guests' own counters at the end: OOM kills, refaults, stalls,
    and the levers' final positions where a controller moved them.  Which
    guests were still alive (asked once: a libvirt domain's state is a
    virsh call)."""
    alive = [guest.alive() for guest in guests]
    for guest, run, up in zip(guests, runs, alive, strict=True):
        if not up:
            continue  # its counters stay None
        vmstat = guest_vmstat(guest.agent)
        if vmstat is not None:
            counters = parse_vmstat(vmstat)
            run.oom_kills = counters.get("oom_kill")
            run.file_refaults = counters.get("workingset_refault_file")
        run.stall_us = guest_stall_us(guest.agent)
        if levers is not None:
            levers.read_final(guest)
    return alive


REPORTING = "free page reporting"
VARIANTS = [
    # The reference reports too: every budgeted row does, and reported
    # memory is faulted in again on reuse, which is not the budget's cost.
    (
        "unconstrained",
        Setup(False, True, None),
        f"no budget: the time reference; {REPORTING}",
    ),
    (
        "unconstrained-no-reporting",
        Setup(False, False, None),
        "no budget, no reporting: the time reference until 2026-11-29, measured beside it",
    ),
    ("stock", Setup(True, False, None), "budget; no reporting, no controller"),
    ("reporting", Setup(True, True, None), f"budget; {REPORTING} only"),
    (
        "stock-reclaimer",
        Setup(True, True, None, reclaimer=True),
        f"budget; {REPORTING} + the guests' reclaimer in background mode, no host controller",
    ),
    ("proxmox", Setup(True, True, "proxmox"), f"{REPORTING} + pvestatd rules"),
    ("mom", Setup(True, True, "mom"), f"{REPORTING} + oVirt MOM rules"),
    ("thinvm", Setup(True, True, "thinvm"), f"{REPORTING} + thinvm balance"),
    (
        "thinvm-eager",
        Setup(True, True, "thinvm-eager"),
        f"{REPORTING} + thinvm balance shrinking free memory on a calm host too",
    ),
]


def make_overcommit(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    plan = Plan.parse(params, size)
    bench = Overcommit(opts, plan)

    def variant(name: str, setup: Setup, text: str) -> Variant:
        return Variant(name, lambda ctx: bench.measure(setup, ctx), text)

    return Scenario(
        name="overcommit",
        title="guests overcommitted under a memory budget: balloon policies",
        description=describe(plan),
        variants=[variant(name, setup, text) for name, setup, text in VARIANTS],
        main_metric="fit_guests",
        second_metric="work_s",
        baseline="stock",
        params=plan_params(plan, opts.kernel),
        context=lambda: run_files(bench.files, plan.swap, plan.work.disk_size),
        targets=density_targets(),
    )


DENSITY_ANCHORS = ("reporting", "stock-reclaimer", "proxmox", "mom")


def density_targets(issue: str = "issue 48") -> list[Target]:
    """thinvm fits at least 1.5x the guests of every anchor (a fit counts no
    OOM kill): each anchor's count over thinvm's at most 1/1.5."""
    return [
        Target(
            f"{issue}: thinvm fits at least 1.5x as many guests as {anchor}, "
            "every guest within the bar with 0 OOM kills",
            anchor,
            "thinvm",
            "fit_guests",
            at_most=1 / 1.5,
        )
        for anchor in DENSITY_ANCHORS
    ]


def describe(plan: Plan) -> str:
    """The scenario's description in the docs: what the guests do and how
    a run is judged."""
    work, counts = plan.work, plan.counts
    read = (
        f"read {format_size(work.read)} of its disk once (cold page cache), " if work.read else ""
    )
    reread = (
        f", re-reading its hot files, the first {format_size(work.reread)} of "
        "the disk, after each step"
        if work.reread
        else ""
    )
    reread_s = (
        " and re-reads (`reread_s`; `file_refaults` counts hot pages the guest "
        "had to read again from its disk)"
        if work.reread
        else ""
    )
    sweep = (
        f"Guest counts {', '.join(map(str, counts))} are tried in turn until "
        "one does not fit, and if the first does not, smaller counts down to one "
        "until one does; `fit_guests` is the largest count at which every guest "
        "fit (a run's own figure; the table gives the median over runs). Below the "
        "sweep's counts, which the unconstrained run alone runs, the bar comes from "
        "the smallest count above (`bar_from_guests`): a slower reference, so a more "
        "lenient bar for the variant going down. "
        if len(counts) > 1
        else ""
    )
    return (
        f"{plan.guests} guests of {format_size(plan.size)} (together "
        f"{format_size(plan.guests * plan.size)}) share a cgroup-v1 memory budget of "
        f"{format_size(plan.budget)}, with a {format_size(plan.swap)} swap file so going "
        f"over it is slow rather than fatal. Each guest, started {plan.stagger:g} s after "
        f"the previous one, runs {work.rounds} round(s) of: {read}grow a working set to "
        f"{format_size(work.wss)} in {format_size(work.step)} steps "
        f"({work.step_pause:g} s apart{reread}), hold it {work.hold:g} s, free it, idle "
        f"{work.idle:g} s. `work_s` is the median over guests of the time spent "
        f"in the growth steps{reread_s}, timed by the guest's clock (what slows down when "
        "the host swaps or the guest "
        f"waits for its balloon); `fit_guests` counts guests that finished with "
        f"no guest or host OOM kill and its own work within {SLOW}x of the "
        "unconstrained run's completion (its slowest guest) with as many guests. "
        f"{sweep}`steps_done`, `guest_stall_s` (median PSI memory stall per guest) and "
        "`host_swapin_bytes` say how the work went whatever the machine's load; "
        "`qemu_cpu_s` is what the guests cost the host (every QEMU process, boot to the "
        "pass's end), `controller_cpu_s` the host controller's cycles and "
        "`reclaimer_cpu_s` the guests' reclaim work. "
        "Controllers run every "
        f"{plan.interval:g} s; thinvm's keeps a floor of {format_size(FLOOR)} and "
        "reads the guests' pressure, the anchors (proxmox, mom) keep the minimum their "
        f"operators set, the guest's working set ({format_size(anchor_floor('mom', work.wss))}); "
        "their per-10-s rate caps are scaled to that interval. `stock-reclaimer` runs "
        "no host controller: each guest's own reclaimer (our agent, background mode, "
        "as packaged) gives its cold cache back through reporting. The cgroup's memory over "
        "time is in the result JSON (`info.series`) and in the memory plot."
    )


def plan_params(plan: Plan, kernel: str) -> dict[str, Any]:
    work = plan.work
    return {
        "guests": plan.guests,
        "sweep": ",".join(map(str, plan.counts)),
        "read": format_size(work.read),
        "reread": format_size(work.reread),
        "size": format_size(plan.size),
        "budget": format_size(plan.budget),
        "swap": format_size(plan.swap),
        "rounds": work.rounds,
        "wss": format_size(work.wss),
        "step": format_size(work.step),
        "step_pause_s": work.step_pause,
        "hold_s": work.hold,
        "idle_s": work.idle,
        "stagger_s": plan.stagger,
        "interval_s": plan.interval,
        "kernel": kernel,
    }


@contextlib.contextmanager
def run_files(
    files: RunFiles, swap: int, disk_size: int, parent: Path = RUN_FILES_PARENT
) -> Iterator[None]:
    """The swap file and the guests' shared scratch disk, in a fresh private
    directory under `parent` (set in `files` meanwhile), all removed after."""
    directory = Path(tempfile.mkdtemp(prefix="thinvm-overcommit-", dir=parent))
    files.directory = directory
    try:
        with swap_file(swap, directory):
            if disk_size:
                create_private_file(files.disk, 0)
                guest_workload.scratch_disk(files.disk, disk_size)
            yield
    finally:
        files.directory = None
        shutil.rmtree(directory, ignore_errors=True)


def _sweep_counts(text: str, guests: int) -> list[int]:
    if not text:
        return [guests]
    try:
        counts = sorted({int(n) for n in text.split(",")})
    except ValueError as exc:
        raise ThinvmError(f"sweep={text!r}: want guest counts like 3,4,5") from exc
    if counts[0] < 1:
        raise ThinvmError(f"sweep={text!r}: guest counts start at 1")
    return counts


def _all_fit(metrics: Metrics, count: int) -> bool:
    """Every one of `count` guests finished within the bar, no OOM kill."""
    return metrics["fit_guests"] == count


def _sweep_metrics(setup: Setup, per_count: dict[int, Metrics]) -> Metrics:
    """The sweep's result: the largest count at which every guest fit (0 if
    none did, down to one guest), and the figures of the largest count run."""
    largest = max(per_count)
    fitting = [n for n, m in per_count.items() if _all_fit(m, n)]
    metrics = dict(per_count[largest])
    metrics["fit_guests"] = max(fitting) if fitting else 0
    metrics["guests_tried"] = largest
    return metrics


def _reclaim_in_background(guests: list[Guest]) -> None:
    """Switch each guest's reclaimer to background mode, as the packaged
    agent runs it by default; a guest whose agent refuses fails the run."""
    for guest in guests:
        if guest_trim.set_background(guest.agent, True) is None:
            raise ThinvmError(f"{guest.name}: the guest agent has no reclaimer")


def anchor_floor(policy: str | None, wss: int) -> int:
    """The balloon floor a variant's controller keeps: what an operator of
    Proxmox or oVirt sets as the VM's minimum (the guest's working set) for
    the anchors, thinvm's default otherwise."""
    return max(FLOOR, wss) if policy in ANCHOR_POLICIES else FLOOR


def _controller(
    setup: Setup, vms: list[VM], cgroup: MemoryCgroup, plan: "Plan", log: deque[str]
) -> Controller | None:
    if setup.policy is None:
        return None
    return make_controller(
        setup.policy, GivenVmsBackend(vms), CgroupBudget(cgroup.path.name), plan, log
    )


def make_controller(
    policy_name: str, backend: VmBackend, budget: HostSource, plan: "Plan", log: deque[str]
) -> Controller:
    """The variant's controller over `backend`'s guests, sharing `budget`:
    its policy, and the balloon floor its operators set."""
    policy: Policy
    if policy_name == "thinvm-eager":
        policy = ThinvmPolicy(ThinvmParams(leave_reported_free=False))
    else:
        policy = make_policy(policy_name)
    floor = anchor_floor(policy_name, plan.work.wss)
    return Controller(
        backend,
        budget,
        policy,
        interval=plan.interval,
        default_limits=lambda memory: VmLimits(min(floor, memory), memory),
        log=log.append,
    )


@dataclass
class Levers:
    """What the controller did besides the balloon, from its cycle reports:
    where a guest's refaulted pages came from is otherwise a guess."""

    trims: int = 0
    trim_bytes: int = 0  # asked for; the guest takes what is above its floor
    reclaimers: dict[str, Reclaimer] = field(default_factory=dict)  # last counters
    controller_cpu: float = 0.0  # the controller's cycles, this thread's clock

    def add(self, report: CycleReport) -> None:
        for decision in report.decisions:
            if decision.trim:
                self.trims += 1
                self.trim_bytes += decision.trim
        for sample in report.samples:
            if sample.reclaimer is not None:
                self.reclaimers[sample.name] = sample.reclaimer

    def read_final(self, guest: Guest) -> None:
        """The reclaimer's counters at the end: the controller reads them
        at most every 30 s, and a pass is about two minutes."""
        with contextlib.suppress(ThinvmError, OSError, ValueError):
            counters = guest_trim.reclaimer_status(guest.agent, timeout=10.0)
            if counters is not None:
                self.reclaimers[guest.name] = Reclaimer.from_counters(counters)

    def metrics(self) -> Metrics:
        last = self.reclaimers.values()
        return {
            "trim_requests": self.trims,
            "trim_requested_bytes": self.trim_bytes,
            # The guests' reclaimers, background and trims together; refaults
            # are those seen while a reclaimer ran.
            "reclaimed_bytes": sum(r.reclaimed_bytes for r in last),
            "reclaimer_refault_pages": sum(r.refault_pages for r in last),
            # What reclaiming cost the guests: CPU of a TCG vCPU the
            # workload did not get (steps and compactions, as counted last).
            "reclaimer_cpu_s": sum(r.cpu_ms for r in last) / 1000,
            "reclaimer_compactions": sum(r.compactions for r in last),
            # Large frees the guests had reported at once (our driver only).
            "reclaimer_freed_reports": sum(r.freed_reports for r in last),
            # The host's side of the policy: the controller's cycles (QMP,
            # the guests' statistics, its decisions), 0 without one.
            "controller_cpu_s": round(self.controller_cpu, 3),
        }


def _drive(
    controller: Controller | None,
    levers: Levers,
    sampler: Sampler,
    threads: list[threading.Thread],
    deadline: float,
    ctx: RunContext,
    runs: list[GuestRun],
) -> None:
    """Cycle the controller (this thread owns every QMP monitor) and sample."""
    next_cycle = time.monotonic()
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if now > deadline:
            ctx.note("deadline_hit", True)
            return
        sampler.maybe_sample()
        if controller is not None and now >= next_cycle:
            began = time.thread_time()
            with contextlib.suppress(ThinvmError, OSError):
                levers.add(controller.step())
            levers.controller_cpu += time.thread_time() - began
            next_cycle = now + controller.interval
        done = sum(len(r.step_seconds) for r in runs)
        ctx.step(
            f"{done} steps done, cgroup {format_size(sampler.usage[-1] if sampler.usage else 0)}"
        )
        time.sleep(0.1)


def count_metrics(
    setup: Setup,
    count: int,
    runs: list[GuestRun],
    alive: list[bool],
    host_ooms: int,
    peak: int,
    sampler: Sampler,
    controller: Controller | None,
    ctx: RunContext,
    shared: Shared,
    swapins: int,
) -> Metrics:
    works = [r.work_seconds for r in runs if r.finished]
    work = statistics.median(works) if works else None
    if setup.sets_bar and works:
        shared.reference_work[count] = max(works)
    guest_ooms = sum(r.oom_kills or 0 for r in runs)
    fit: int | None = None
    bar = shared.reference(count)
    if bar is not None:
        limit = SLOW * bar[0]
        fit = sum(
            1
            for r, up in zip(runs, alive, strict=True)
            if up and r.finished and not r.oom_kills and r.work_seconds <= limit
        )
    ctx.note("series", {"t": sampler.t, "usage": sampler.usage, "swap": sampler.swap})
    ctx.note(
        "guests",
        [
            {
                "name": r.name,
                "finished": r.finished,
                "work_s": round(r.work_seconds, 2),
                "steps": len(r.step_seconds),
                "oom_kills": r.oom_kills,
                "stall_s": r.stall_us / 1e6 if r.stall_us is not None else None,
                "read_bytes": r.read_bytes,
                "reread_s": round(sum(r.reread_seconds), 2),
                "file_refaults": r.file_refaults,
                "error": r.error,
            }
            for r in runs
        ],
    )
    stalls = [r.stall_us / 1e6 for r in runs if r.stall_us is not None]
    rereads = [sum(r.reread_seconds) for r in runs if r.finished and r.reread_seconds]
    refaults = [r.file_refaults for r in runs if r.file_refaults is not None]
    return {
        "guests": count,
        "fit_guests": fit,
        "finished_guests": sum(1 for r in runs if r.finished),
        # What the guests got done, whatever the machine's load: growth
        # steps completed, and the time they stalled on memory (PSI).
        "steps_done": sum(len(r.step_seconds) for r in runs),
        "guest_stall_s": round(statistics.median(stalls), 2) if stalls else None,
        "host_swapin_bytes": swapins * 4096,
        # The hot files: time re-reading them, and pages that had to come
        # from the disk again (a trim or the host's pressure took them).
        "reread_s": round(statistics.median(rereads), 2) if rereads else None,
        "file_refaults": sum(refaults) if refaults else None,
        "work_s": work,
        "work_max_s": max(works) if works else None,
        "guest_oom_kills": guest_ooms,
        "host_oom_kills": host_ooms,
        "swap_peak_bytes": max(sampler.swap, default=0),
        "peak_bytes": peak,
        "mean_bytes": int(statistics.mean(sampler.usage)) if sampler.usage else None,
        "balloon_actions": controller.actions if controller is not None else 0,
        # The guest count whose unconstrained run set the time bar.
        "bar_from_guests": bar[1] if bar is not None else None,
        # What running the guests cost the host: every QEMU process, vCPUs
        # included, from its boot to the pass's end.
        "qemu_cpu_s": round(sum(sampler.qemu_cpu.values()), 2),
    }


def plot_memory(result_path: Path) -> Path:
    """One line per variant: the cgroup's memory over time (first run of each)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(result_path.read_text())
    fig, ax = plt.subplots(figsize=(9, 4.5))
    seen: set[str] = set()
    for run in result["runs"]:
        series = run.get("info", {}).get("series")
        if not series or run["variant"] in seen:
            continue
        seen.add(run["variant"])
        ax.plot(series["t"], [u / 2**30 for u in series["usage"]], label=run["variant"])
    budget = parse_size(str(result["params"]["budget"]).replace(" ", ""))
    ax.axhline(budget / 2**30, color="grey", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("seconds since the workload started")
    ax.set_ylabel("cgroup memory (GiB)")
    ax.set_title("overcommit: guests' host memory over time")
    ax.legend()
    out = result_path.with_name(result_path.stem + "-memory.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "plot":
        print(plot_memory(Path(argv[1])))
        return 0
    print("usage: python -m thinvm.bench.scenarios.overcommit plot RESULT.json", file=sys.stderr)
    return 2


SPEC = ScenarioSpec(
    name="overcommit",
    title="overcommitted guests under a budget: stock, reporting, proxmox, mom, thinvm",
    make=make_overcommit,
    default_size="1G",
    size_help="RAM per guest",
    default_runs=1,
    params={
        "guests": "4",
        "budget": "2G",
        "swap": "2G",
        "rounds": "2",
        "wss": "640M",
        "step": "64M",
        "step_pause": "0.5",
        "hold": "4",
        "idle": "8",
        "stagger": "10",
        "interval": "1",
        "deadline": "600",
        "read": "0",
        "reread": "0",
        "sweep": "",
    },
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
