"""Where the source and destination QEMU run, how they connect, what a migration reports."""

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from thinvm.bench.cpu import MigrationCpu
from thinvm.bench.environment import host_warming_enabled
from thinvm.bench.hostcost import FaultCostWatch
from thinvm.bench.probe import VethLink, in_netns, veth_link
from thinvm.bench.types import Metrics, RunContext
from thinvm.errors import ThinvmError
from thinvm.host.cpus import side_cpus
from thinvm.host.memory import WarmReserve, rss_bytes, warm_free_memory
from thinvm.units import MiB, parse_rate
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig

# QEMU's default max-bandwidth (128 MiB/s) would make every migration
# measure the throttle; the seeds' experiments also lifted it.
MIGRATION_PARAMS: dict[str, Any] = migrate.UNCAPPED
# multifd channels on both sides, for every variant: QEMU's default, set
# explicitly so that stock-best and thinvm provably use the same transport
# (variants without the multifd capability ignore it).
CHANNELS: dict[str, Any] = {"multifd-channels": 2}
# Migration parameters the destination must share with the source.
DESTINATION_PARAMS = ("multifd-channels", "multifd-compression")
MIGRATION_PORT = 4444  # inside the private destination namespace
# What the destination may populate beyond what the source holds (device
# state, THP rounding of scattered pages).
WARM_MARGIN = 256 * MiB


def warm_host(ctx: RunContext, populated: int) -> Metrics:
    """Warm as much free host memory as a consumer that allocates
    `populated` bytes will fault in, and release it at once (a restore,
    which reads its file in well under the lab host's 2 s reporting delay;
    a migration keeps its reserve instead: warm_reserve)."""
    if not host_warming_enabled():
        return {"host_warmed_bytes": 0}
    ctx.step("warming free host memory")
    warmed, seconds = warm_free_memory(populated + WARM_MARGIN)
    return {"host_warmed_bytes": warmed, "host_warm_s": round(seconds, 3)}


# How often the reserve's feeder reads the destination's RSS.
FEED_INTERVAL = 0.05


@contextlib.contextmanager
def warm_reserve(ctx: RunContext, populated: int, consumer: VM) -> Iterator[Metrics]:
    """Hold warm free host memory for a destination that receives
    `populated` bytes and hand it back just ahead of the destination's
    growing RSS while the migration runs (thinvm.host.memory.WarmReserve
    says why): the destination's CPU then measures QEMU, not how long ago
    this lab machine last gave its free memory back to its own hypervisor,
    and that holds for a migration of any length.  The metrics yielded are
    filled in when the context ends."""
    metrics: Metrics = {"host_warmed_bytes": 0}
    pid = consumer.pid
    if not host_warming_enabled() or pid is None:
        yield metrics
        return
    ctx.step("warming free host memory for the destination")
    with WarmReserve(populated + WARM_MARGIN) as reserve:
        start_rss = rss_bytes(pid)
        stop = threading.Event()

        def feed() -> None:
            while True:
                with contextlib.suppress(OSError):  # the destination gone: nothing to feed
                    reserve.release_for(rss_bytes(pid) - start_rss)
                if stop.wait(FEED_INTERVAL):
                    return

        feeder = threading.Thread(target=feed, name="warm-reserve", daemon=True)
        reserve.release_for(0)  # the lead, before the first page arrives
        feeder.start()
        try:
            yield metrics
        finally:
            stop.set()
            feeder.join()
            metrics.update(
                host_warmed_bytes=reserve.size,
                host_warm_s=round(reserve.seconds, 3),
                host_warm_unused_bytes=reserve.held,
            )


def migration_metrics(result: migrate.MigrationResult) -> Metrics:
    return {
        "migration_ms": result.total_time_ms,
        "downtime_ms": result.downtime_ms,
        "setup_ms": result.setup_time_ms,
        "transferred_bytes": result.transferred,
        "normal_pages": result.normal_pages,
        "zero_pages": result.zero_pages,
        "dirty_syncs": result.dirty_sync_count,
        "sparse_skipped_pages": result.sparse_skipped,
        "sparse_zero_pages": result.sparse_zero,
    }


def link_metrics(link: VethLink | None, result: migrate.MigrationResult) -> Metrics:
    """What a shaped link alone needs for the bytes QEMU sent: the floor no
    migration of that many bytes can beat (none over loopback)."""
    if link is None:
        return {}
    return {"link_ms": round(result.transferred * 8 / parse_rate(link.rate) * 1000, 1)}


def progress_sample(info: dict[str, Any]) -> dict[str, Any]:
    """One `query-migrate` poll, compact: where a migration spends its time
    (pass by pass, live or stopped) shows in the runs' info as a timeline."""
    ram = info.get("ram", {})
    sample: dict[str, Any] = {
        "ms": info.get("total-time"),
        "status": info.get("status"),
        "sent_mib": round(ram.get("transferred", 0) / MiB, 1),
        "remaining_mib": round(ram.get("remaining", 0) / MiB, 1),
        "syncs": ram.get("dirty-sync-count"),
    }
    if "expected-downtime" in info:
        sample["expected_downtime_ms"] = info["expected-downtime"]
    return sample


class Transport:
    """Where the source and destination QEMU run and how they connect.

    loopback: both in the host's namespace, TCP over 127.0.0.1.
    veth: source and destination in two network namespaces joined by a veth
    pair shaped with tc (see bench_probe.veth_link).
    """

    def __init__(
        self,
        kind: str = "loopback",
        rate: str = "10gbit",
        *,
        vm_class: type[VM] = VM,
        pin: bool = True,
    ) -> None:
        if kind not in ("loopback", "veth"):
            raise ThinvmError(f"unknown --net {kind!r}: choose loopback or veth")
        parse_rate(rate)  # a clear error now, not after the first guest booted
        self.kind = kind
        self.rate = rate
        self.vm_class = vm_class
        self.link: VethLink | None = None
        self.sides = side_cpus() if pin else None

    def placement(self) -> dict[str, Any]:
        """Where the two sides ran, for the record."""
        if self.sides is None:
            return {"pinned": False, "cpus": sorted(os.sched_getaffinity(0))}
        source, destination = self.sides
        return {"pinned": True, "source": source, "destination": destination}

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        if self.kind == "loopback":
            yield
            return
        with veth_link(self.rate) as link:
            self.link = link
            try:
                yield
            finally:
                self.link = None

    def _netns(self, incoming: bool) -> str | None:
        if self.kind == "loopback":
            return None
        if self.link is None:
            raise ThinvmError("veth transport used outside its session")
        return self.link.dst_ns if incoming else self.link.src_ns

    def start(self, config: VMConfig, *, incoming: bool = False) -> VM:
        if self.sides is not None:
            config = replace(config, host_cpus=self.sides[1] if incoming else self.sides[0])
        with in_netns(self._netns(incoming)):
            return self.vm_class(config, incoming=incoming).start()

    def migrate(
        self,
        src: VM,
        dst: VM,
        ctx: RunContext,
        caps: dict[str, bool] | None = None,
        params: dict[str, Any] | None = None,
        *,
        postcopy_after: float | None = None,
    ) -> "Migrated":
        """Migrate with MIGRATION_PARAMS and CHANNELS, plus or overridden by `params`.

        Both QEMUs' threads are sampled from just before the `migrate`
        command: the source's until it reports completion, the
        destination's until its guest runs (it may still be loading when
        the source is done).  Waiting for the guest agent comes after.
        """
        timeline: list[dict[str, Any]] = []
        ctx.note("timeline", timeline)
        ctx.note("placement", self.placement())

        def progress(info: dict[str, Any]) -> None:
            ctx.step(migrate.describe_progress(info))
            timeline.append(progress_sample(info))

        params = {**MIGRATION_PARAMS, **CHANNELS, **(params or {})}
        # The destination accepts as many multifd channels as it expects,
        # and decodes them with the compression it is told.
        migrate.set_parameters(dst, {k: v for k, v in params.items() if k in DESTINATION_PARAMS})
        migrate.set_capabilities(dst, caps or {})
        uri = self._incoming(dst)
        populated = src.host_memory().rss
        with (
            warm_reserve(ctx, populated, dst) as warm,
            FaultCostWatch() as host_cost,
            MigrationCpu(src.pid, dst.pid) as cpu,
        ):
            try:
                result = migrate.migrate_to_uri(
                    src,
                    uri,
                    caps=caps,
                    params=params,
                    progress=progress,
                    postcopy_after=postcopy_after,
                )
            except ThinvmError as exc:
                # The source often only sees a broken pipe; the reason is here.
                reason = migrate.destination_error(dst)
                raise ThinvmError(f"{exc}; destination: {reason}" if reason else str(exc)) from exc
            cpu.src_done()
            migrate.wait_destination_running(dst)
            cpu.dst_done()
        dst.wait_agent(timeout=60)
        return Migrated(
            result, {**cpu.metrics, **warm, **host_cost.metrics, **link_metrics(self.link, result)}
        )

    def _incoming(self, dst: VM) -> str:
        """Let the destination listen; the URI the source connects to."""
        if self.link is None:
            return migrate.start_incoming(dst, migrate.free_port())
        uri = f"tcp:{self.link.dst_ip}:{MIGRATION_PORT}"
        dst.qmp("migrate-incoming", uri=uri)
        return uri


@dataclass(frozen=True)
class Migrated:
    """One measured migration: QEMU's counters and both sides' CPU seconds."""

    result: migrate.MigrationResult
    cpu: Metrics

    @property
    def metrics(self) -> Metrics:
        return {**migration_metrics(self.result), **self.cpu}
