"""`thinvm bench fleet-migrate`: libvirt-driven live migration of a Debian
guest between two simulated cluster hosts (thinvm.fleet.cluster) over a
rate-limited link, stock-best against thinvm.

stock-best: stock QEMU, the guest kernel's own virtio_balloon, free page
reporting, multifd (2 channels) with its zero-page detection (no hinting,
which measured slower: thinvm.vm.stack).  thinvm: patched QEMU, our
DKMS-built driver with page ranges, reporting, sparse-ram, the same
multifd channels.  Both are the same Debian
disk image and domain XML (thinvm.fleet.domain) but for those parts.

The hosts talk TLS, as `thinvm cluster up` sets them up by default (libvirt
and QEMU's migration stream).  The `-plain` variants run the same on a
second cluster with plain TCP (`up --no-tls`), which says what TLS costs
each stack.
"""

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from thinvm.bench.cpu import MigrationCpu
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, emulator, guest, migrate
from thinvm.fleet.cluster import ClusterState, Host, virsh
from thinvm.host.memory import process_memory
from thinvm.units import MiB, format_size

NAME = "fleet-migrate"
GUEST = "bench-fleet"
SEED = 1311
CHANNELS = 2
TOUCH_LEAVE = 96 * MiB
PATTERN = "/dev/shm/thinvm-bench-pattern"
# Directories of their own: the benchmark runs next to an operator's cluster.
BENCH_CLUSTER = {True: Path("/var/lib/thinvm/bench-cluster"),
                 False: Path("/var/lib/thinvm/bench-cluster-plain")}  # fmt: skip


class _Clusters:
    """The TLS and the plain cluster, each started when a variant first
    needs it and removed when the scenario ends."""

    def __init__(self) -> None:
        self.link = ""
        self.stack: contextlib.ExitStack | None = None
        self.states: dict[bool, ClusterState] = {}

    def get(self, tls: bool) -> ClusterState:
        if self.stack is None:
            raise ThinvmError("fleet-migrate: no cluster context")
        if tls not in self.states:
            self.states[tls] = self.stack.enter_context(
                cluster.running(2, link=self.link, root=BENCH_CLUSTER[tls], tls=tls)
            )
        return self.states[tls]


_clusters = _Clusters()


@contextlib.contextmanager
def _cluster(link: str) -> Iterator[None]:
    for flavour in ("patched", "stock"):
        emulator.install(flavour)
    with contextlib.ExitStack() as stack:
        _clusters.link, _clusters.stack = link, stack
        try:
            yield
        finally:
            _clusters.stack = None
            _clusters.states.clear()


def _qemu_pid(h: Host, name: str) -> int:
    return int((Path(h.root) / "run" / "qemu" / f"{name}.pid").read_text().strip())


def _qemu_rss(h: Host, name: str) -> int:
    return process_memory(_qemu_pid(h, name)).rss


def _settle_rss(h: Host, name: str, timeout: float = 60.0, quiet: float = 4.0) -> int:
    """Wait until the source QEMU's RSS stops falling (reporting done)."""
    start = time.monotonic()
    low, last_drop = _qemu_rss(h, name), start
    while time.monotonic() - last_drop < quiet and time.monotonic() - start < timeout:
        time.sleep(0.5)
        rss = _qemu_rss(h, name)
        if rss < low - 8 * MiB:
            low, last_drop = rss, time.monotonic()
        low = min(low, rss)
    return low


_MS = re.compile(r"^\s*([0-9.]+)\s*ms")


def _ms(job: dict[str, str], key: str) -> float | None:
    match = _MS.match(job.get(key, ""))
    return float(match.group(1)) if match else None


def _run_one(
    opts: BenchOptions, size: int, used: int, thinvm: bool, balloon_to: int | None,
    tls: bool = True,
) -> Callable[[RunContext], Metrics]:  # fmt: skip
    def run(ctx: RunContext) -> Metrics:
        state = _clusters.get(tls)
        src, dst = state.host("h1"), state.host("h2")
        image = guest.ensure_disk_image(opts.kernel)
        spec = guest.spec_for(
            guest.GuestSpec(GUEST, memory=size, kernel=opts.kernel, thinvm=thinvm,
                            build="patched" if thinvm else "stock"),
            image,
            cluster.shared_dir(Path(src.root).parent.parent),
        )  # fmt: skip
        guest.define(src, spec, image)
        try:
            return _measure(ctx, src, dst, size, used, thinvm, balloon_to)
        finally:
            for h in (src, dst):
                if guest.domstate(h, GUEST) == "running":
                    virsh(h, "destroy", GUEST)
                if guest.domstate(h, GUEST) != "absent":
                    virsh(h, "undefine", GUEST)

    return run


def _measure(
    ctx: RunContext, src: Host, dst: Host, size: int, used: int, thinvm: bool,
    balloon_to: int | None,
) -> Metrics:  # fmt: skip
    ctx.step("booting the Debian guest")
    virsh(src, "start", GUEST)
    ctx.note("boot_s", round(guest.wait_booted(src, GUEST), 1))
    client = guest.agent(src, GUEST)
    try:
        if not thinvm:
            guest.use_intree_driver(client)
        ctx.note("guest", guest.guest_info(client))
        ctx.step(f"guest writes a {format_size(used)} pattern, touches and frees the rest")
        client.check(f"thinvm-mem pattern write {PATTERN} {used // MiB} --seed {SEED}")
        free_kib = int(client.check("awk '/MemFree/ {print $2}' /proc/meminfo").stdout)
        touch = max(0, free_kib * 1024 - TOUCH_LEAVE)
        client.check(f"thinvm-mem touch {touch // MiB}", timeout=600)
    finally:
        client.close()
    if balloon_to:
        ctx.step(f"virsh setmem {format_size(balloon_to)}")
        virsh(src, "setmem", GUEST, f"{balloon_to // MiB}M", "--live")
        _wait_actual(src, balloon_to)
    ctx.step("waiting for free page reporting to settle")
    src_rss = _settle_rss(src, GUEST)
    ctx.step(f"virsh migrate --live --p2p{' --tls' if dst.tls else ''}")
    # The source only: libvirt starts the destination QEMU during the
    # migration, so there is nothing to sample before it.  libvirt names
    # QEMU's threads (debug-threads=on) by itself.
    with MigrationCpu(_qemu_pid(src, GUEST), None) as cpu:
        result = migrate.migrate(src, dst, GUEST, parallel=CHANNELS)
    dst_rss = _qemu_rss(dst, GUEST)
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
        "libvirt_elapsed_ms": _ms(result.job, "Time elapsed"),
        "downtime_ms": _ms(result.job, "Total downtime"),
        "transferred_bytes": migrate.job_bytes(result.job),
        "sparse_skipped_pages": result.ram.get("sparse-skipped"),
        "src_rss_bytes": src_rss,
        "dst_rss_bytes": dst_rss,
        **cpu.metrics,
    }


def _wait_actual(h: Host, size: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = dict(line.split() for line in virsh(h, "dommemstat", GUEST).splitlines() if line)
        if int(stats.get("actual", "0")) * 1024 <= size:
            return
        time.sleep(0.5)
    raise ThinvmError(f"balloon did not reach {format_size(size)} in {timeout:.0f} s")


def make_fleet_migrate(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    used = int(size * float(params["used"])) // MiB * MiB
    balloon_to = int(size * float(params["balloon"])) // MiB * MiB
    link = params["link"]
    variants = [
        Variant("stock-best", _run_one(opts, size, used, False, None),
                "idle guest; stock QEMU, in-tree driver, reporting + multifd"),
        Variant("thinvm", _run_one(opts, size, used, True, None),
                "idle guest; patched QEMU, DKMS driver, ranges, reporting, "
                "sparse-ram, multifd"),
        Variant("stock-best-ballooned", _run_one(opts, size, used, False, balloon_to),
                f"ballooned to {format_size(balloon_to)} by virsh setmem; stock-best"),
        Variant("thinvm-ballooned", _run_one(opts, size, used, True, balloon_to),
                f"ballooned to {format_size(balloon_to)} by virsh setmem; thinvm",
                reference="stock-best-ballooned"),
        Variant("stock-best-plain", _run_one(opts, size, used, False, None, tls=False),
                "stock-best over plain TCP (what TLS costs: against stock-best)",
                reference="stock-best"),
        Variant("thinvm-plain", _run_one(opts, size, used, True, None, tls=False),
                "thinvm over plain TCP (what TLS costs: against thinvm)",
                reference="thinvm"),
    ]  # fmt: skip
    return Scenario(
        name=NAME,
        title="libvirt live migration between cluster hosts: thinvm vs stock-best",
        description=(
            f"Two libvirt hosts (`thinvm cluster up --hosts 2 --link {link}`: network "
            "namespaces, one libvirtd each, a bridge, a token bucket on each host's link; "
            "TLS between the libvirtds and on QEMU's migration stream, the cluster's "
            "default, except for the `-plain` variants, which run on a second cluster "
            "made with `--no-tls`). "
            f"A {format_size(size)} Debian 12 guest (disk image from guest/image/build-disk.sh, "
            f"kernel {opts.kernel}) writes {format_size(used)} of data, touches all but "
            f"{format_size(TOUCH_LEAVE)} of its free memory and frees it, optionally is "
            f"ballooned to {format_size(balloon_to)} with `virsh setmem`, waits for free page "
            "reporting to settle, then `virsh migrate --live --p2p --parallel [--tls]` moves "
            "it to "
            "the other host; the destination verifies the data. stock-best swaps our "
            "driver for the kernel's virtio_balloon (rmmod + insmod) after boot. "
            "migration_ms is the wall time of `virsh migrate` (including the destination "
            "QEMU's start); bytes and downtime are libvirt's (`domjobinfo --completed`)."
        ),
        variants=variants,
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
        context=lambda: _cluster(link),
        targets=[
            Target(
                "issue 11: a guest using 1/8 of its RAM migrates through libvirt at least "
                "3x faster with thinvm than with stock-best",
                "thinvm",
                "stock-best",
                "migration_ms",
                at_most=1 / 3,
            )
        ],
    )


# The registry entry: ScenarioSpec(**SPEC) in thinvm.bench.scenarios.__init__.
SPEC: dict[str, Any] = {
    "name": NAME,
    "title": "libvirt migration across a 10 Gbit/s cluster link: thinvm vs stock-best",
    "make": make_fleet_migrate,
    "default_size": "1G",
    "size_help": "guest RAM",
    "default_runs": 2,
    "params": {"used": "0.125", "balloon": "0.5", "link": "10gbit"},
}
