"""`thinvm bench fleet-working-set`: guests that stay trimmed, moved by
plain virsh between package-installed hosts (issue 47).

Three Debian guests from plain XML (thinvm.fleet.domain, no `qemu:`
namespace, no sparse-ram capability) run on one package-installed,
systemd-booted host of the TLS cluster (`cluster up --packaged --systemd
--hosts 4`: h1 and h2 `apt install thinvm-qemu`, h3 and h4 keep Debian's
QEMU).  Each guest reads its data set once from a read-only disk, reads
a hot subset of it a few more times and holds an anonymous pattern; then
the hosts run, for the same window in every variant, whatever the
variant runs in the background while the guests keep reading their hot
subsets now and then (nobody trims at migration time, and no step before
the window does either).  Each guest then moves with plain
`virsh migrate --live --p2p --tls` to the other host of its pair, is
checked there (its pattern, its hot subset re-read), and moves back with
`--parallel`.

Each host of a pair has a CPU of its own (its cgroup's cpuset): the
source host's libvirtd, QEMUs and vCPUs on one, the destination's on the
other, as two machines would be.

Variants:

- stock-best: Debian's QEMU (h3 -> h4), the guest kernel's virtio_balloon,
  free page reporting, the guest agent's reclaimer switched off; plain
  virsh, then `--parallel` (multifd, 2 channels): the configurations that
  won the stock rows without and with `--parallel` in fleet-migrate.
- stock-reclaimer: the same with our guest agent's reclaimer in its
  packaged default, background mode: what the guest side alone achieves
  on stock parts.
- thinvm: thinvm-qemu (h1 -> h2) with the thinvm machine type, our
  driver, reporting, and thinvm-balance.service enabled on both hosts as
  packaged (`apt install thinvm`, `systemctl enable --now`), the agent's
  reclaimer left at its packaged default (on).
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from thinvm.bench.cpu import KINDS, MigrationCpu
from thinvm.bench.scenarios import fleet as fleet_bench
from thinvm.bench.scenarios import hostcpus
from thinvm.bench.scenarios.common import timed_by_agent
from thinvm.bench.scenarios.fleet import CHANNELS, FleetRun
from thinvm.bench.scenarios.params import float_param, int_param, size_param
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.workingset import DATA_SOURCES, DataDisk, mount_command
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, guest, migrate
from thinvm.fleet.cluster import ClusterState, Host, virsh
from thinvm.guest import image as guest_image
from thinvm.guest import trim, workload
from thinvm.guest.trim import ReclaimerClock, set_background
from thinvm.host.memory import process_memory
from thinvm.units import MiB, format_size
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

NAME = "fleet-working-set"
CLUSTER = "packaged"  # a key of fleet_bench.CLUSTERS
# "bench-": the quiet gate tells the harness's own libvirt guests by it.
GUESTS = ("bench-ws-1", "bench-ws-2", "bench-ws-3")
SEED = 4747
PATTERN = "/dev/shm/thinvm-bench-pattern"
# The data set: a file on a read-only ext4 disk, as migrate-working-set's.
DATA = DATA_SOURCES["debian"]
CONTROLLER = "thinvm-balance.service"
SAMPLE_EVERY = 30.0  # seconds between progress lines in the window


@dataclass(frozen=True)
class Workload:
    """What each guest does before the window, in bytes."""

    data: int  # read once: the cold data set
    hot: int  # the first `hot` bytes of it, read `passes` times
    anon: int  # a pattern in tmpfs, verified after each migration
    passes: int  # 5: MGLRU (6.12) keeps a page read five times (workingset.Plan)
    window: float  # seconds every variant's background work runs before
    hot_every: float  # in the window, seconds between reads of the hot subset (0: none)


@dataclass(frozen=True)
class Side:
    """What a variant runs: the guests' stack, and what works in the
    background during the window."""

    stack: Stack
    reclaimer: bool  # the guest agent's background reclaim (packaged default: on)
    controller: bool  # thinvm-balance.service on both hosts of the pair

    def run(self, name: str) -> FleetRun:
        return FleetRun(self.stack, cluster=CLUSTER, name=name)


# Plain XML on the thinvm machine type: page ranges come with it, and the
# main channel and multifd skip without the sparse-ram capability.
THINVM_PLAIN = replace(THINVM, sparse=False)
SIDES = {
    "stock-best": Side(STOCK_BEST, reclaimer=False, controller=False),
    "stock-reclaimer": Side(STOCK_BEST, reclaimer=True, controller=False),
    "thinvm": Side(THINVM_PLAIN, reclaimer=True, controller=True),
}


def make_workload(params: dict[str, str], size: int) -> Workload:
    work = Workload(
        data=size_param(params, "data") // MiB * MiB,
        hot=size_param(params, "hot") // MiB * MiB,
        anon=size_param(params, "anon") // MiB * MiB,
        passes=int_param(params, "passes"),
        window=float_param(params, "window"),
        hot_every=float_param(params, "hot_every"),
    )
    if min(work.data, work.hot, work.anon) < MiB or work.hot > work.data:
        raise ThinvmError("--param data, hot, anon: at least 1M each, hot within data")
    if work.data + work.anon + 512 * MiB > size:
        raise ThinvmError(
            f"a {format_size(size)} guest cannot hold {format_size(work.data)} of data and "
            f"{format_size(work.anon)} of its own with 512 MiB to spare: pass a bigger --size"
        )
    if work.passes < 1 or work.window < 0 or work.hot_every < 0:
        raise ThinvmError("--param passes: at least 1; window, hot_every: 0 or more seconds")
    return work


# -- the hosts ----------------------------------------------------------------


def ensure_controller(state: ClusterState, name: str) -> None:
    """thinvm-balance.service running on a thinvm host, as packaged."""
    if _systemctl(state, name, "is-active", CONTROLLER) == "active":
        return
    cluster.host_apt(state, name, "install", "--no-install-recommends", "thinvm")
    _systemctl(state, name, "enable", "--now", CONTROLLER)
    if _systemctl(state, name, "is-active", CONTROLLER) != "active":
        raise ThinvmError(f"{name}: {CONTROLLER} did not start")


def _systemctl(state: ClusterState, name: str, *args: str) -> str:
    return cluster.host_run(state, name, ["systemctl", "--no-pager", *args]).stdout.strip()


# -- one guest ------------------------------------------------------------------


def define_guest(h: Host, side: Side, name: str, size: int, kernel: str, data: Path) -> None:
    """The domain from plain XML, and the data set's disk attached as an
    operator attaches one (read-only, raw, no host cache)."""
    image = guest_image.ensure_disk_image(kernel)
    shared = cluster.shared_dir(Path(h.root).parent.parent)
    guest.define(h, side.run(name).domain(image, size, shared), image)
    disk = ["--config", "--mode", "readonly", "--targetbus", "virtio"]
    disk += ["--driver", "qemu", "--subdriver", "raw", "--cache", "none"]
    virsh(h, "attach-disk", name, str(data), DATA.device, *disk)


def load_guest(h: Host, side: Side, name: str, work: Workload) -> Metrics:
    """Driver and reclaimer as the variant has them; the pattern, one
    read of the data set, the hot passes."""
    client = guest.agent(h, name)
    try:
        if side.stack.driver == "stock":
            guest.use_intree_driver(client)
        if not side.reclaimer:
            set_background(client, False)
        source = DATA.path
        client.check(mount_command(DATA))
        client.check(f"thinvm-mem pattern write {PATTERN} {work.anon // MiB} --seed {SEED}")
        cold = timed_by_agent(client, workload.read_disk_command(work.data, source=source), 600)
        hot = workload.read_disk_command(work.hot, passes=work.passes, source=source)
        timed_by_agent(client, hot, 600)
        return {"cold_read_ms": cold * 1000}
    finally:
        client.close()


def check_arrived(h: Host, name: str, work: Workload) -> float:
    """The pattern intact on `h`; the seconds a re-read of the hot subset
    took there (what the background work cost the guest)."""
    client = guest.agent(h, name)
    try:
        check = client.check(f"thinvm-mem pattern verify {PATTERN} --seed {SEED}").json()
        if check["bad"] != 0 or check["pages"] != work.anon // 4096:
            raise ThinvmError(f"{name}: data changed in migration: {check}")
    finally:
        client.close()
    return read_hot(h, name, work)


def read_hot(h: Host, name: str, work: Workload) -> float:
    """The seconds one read of the hot subset takes in `name` on `h`."""
    client = guest.agent(h, name)
    try:
        return timed_by_agent(client, workload.read_disk_command(work.hot, source=DATA.path))
    finally:
        client.close()


def reclaimer_clocks(h: Host) -> list[ReclaimerClock]:
    """Every guest's reclaimer counters on `h`, in GUESTS' order."""
    clocks = []
    for name in GUESTS:
        client = guest.agent(h, name)
        try:
            clocks.append(ReclaimerClock.read(client))
        finally:
            client.close()
    return clocks


# -- one run ----------------------------------------------------------------------


@dataclass
class Leg:
    """The three guests' migrations one way: sums, and the worst downtime."""

    prefix: str  # "" for plain virsh, "parallel_" for --parallel
    migration_ms: float = 0.0
    transferred_bytes: int = 0
    downtime_ms: float = 0.0
    # The source CPU by thread kind (thinvm.bench.cpu.KINDS), which adds up
    # to all of it: how much is the migration thread sending, how much the
    # guests' vCPUs.
    src_kind_cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    skipped_pages: int = 0
    hot_reread_ms: float = 0.0

    def add(self, result: migrate.MigrationResult, cpu: Metrics, hot_s: float) -> None:
        self.migration_ms += result.seconds * 1000
        self.transferred_bytes += migrate.job_bytes(result.job) or 0
        downtime = fleet_bench.job_ms(result.job, "Total downtime") or 0.0
        self.downtime_ms = max(self.downtime_ms, downtime)
        for kind in KINDS:
            self.src_kind_cpu_s[kind] += float(cpu.get(f"src_{kind}_cpu_s") or 0.0)
        self.skipped_pages += int(result.ram.get("sparse-skipped", 0))
        self.hot_reread_ms += hot_s * 1000

    @property
    def metrics(self) -> Metrics:
        p = self.prefix
        return {
            f"{p}migration_ms": round(self.migration_ms, 1),
            f"{p}transferred_bytes": self.transferred_bytes,
            f"{p}downtime_ms": self.downtime_ms,
            f"{p}src_cpu_s": round(sum(self.src_kind_cpu_s.values()), 3),
            **{f"{p}src_{k}_cpu_s": round(v, 3) for k, v in self.src_kind_cpu_s.items()},
            f"{p}sparse_skipped_pages": self.skipped_pages,
            f"{p}hot_reread_ms": round(self.hot_reread_ms, 1),
        }


def move_all(
    ctx: RunContext, src: Host, dst: Host, work: Workload, leg: Leg, parallel: int
) -> None:
    """Each guest from `src` to `dst`, one after the other, as an operator
    drains a host; each checked on arrival."""
    how = f"--parallel-connections {parallel}" if parallel else "plain"
    for name in GUESTS:
        ctx.step(f"virsh migrate --live --p2p --tls ({how}) {name}: {src.name} -> {dst.name}")
        with MigrationCpu(guest.qemu_pid(src, name), None) as cpu:
            result = migrate.migrate(src, dst, name, parallel=parallel)
        leg.add(result, cpu.metrics, check_arrived(dst, name, work))


def hosts_rss(h: Host) -> int:
    return sum(process_memory(guest.qemu_pid(h, name)).rss for name in GUESTS)


def run_window(ctx: RunContext, src: Host, work: Workload) -> None:
    """The window every variant gets: nobody trims; each guest keeps using
    its hot subset (a read every `hot_every` seconds), as a hot set is
    used, while its cold data set lies idle."""
    end = time.monotonic() + work.window
    every = work.hot_every or math.inf
    next_read, reads = time.monotonic() + every, 0
    while (left := end - time.monotonic()) > 0:
        if time.monotonic() >= next_read:
            for name in GUESTS:
                read_hot(src, name, work)
            reads += 1
            next_read += every
        ctx.step(f"background window: {left:.0f} s left, hot subset read {reads} times, "
                 f"guests' RSS {format_size(hosts_rss(src))}")  # fmt: skip
        now = time.monotonic()
        time.sleep(max(0.0, min(SAMPLE_EVERY, next_read - now, end - now)))


def prepare(ctx: RunContext, src: Host, side: Side, work: Workload) -> Metrics:
    """Boot the three guests, then load each."""
    ctx.step(f"booting {len(GUESTS)} Debian guests on {src.name}")
    start = time.monotonic()
    for name in GUESTS:
        virsh(src, "start", name)
    for name in GUESTS:
        guest.wait_booted(src, name, timeout=600)
    boot = time.monotonic() - start
    cold = 0.0
    for name in GUESTS:
        ctx.step(f"{name}: writes its pattern, reads {format_size(work.data)} once, "
                 f"the hot {format_size(work.hot)} {work.passes} times")  # fmt: skip
        cold += float(load_guest(src, side, name, work)["cold_read_ms"] or 0.0)
    return {"boot_s": round(boot, 1), "cold_read_ms": round(cold, 1)}


def measure(ctx: RunContext, src: Host, dst: Host, side: Side, work: Workload) -> Metrics:
    metrics = prepare(ctx, src, side, work)
    opened, start = reclaimer_clocks(src), time.monotonic()
    run_window(ctx, src, work)
    closed = reclaimer_clocks(src)
    if any(clock.background != side.reclaimer for clock in closed):
        raise ThinvmError(f"a guest's reclaimer is not {'on' if side.reclaimer else 'off'}")
    # Work and steps from the guests' boot (the load included: nothing the
    # reclaimers did before the window is left out), the thread's share of
    # a vCPU over the window itself.
    window = time.monotonic() - start
    booted = [ReclaimerClock(clock.background, 0, 0, 0) for clock in closed]
    metrics.update(trim.reclaimer_usage(booted, closed, window))
    metrics["reclaimer_thread_cpu_pct"] = trim.thread_share_pct(opened, closed, window)
    metrics["src_rss_bytes"] = hosts_rss(src)
    placement = {src.name: hostcpus.allowed_cpus(guest.qemu_pid(src, GUESTS[0]))}
    plain, parallel = Leg(""), Leg("parallel_")
    move_all(ctx, src, dst, work, plain, 0)
    metrics["dst_rss_bytes"] = hosts_rss(dst)
    # Which CPUs each side's QEMU may run on: the pairing held.
    ctx.note(
        "qemu_cpus", {**placement, dst.name: hostcpus.allowed_cpus(guest.qemu_pid(dst, GUESTS[0]))}
    )
    move_all(ctx, dst, src, work, parallel, CHANNELS)
    return {**metrics, **plain.metrics, **parallel.metrics}


def _clean(state: ClusterState, hosts: tuple[Host, ...]) -> None:
    for h in hosts:
        for name in GUESTS:
            guest.remove(h, name)


def _run_one(
    opts: BenchOptions, size: int, work: Workload, side: Side, disk: DataDisk
) -> Callable[[RunContext], Metrics]:
    def run(ctx: RunContext) -> Metrics:
        state = fleet_bench.clusters.get(CLUSTER)
        route = side.run(GUESTS[0]).route
        src, dst = (state.host(n) for n in route)
        if opts.pin_sides:  # --unpinned leaves both hosts on every CPU
            hostcpus.pin_pair(src, dst)
        if side.controller:
            ctx.step(f"{CONTROLLER} on {src.name} and {dst.name}")
            for h in (src, dst):
                ensure_controller(state, h.name)
        data = _data_disk(src, disk)
        for name in GUESTS:
            define_guest(src, side, name, size, opts.kernel, data)
        try:
            return measure(ctx, src, dst, side, work)
        finally:
            _clean(state, (src, dst))

    return run


def _data_disk(h: Host, disk: DataDisk) -> Path:
    """The data set's disk in the cluster's shared storage, made at the
    scenario's first run and removed before the clusters go."""
    if disk.path is None:
        shared = cluster.shared_dir(Path(h.root).parent.parent)
        fleet_bench.clusters.hold(disk.made(shared))
    assert disk.path is not None
    return disk.path


def make_fleet_working_set(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    work = make_workload(params, size)
    link = params["link"]
    disk = DataDisk(work.data, "debian")
    variants = [
        Variant(name, _run_one(opts, size, work, side, disk), describe(side),
                reference="stock-reclaimer" if name == "thinvm" else None)
        for name, side in SIDES.items()
    ]  # fmt: skip
    return Scenario(
        name=NAME,
        title="guests kept trimmed, moved by plain virsh: thinvm, stock-best, stock + reclaimer",
        description=description(work, size, link, opts.kernel),
        variants=variants,
        best=[],
        baseline="stock-best",
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "guests": len(GUESTS),
            "data": format_size(work.data),
            "hot": format_size(work.hot),
            "anon": format_size(work.anon),
            "passes": work.passes,
            "window_s": work.window,
            "hot_every_s": work.hot_every,
            "link": link,
            "channels": CHANNELS,
            "kernel": opts.kernel,
            "pinned": opts.pin_sides,
        },
        context=lambda: fleet_bench.cluster_session(link),
        targets=targets(),
    )


def describe(side: Side) -> str:
    parts = [side.stack.describe()]
    parts.append("guest reclaimer in background mode" if side.reclaimer else "guest reclaimer off")
    if side.controller:
        parts.append(f"{CONTROLLER} enabled on both hosts")
    return "; ".join(parts)


def description(work: Workload, size: int, link: str, kernel: str) -> str:
    return (
        f"Package-installed, systemd-booted hosts over TLS (`cluster up --packaged --systemd "
        f"--hosts 4 --link {link}`; h1, h2 with thinvm-qemu, h3, h4 Debian's QEMU), each host "
        f"of a pair on a CPU of its own (cpuset: source {hostcpus.SOURCE_CPU}, "
        f"destination {hostcpus.DESTINATION_CPU}). {len(GUESTS)} Debian 12 guests of "
        f"{format_size(size)} (kernel "
        f"{kernel}) from plain XML, each with a read-only data disk, write a "
        f"{format_size(work.anon)} pattern to tmpfs, read {format_size(work.data)} of a file "
        f"once and its first {format_size(work.hot)} {work.passes} times; then "
        f"{work.window:g} s pass in which only the variant's background work runs (no trim "
        f"at any point) while each guest reads its hot subset again every "
        f"{work.hot_every:g} s (0: never) and leaves the rest of its data idle. "
        "Each guest then moves with plain `virsh migrate --live --p2p --tls` "
        "(figures without a prefix: sums over the guests, downtime the worst guest's), is "
        "checked on arrival (pattern; `hot_reread_ms`: its hot subset read again there), and "
        f"moves back with `--parallel --parallel-connections {CHANNELS}` (`parallel_` "
        "figures). `src_rss_bytes`: the guests' QEMUs' RSS on the source at the window's "
        "end; `src_cpu_s`: the source QEMUs' CPU during their migrations, and "
        "`src_migration_cpu_s`, `src_vcpu_cpu_s`, `src_multifd_cpu_s`, `src_other_cpu_s` "
        "its parts by thread (thinvm.bench.cpu; older records lack them); "
        "`reclaimer_thread_cpu_s` the guests' reclaimer threads' whole CPU from boot to the "
        "window's end (`reclaim_work_cpu_s` and `reclaim_steps` its reclaiming part), "
        "`reclaimer_thread_cpu_pct` a thread's mean share of one vCPU over the window "
        "(records before 2026-11-29 gave only the work, as `reclaimer_cpu_s`). stock-best is not "
        "chosen per run: it is the configuration that won fleet-migrate's stock rows "
        "(reporting, and multifd for --parallel)."
    )


def targets() -> list[Target]:
    def against(reference: str, metric: str, at_most: float, label: str) -> Target:
        return Target(f"issue 47: {label}", "thinvm", reference, metric, at_most=at_most)

    return [
        against("stock-best", "transferred_bytes", 1 / 3, "bytes at most 1/3 of stock-best's"),
        against("stock-best", "migration_ms", 1 / 2.5, "at least 2.5x faster than stock-best"),
        against("stock-best", "parallel_migration_ms", 1 / 2.5,
                "with --parallel, at least 2.5x faster than stock-best"),
        against("stock-best", "hot_reread_ms", 1.2, "the hot set re-read within 1.2x"),
        against("stock-reclaimer", "src_cpu_s", 1 / 2,
                "at most 1/2 of stock + reclaimer's source CPU"),
        against("stock-reclaimer", "migration_ms", 1.0, "no slower than stock + reclaimer"),
    ]  # fmt: skip


SPEC = ScenarioSpec(
    own_guests=False,
    name=NAME,
    title="guests kept trimmed, moved by plain virsh between package-installed hosts",
    make=make_fleet_working_set,
    default_size="4G",
    size_help="each guest's RAM",
    default_runs=2,
    params={
        "data": "2G",
        "hot": "256M",
        "anon": "256M",
        "passes": "5",
        "window": "240",
        "hot_every": "60",
        "link": "10gbit",
    },
)
