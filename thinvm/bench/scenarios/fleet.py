"""`thinvm bench fleet-migrate`: libvirt-driven live migration of a Debian
guest between two simulated cluster hosts (thinvm.fleet.cluster) over a
rate-limited link, stock-best against thinvm.

stock-best is chosen per run among the 7 stock configurations of every
migration scenario (thinvm.bench.scenarios.common: stock QEMU, the guest
kernel's own virtio_balloon, reporting with and without hinting, multifd
with 2, 1 or no channels, legacy), and thinvm's row among its 2 options
(patched QEMU, our DKMS-built driver with page ranges, reporting,
sparse-ram, multifd, with and without hinting).  The ballooned and plain
TCP pairs run the configurations that win those rows (reporting and
multifd with 2 channels; thinvm without hinting).  Every variant is the
same Debian disk image and domain XML (thinvm.fleet.domain) but for those
parts.

The hosts talk TLS, as `thinvm cluster up` sets them up by default (libvirt
and QEMU's migration stream).  The `-plain` variants run the same on a
second cluster with plain TCP (`up --no-tls`), which says what TLS costs
each stack.

The `pkg-` variants run on package-installed hosts booted by systemd
(`cluster up --packaged --systemd`: Debian roots with Debian's libvirt and
QEMU 10.0.2 from bookworm-backports, libvirtd socket-activated, guests in
cgroups of their own), four of them: h1 and h2 install thinvm-qemu with apt,
h3 and h4 keep Debian's QEMU only.  There stock-best is chosen per run
among the 7 stock configurations of every migration scenario (thinvm's
row among its 2 options), stock QEMU going h3 -> h4 and thinvm-qemu h1 ->
h2; `pkg-thinvm-to-stock` is a mixed cluster: a portable guest on
thinvm-qemu (h1) moves to Debian's QEMU (h4), `fleet migrate` switching its
<emulator>.
"""

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from thinvm.bench.cpu import MigrationCpu
from thinvm.bench.hostcost import FaultCostWatch
from thinvm.bench.scenarios import hostcpus
from thinvm.bench.scenarios.common import Candidate, migration_rows
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.types import BenchOptions, Best, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, emulator, guest, migrate
from thinvm.fleet.cluster import ClusterState, Host, virsh
from thinvm.fleet.domain import DomainSpec
from thinvm.fleet.trace import Trace
from thinvm.guest import image as guest_image
from thinvm.guest.trim import set_background
from thinvm.host.memory import process_memory, wait_settled
from thinvm.units import MiB, format_size
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

NAME = "fleet-migrate"
T = TypeVar("T")
GUEST = "bench-fleet"
SEED = 1311
CHANNELS = 2
TOUCH_LEAVE = 96 * MiB
PATTERN = "/dev/shm/thinvm-bench-pattern"
PACKAGED = "pkg-"  # the prefix of the variants on packaged hosts


@dataclass(frozen=True)
class ClusterKind:
    """A cluster the variants run on, in a directory of its own: the
    benchmark runs next to an operator's cluster."""

    root: Path
    hosts: int = 2
    tls: bool = True
    packaged: bool = False
    stock: tuple[str, ...] = ()  # packaged hosts left on Debian's QEMU
    systemd: bool = False  # packaged hosts booted by systemd, as a server boots


CLUSTERS = {
    "tls": ClusterKind(Path("/var/lib/thinvm/bench-cluster")),
    "plain": ClusterKind(Path("/var/lib/thinvm/bench-cluster-plain"), tls=False),
    # Two hosts a side: thinvm -> thinvm and stock -> stock each need a
    # pair, and a host cannot be both (fleet migrate gives a guest
    # thinvm-qemu wherever it is installed).
    # A short root: a packaged host's agent sockets lie deeper in it
    # (root/run/libvirt/qemu/channel/ID-NAME/...), and a unix socket's path
    # must fit in 107 bytes, else the agent cannot be reached at all.
    "packaged": ClusterKind(
        Path("/var/lib/thinvm/bench-pkg"), hosts=4, packaged=True, stock=("h3", "h4"),
        systemd=True,
    ),
    # fleet-overcommit: one host per QEMU, h1 thinvm-qemu, h2 Debian's.
    "packaged-density": ClusterKind(
        Path("/var/lib/thinvm/bench-pkd"), hosts=2, packaged=True, stock=("h2",),
        systemd=True,
    ),
}  # fmt: skip
# Packaged hosts by the QEMU they run guests on (ClusterKind "packaged").
PACKAGED_HOSTS = {"patched": ("h1", "h2"), "stock": ("h3", "h4")}
PACKAGED_BINARY = {"patched": emulator.PACKAGED_THINVM, "stock": emulator.PACKAGED_STOCK}


def packaged_route(source_build: str, destination_build: str) -> tuple[str, str]:
    """The packaged hosts a migration from a `source_build` QEMU to a
    `destination_build` one runs between: always the first host of the
    source's pair to the second of the destination's, so no host is both."""
    return PACKAGED_HOSTS[source_build][0], PACKAGED_HOSTS[destination_build][1]


@dataclass(frozen=True)
class FleetRun:
    """What one variant's migration is: the guest's stack (thinvm.vm.stack)
    and where it runs."""

    stack: Stack
    cluster: str = "tls"  # a key of CLUSTERS
    channels: int = CHANNELS  # multifd channels, when the stack has multifd
    # A portable guest (no ranges, no sparse-ram in its XML), to run on a
    # destination with Debian's QEMU; the stack's build is the source's.
    to_build: str | None = None
    balloon_to: int | None = None
    name: str = GUEST  # the domain's name

    @property
    def kind(self) -> ClusterKind:
        return CLUSTERS[self.cluster]

    @property
    def parallel(self) -> int:
        """`virsh migrate --parallel-connections`; 0: the main channel only."""
        return self.channels if self.stack.multifd else 0

    @property
    def route(self) -> tuple[str, str]:
        if not self.kind.packaged:
            return "h1", "h2"
        return packaged_route(self.stack.build, self.destination_build)

    @property
    def destination_build(self) -> str:
        return self.to_build or self.stack.build

    @property
    def portable(self) -> bool:
        return self.destination_build != self.stack.build

    def guest_spec(self, size: int, kernel: str) -> guest.GuestSpec:
        return guest.GuestSpec(
            self.name, memory=size, kernel=kernel, build=self.stack.build,
            thinvm=self.stack.ranges or self.stack.sparse, portable=self.portable,
            hint=self.stack.hint,
        )  # fmt: skip

    def domain(self, image: guest_image.DiskImage, size: int, shared: Path) -> DomainSpec:
        """The domain: packaged hosts name their own QEMU, and reporting
        follows the stack (spec_for turns it on for everyone)."""
        binary = PACKAGED_BINARY[self.stack.build] if self.kind.packaged else None
        spec = guest.spec_for(self.guest_spec(size, image.kernel), image, shared, binary)
        # A stack without sparse-ram is plain XML: on the thinvm machine
        # type the main channel still skips (x-sparse-ram-main).
        sparse_ram = spec.sparse_ram if self.stack.sparse else None
        return replace(spec, free_page_reporting=self.stack.reporting, sparse_ram=sparse_ram)


# What an operator gets from plain XML and a plain `virsh migrate` (Nova's
# way): the machine type brings page ranges and main-channel skipping, no
# capability and no --parallel (issue 47, item 3).
THINVM_PLAIN_VIRSH = replace(THINVM, sparse=False, multifd=False)


def candidate_run(c: Candidate) -> FleetRun:
    """A migration scenario's candidate (thinvm.bench.scenarios.common) on
    the packaged hosts."""
    channels = int(c.params.get("multifd-channels", CHANNELS))
    return FleetRun(c.stack, cluster="packaged", channels=channels)


# thinvm's best option on a source host whose destination runs Debian's
# QEMU: no ranges (the guest would see a device property the destination
# lacks) and no sparse-ram capability; thinvm-qemu skips over multifd
# without it (QEMU 0017).
THINVM_TO_STOCK = FleetRun(
    replace(THINVM, ranges=False, sparse=False), cluster="packaged", to_build="stock"
)


class _Clusters:
    """The clusters of CLUSTERS, each started when a variant first needs it
    and removed when the scenario ends."""

    def __init__(self) -> None:
        self.link = ""
        self.stack: contextlib.ExitStack | None = None
        self.states: dict[str, ClusterState] = {}

    def hold(self, context: "contextlib.AbstractContextManager[T]") -> T:
        """Enter `context` until the clusters go (left before them)."""
        if self.stack is None:
            raise ThinvmError("fleet-migrate: no cluster context")
        return self.stack.enter_context(context)

    def get(self, name: str) -> ClusterState:
        if self.stack is None:
            raise ThinvmError("fleet-migrate: no cluster context")
        if name not in self.states:
            kind = CLUSTERS[name]
            self.states[name] = self.stack.enter_context(
                cluster.running(kind.hosts, link=self.link, stock=kind.stock, root=kind.root,
                                tls=kind.tls, packaged=kind.packaged, systemd=kind.systemd)
            )  # fmt: skip
        return self.states[name]


clusters = _Clusters()


@contextlib.contextmanager
def cluster_session(link: str) -> Iterator[None]:
    for flavour in ("patched", "stock"):
        emulator.install(flavour)
    with contextlib.ExitStack() as stack:
        clusters.link, clusters.stack = link, stack
        try:
            yield
        finally:
            for state in clusters.states.values():
                hostcpus.unpin(state.hosts)
            clusters.stack = None
            clusters.states.clear()


def _qemu_rss(h: Host, name: str) -> int:
    return process_memory(guest.qemu_pid(h, name)).rss


def _qemu_binary(h: Host, name: str) -> str:
    """The binary the domain's QEMU runs, as its host sees it."""
    exe = os.readlink(f"/proc/{guest.qemu_pid(h, name)}/exe")
    return exe.removeprefix(str(h.rootfs)) if h.packaged else exe


def _settle_rss(h: Host, name: str, timeout: float = 60.0) -> int:
    """Wait until the source QEMU's RSS stops falling (reporting done):
    the one settle rule (thinvm.host.memory.wait_settled)."""
    return wait_settled(lambda: _qemu_rss(h, name), timeout).value


_MS = re.compile(r"^\s*([0-9.]+)\s*ms")


def job_ms(job: dict[str, str], key: str) -> float | None:
    """A `domjobinfo` figure in ms ("93 ms"), or None."""
    match = _MS.match(job.get(key, ""))
    return float(match.group(1)) if match else None


def _run_one(
    opts: BenchOptions, size: int, used: int, plan: FleetRun
) -> Callable[[RunContext], Metrics]:
    def run(ctx: RunContext) -> Metrics:
        state = clusters.get(plan.cluster)
        src, dst = (state.host(n) for n in plan.route)
        if opts.pin_sides:  # --unpinned leaves both hosts on every CPU
            hostcpus.pin_pair(src, dst)
        image = guest_image.ensure_disk_image(opts.kernel)
        shared = cluster.shared_dir(Path(src.root).parent.parent)
        guest.define(src, plan.domain(image, size, shared), image)
        try:
            return _measure(ctx, src, dst, used, plan)
        finally:
            for h in (src, dst):
                guest.remove(h, GUEST)

    return run


def _prepare_guest(ctx: RunContext, src: Host, used: int, plan: FleetRun) -> None:
    """Boot; the guest writes its data, touches and frees the rest."""
    ctx.step("booting the Debian guest")
    virsh(src, "start", GUEST)
    ctx.note("boot_s", round(guest.wait_booted(src, GUEST), 1))
    client = guest.agent(src, GUEST)
    try:
        if plan.stack.driver == "stock":
            guest.use_intree_driver(client)
        # The packaged agent reclaims in the background by default; no
        # variant here asks for it, so none runs it (the records before
        # the default changed did not either).
        set_background(client, False)
        ctx.note("guest", guest_image.guest_info(client))
        ctx.step(f"guest writes a {format_size(used)} pattern, touches and frees the rest")
        client.check(f"thinvm-mem pattern write {PATTERN} {used // MiB} --seed {SEED}")
        free_kib = int(client.check("awk '/MemFree/ {print $2}' /proc/meminfo").stdout)
        touch = max(0, free_kib * 1024 - TOUCH_LEAVE)
        client.check(f"thinvm-mem touch {touch // MiB}", timeout=600)
    finally:
        client.close()


def _check_binaries(ctx: RunContext, src: Host, dst: Host, plan: FleetRun, source: str) -> None:
    """Record which QEMU ran at each end; on packaged hosts it must be the
    one the variant names (else the row would measure something else)."""
    arrived = _qemu_binary(dst, GUEST)
    ctx.note("qemu", {src.name: source, dst.name: arrived})
    if not plan.kind.packaged:
        return
    want = (PACKAGED_BINARY[plan.stack.build], PACKAGED_BINARY[plan.destination_build])
    if (source, arrived) != tuple(str(p) for p in want):
        raise ThinvmError(f"ran on {source} -> {arrived}, not {want[0]} -> {want[1]}")


def _measure(ctx: RunContext, src: Host, dst: Host, used: int, plan: FleetRun) -> Metrics:
    _prepare_guest(ctx, src, used, plan)
    if plan.balloon_to:
        ctx.step(f"virsh setmem {format_size(plan.balloon_to)}")
        virsh(src, "setmem", GUEST, f"{plan.balloon_to // MiB}M", "--live")
        _wait_actual(src, plan.balloon_to)
    ctx.step("waiting for free page reporting to settle")
    src_rss = _settle_rss(src, GUEST)
    source = _qemu_binary(src, GUEST)
    source_cpus = hostcpus.allowed_cpus(guest.qemu_pid(src, GUEST))
    ctx.step(f"virsh migrate --live --p2p{' --tls' if dst.tls else ''} {src.name} -> {dst.name}")
    # The source only: libvirt starts the destination QEMU during the
    # migration, so there is nothing to sample before it.  libvirt names
    # QEMU's threads (debug-threads=on) by itself.
    trace = Trace()
    with FaultCostWatch() as host_cost, MigrationCpu(guest.qemu_pid(src, GUEST), None) as cpu:
        result = migrate.migrate(src, dst, GUEST, parallel=plan.parallel, trace=trace)
    # Where the time went, libvirt's events among ours (issue 47).
    ctx.note("trace", trace.steps())
    dst_rss = _qemu_rss(dst, GUEST)
    # Which CPUs each side's QEMU could run on: the pairing held.
    dst_cpus = hostcpus.allowed_cpus(guest.qemu_pid(dst, GUEST))
    ctx.note("qemu_cpus", {src.name: source_cpus, dst.name: dst_cpus})
    _check_binaries(ctx, src, dst, plan, source)
    client = guest.agent(dst, GUEST)
    try:
        check = client.check(f"thinvm-mem pattern verify {PATTERN} --seed {SEED}").json()
    finally:
        client.close()
    if check["bad"] != 0 or check["pages"] != used // 4096:
        raise ThinvmError(f"data changed in migration: {check}")
    ctx.note("capabilities", sorted(result.capabilities))
    return {
        "migration_ms": round(result.seconds * 1000, 1),
        "libvirt_elapsed_ms": job_ms(result.job, "Time elapsed"),
        "downtime_ms": job_ms(result.job, "Total downtime"),
        "transferred_bytes": migrate.job_bytes(result.job),
        "sparse_skipped_pages": result.ram.get("sparse-skipped"),
        "src_rss_bytes": src_rss,
        "dst_rss_bytes": dst_rss,
        **cpu.metrics,
        **host_cost.metrics,
        **trace.phases(src.name, dst.name),
    }


def _wait_actual(h: Host, size: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = dict(line.split() for line in virsh(h, "dommemstat", GUEST).splitlines() if line)
        if int(stats.get("actual", "0")) * 1024 <= size:
            return
        time.sleep(0.5)
    raise ThinvmError(f"balloon did not reach {format_size(size)} in {timeout:.0f} s")


def fast_run(c: Candidate) -> FleetRun:
    """A migration scenario's candidate on the fast (bind-mount) hosts."""
    channels = int(c.params.get("multifd-channels", CHANNELS))
    return FleetRun(c.stack, channels=channels)


def _fast_variants(
    make: Callable[[FleetRun], Callable[[RunContext], Metrics]], balloon_to: int
) -> tuple[list[Variant], list[Best]]:
    """The variants on the fast (bind-mount) hosts, with thinvm's own builds:
    stock-best and thinvm chosen per run among the candidates of every
    migration scenario, then the ballooned and plain-TCP pairs, which run
    the configurations that win those rows everywhere else (reporting and
    multifd with 2 channels; thinvm without hinting)."""
    variants, best = migration_rows(lambda c: make(fast_run(c)), what="fast hosts: ")
    ballooned = f"ballooned to {format_size(balloon_to)} by virsh setmem"
    stock = "stock QEMU and driver, reporting + multifd (2 channels)"
    thinvm = "patched QEMU, our driver, ranges, reporting, sparse-ram, multifd (2 channels)"
    variants += [
        Variant("stock-best-ballooned", make(FleetRun(STOCK_BEST, balloon_to=balloon_to)),
                f"{ballooned}; {stock}"),
        Variant("thinvm-ballooned", make(FleetRun(THINVM, balloon_to=balloon_to)),
                f"{ballooned}; {thinvm}", reference="stock-best-ballooned"),
        Variant("thinvm-virsh", make(FleetRun(THINVM_PLAIN_VIRSH)),
                "plain XML on the thinvm machine type, plain `virsh migrate --live --p2p "
                "--tls` (no --parallel, no sparse-ram capability: the main channel skips); "
                "patched QEMU, our driver, ranges, reporting (against stock-reporting, "
                "stock's best without --parallel)", reference="stock-reporting"),
        Variant("stock-best-plain", make(FleetRun(STOCK_BEST, cluster="plain")),
                f"{stock}, over plain TCP (what TLS costs: against stock-mfd2)",
                reference="stock-mfd2"),
        Variant("thinvm-plain", make(FleetRun(THINVM, cluster="plain")),
                f"{thinvm}, over plain TCP (what TLS costs: against thinvm-no-hint)",
                reference="thinvm-no-hint"),
    ]  # fmt: skip
    return variants, best


def packaged_rows(
    make: Callable[[FleetRun], Callable[[RunContext], Metrics]],
) -> tuple[list[Variant], list[Best]]:
    """The variants on packaged hosts: every stock candidate (Debian's QEMU,
    h3 -> h4) and thinvm option (thinvm-qemu, h1 -> h2), the rows
    pkg-stock-best and pkg-thinvm chosen among them, and thinvm -> stock."""
    reference = f"{PACKAGED}stock-best"
    variants, best = migration_rows(
        lambda c: make(candidate_run(c)), prefix=PACKAGED, what="packaged hosts: ",
        reference=reference,
    )  # fmt: skip
    variants.append(
        Variant(
            f"{PACKAGED}thinvm-to-stock",
            make(THINVM_TO_STOCK),
            "packaged hosts: a portable guest on thinvm-qemu (h1) migrated to Debian's "
            "QEMU (h4), <emulator> switched by fleet migrate; our driver, reporting, "
            "multifd (2 channels), no ranges, no sparse-ram capability (0017 skips)",
            reference=reference,
        )
    )
    return variants, best


def make_fleet_migrate(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    used = int(size * float(params["used"])) // MiB * MiB
    balloon_to = int(size * float(params["balloon"])) // MiB * MiB
    link = params["link"]

    def make(plan: FleetRun) -> Callable[[RunContext], Metrics]:
        return _run_one(opts, size, used, plan)

    fast, fast_best = _fast_variants(make, balloon_to)
    packaged, packaged_best = packaged_rows(make)
    return Scenario(
        name=NAME,
        title="libvirt live migration between cluster hosts: thinvm vs stock-best",
        description=(
            f"Two libvirt hosts (`thinvm cluster up --hosts 2 --link {link}`: network "
            "namespaces, one libvirtd each, a bridge, a token bucket on each host's link; "
            "TLS between the libvirtds and on QEMU's migration stream, the cluster's "
            "default, except for the `-plain` variants, which run on a second cluster "
            "made with `--no-tls`); each host of a pair on a CPU of its own (its cgroup's "
            f"cpuset: source {hostcpus.SOURCE_CPU}, destination {hostcpus.DESTINATION_CPU}). "
            f"A {format_size(size)} Debian 12 guest (disk image from guest/image/build-disk.sh, "
            f"kernel {opts.kernel}) writes {format_size(used)} of data, touches all but "
            f"{format_size(TOUCH_LEAVE)} of its free memory and frees it, optionally is "
            f"ballooned to {format_size(balloon_to)} with `virsh setmem`, waits for free page "
            "reporting to settle, then `virsh migrate --live --p2p --parallel [--tls]` moves "
            "it to "
            "the other host (`thinvm-virsh` and the stock rows without multifd: no "
            "`--parallel`, as Nova issues it); the destination verifies the data. Each run "
            "traces the migration (`fleet migrate --trace`): the trace_*_ms figures are its "
            "phases (thinvm.fleet.trace.PHASES). `stock-best` and `thinvm` "
            "are chosen per run among the 7 stock configurations of every migration "
            "scenario and thinvm's 2 options. The stock variants swap our "
            "driver for the kernel's virtio_balloon (rmmod + insmod) after boot. "
            "migration_ms is the wall time of `virsh migrate` (including the destination "
            "QEMU's start); bytes and downtime are libvirt's (`domjobinfo --completed`). "
            "The `pkg-` rows run the same on package-installed hosts (`cluster up --packaged "
            "--hosts 4 --stock h3 --stock h4`: Debian 12 roots, Debian's libvirt 11.3 and "
            "QEMU 10.0.2; h1 and h2 `apt install thinvm-qemu`): `pkg-stock-best` is the best "
            "of the 7 stock configurations of every migration scenario on Debian's QEMU "
            "(h3 -> h4), `pkg-thinvm` the best of thinvm's 2 options on thinvm-qemu "
            "(h1 -> h2), and `pkg-thinvm-to-stock` a portable guest going from thinvm-qemu "
            "(h1) to Debian's QEMU (h4); each run checks which QEMU ran at each end."
        ),
        variants=fast + packaged,
        best=fast_best + packaged_best,
        # The fast hosts' stock-best stays the baseline; the pkg- rows are
        # taken against pkg-stock-best.
        baseline="stock-best",
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "balloon": format_size(balloon_to),
            "link": link,
            "channels": CHANNELS,
            "kernel": opts.kernel,
        },
        context=lambda: cluster_session(link),
        targets=[
            Target(
                "issue 11: a guest using 1/8 of its RAM migrates through libvirt at least "
                "3x faster with thinvm than with stock-best",
                "thinvm",
                "stock-best",
                "migration_ms",
                at_most=1 / 3,
            ),
            Target(
                "issue 11's target on package-installed hosts (issue 21): thinvm-qemu "
                "against the best stock configuration measured on Debian's QEMU",
                f"{PACKAGED}thinvm",
                f"{PACKAGED}stock-best",
                "migration_ms",
                at_most=1 / 3,
            ),
        ],
    )


# The registry entry, listed in thinvm.bench.scenarios.
SPEC = ScenarioSpec(
    own_guests=False,
    name=NAME,
    title="libvirt migration across a 10 Gbit/s cluster link: thinvm vs stock-best",
    make=make_fleet_migrate,
    default_size="1G",
    size_help="guest RAM",
    default_runs=2,
    params={"used": "0.125", "balloon": "0.5", "link": "10gbit"},
)
