"""The benchmark scenarios (issue 4): each builds a Scenario of Variants.

Every variant's run boots fresh guests, measures one thing and tears them
down (`with VM(...)`), so runs are independent and no QEMU outlives a run.
Sizes default to what fits in < 5 minutes per scenario on a 2-CPU TCG host;
`--size` scales them up.
"""

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from thinvm import pool
from thinvm.bench import fleet as fleet_bench
from thinvm.bench import overcommit
from thinvm.bench.harness import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.bench.probe import (
    MemoryCgroup,
    SyscallCounter,
    VethLink,
    in_netns,
    memory_cgroup,
    spawn_in,
    veth_link,
)
from thinvm.bench.report import CatalogueEntry
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.host.memory import host_meminfo
from thinvm.paths import cache_dir
from thinvm.units import GiB, MiB, format_size, parse_size
from thinvm.vm import balloon, migrate, pooled
from thinvm.vm.machine import VM, BalloonOptions, VMConfig
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

# QEMU's default max-bandwidth (128 MiB/s) would make every migration
# measure the throttle; the seeds' experiments also lifted it.
MIGRATION_PARAMS: dict[str, Any] = migrate.UNCAPPED
# multifd channels on both sides, for every variant: QEMU's default, set
# explicitly so that stock-best and thinvm provably use the same transport
# (variants without the multifd capability ignore it).
CHANNELS: dict[str, Any] = {"multifd-channels": 2}
# Migration parameters the destination must share with the source.
DESTINATION_PARAMS = ("multifd-channels", "multifd-compression")
TOUCH_LEAVE = 96 * MiB  # free memory a "touch most of RAM" leaves the guest
MIGRATION_PORT = 4444  # inside the private destination namespace


# -- helpers -------------------------------------------------------------


LEGACY = Stack()  # stock QEMU and driver, no extras

# What every migration scenario compares (issue 13): thinvm against the
# best stock setup (the baseline of the ratios); legacy as a reference row.
MIGRATION_STACKS: list[tuple[str, Stack, str]] = [
    (
        "stock-best",
        STOCK_BEST,
        "stock QEMU and driver; free page hinting + reporting, multifd "
        "(2 channels, its zero-page detection)",
    ),
    (
        "thinvm",
        THINVM,
        "patched QEMU, our driver; hinting + reporting + page ranges, sparse-ram, "
        "multifd (2 channels)",
    ),
    ("legacy", LEGACY, "stock QEMU and driver, no extras, one channel (reference)"),
]


# thinvm's QEMU side with the guest kernel's own balloon driver.
THINVM_STOCK_DRIVER = Stack(
    build="patched", driver="stock", hint=True, reporting=True, sparse=True, multifd=True
)


def stack_config(opts: BenchOptions, name: str, memory: int, stack: Stack, **kw: Any) -> VMConfig:
    """guest_config() with the build, driver and features of `stack`."""
    config = guest_config(opts, name, memory, **kw)
    config.build, config.guest_driver = stack.build, stack.driver
    config.balloon = stack.balloon()
    return config


def guest_config(
    opts: BenchOptions,
    name: str,
    memory: int,
    *,
    hint: bool = False,
    reporting: bool = False,
    prealloc: bool = False,
    prealloc_threads: int = 1,
    reserve: bool = True,
) -> VMConfig:
    return VMConfig(
        name=name,
        build=opts.build,
        memory=memory,
        accel=opts.accel,
        kernel=opts.kernel,
        guest_driver=opts.driver,
        prealloc=prealloc,
        prealloc_threads=prealloc_threads,
        reserve=reserve,
        balloon=BalloonOptions(free_page_hint=hint, free_page_reporting=reporting),
    )


def touch_most(vm: VM, leave: int = TOUCH_LEAVE) -> Metrics:
    """The guest faults in (and frees) all but `leave` of its free memory."""
    size = max(0, workload.meminfo(vm.agent)["MemFree"] - leave)
    result = workload.touch(vm.agent, size)
    return {"touched_bytes": size, "touch_guest_s": float(result["ms"]) / 1000}


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


def fits_reserved(memory: int) -> bool:
    """Whether a reserved mapping of `memory` passes the overcommit check."""
    info = host_meminfo()
    return memory <= info["MemTotal"] + info.get("SwapTotal", 0)


def process_age(pid: int) -> float:
    """Seconds since the process started (10 ms resolution)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


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

    def __init__(self, kind: str = "loopback", rate: str = "10gbit") -> None:
        if kind not in ("loopback", "veth"):
            raise ThinvmError(f"unknown --net {kind!r}: choose loopback or veth")
        self.kind = kind
        self.rate = rate
        self.link: VethLink | None = None

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
        with in_netns(self._netns(incoming)):
            return VM(config, incoming=incoming).start()

    def migrate(
        self,
        src: VM,
        dst: VM,
        ctx: RunContext,
        caps: dict[str, bool] | None = None,
        params: dict[str, Any] | None = None,
    ) -> migrate.MigrationResult:
        """Migrate with MIGRATION_PARAMS and CHANNELS, plus or overridden by `params`."""

        timeline: list[dict[str, Any]] = []
        ctx.note("timeline", timeline)

        def progress(info: dict[str, Any]) -> None:
            ctx.step(migrate.describe_progress(info))
            timeline.append(progress_sample(info))

        params = {**MIGRATION_PARAMS, **CHANNELS, **(params or {})}
        # The destination accepts as many multifd channels as it expects,
        # and decodes them with the compression it is told.
        migrate.set_parameters(dst, {k: v for k, v in params.items() if k in DESTINATION_PARAMS})
        if self.link is None:
            return migrate.migrate(src, dst, caps=caps, params=params, progress=progress)
        uri = f"tcp:{self.link.dst_ip}:{MIGRATION_PORT}"
        migrate.set_capabilities(dst, caps or {})
        dst.qmp("migrate-incoming", uri=uri)
        result = migrate.migrate_to_uri(src, uri, caps=caps, params=params, progress=progress)
        migrate.wait_destination_running(dst)
        dst.wait_agent(timeout=60)
        return result


def _params(spec_defaults: dict[str, str], given: dict[str, str], scenario: str) -> dict[str, str]:
    unknown = sorted(set(given) - set(spec_defaults))
    if unknown:
        known = ", ".join(spec_defaults) or "none"
        raise ThinvmError(
            f"scenario {scenario} has no parameter {', '.join(unknown)} (known: {known})"
        )
    return {**spec_defaults, **given}


def _int(params: dict[str, str], key: str) -> int:
    try:
        return int(params[key])
    except ValueError as exc:
        raise ThinvmError(f"--param {key}={params[key]!r}: want a whole number") from exc


def _float(params: dict[str, str], key: str) -> float:
    try:
        return float(params[key])
    except ValueError as exc:
        raise ThinvmError(f"--param {key}={params[key]!r}: want a number") from exc


# -- 1. inflate -------------------------------------------------------------


DRIVER_PARAMS = "/sys/module/thinvm_balloon/parameters"


def driver_requests(vm: VM) -> Metrics:
    """Virtqueue round trips our guest driver made (its own counters)."""
    names = ("inflate_requests", "deflate_requests", "range_requests")
    out = vm.agent.run(f"cd {DRIVER_PARAMS} && grep -H . " + " ".join(names)).stdout
    metrics: Metrics = {}
    for line in out.splitlines():
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            metrics[f"driver_{name}"] = int(value)
    return metrics


def make_inflate(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    fraction = _float(params, "fraction")
    if not 0 < fraction < 1:
        raise ThinvmError(f"--param fraction={fraction}: want a fraction between 0 and 1")
    keep = int(size * (1 - fraction)) // MiB * MiB
    timeout = 60 + 30 * size / GiB
    # Debian's kernels zero every page they allocate (init_on_alloc=1),
    # balloon pages included; under TCG that zeroing dominates inflation
    # for every driver.  init_on_alloc=0 measures the balloon itself.
    init_on_alloc = params["init_on_alloc"]
    if init_on_alloc not in ("0", "1"):
        raise ThinvmError(f"--param init_on_alloc={init_on_alloc}: want 0 or 1")

    def variant(touched: bool, stack: Stack = LEGACY) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            metrics: Metrics = {}
            config = stack_config(opts, "b-inflate", size, stack)
            config.append = f"{config.append} init_on_alloc={init_on_alloc}".strip()
            with VM(config).start() as vm:
                ctx.note("boot_s", vm.boot_seconds)
                if touched:
                    ctx.step("guest touches its free memory")
                    # Leave the guest its watermarks: they grow with its RAM.
                    metrics.update(touch_most(vm, leave=max(TOUCH_LEAVE, size // 32)))
                before = vm.host_memory()
                ctx.step(f"inflating to {format_size(keep)}")
                with SyscallCounter([vm.pid or 0], opts.counter) as inflate:
                    balloon.set_target(vm, keep)
                    inflate_s = balloon.wait_actual(vm, keep, timeout=timeout)
                inflated = vm.host_memory()
                ctx.step("deflating")
                with SyscallCounter([vm.pid or 0], opts.counter) as deflate:
                    balloon.set_target(vm, size)
                    deflate_s = balloon.wait_actual(vm, size, timeout=timeout)
                after = vm.host_memory()
                if stack.driver == "thinvm":
                    metrics.update(driver_requests(vm))
            assert inflate.counts is not None and deflate.counts is not None
            metrics.update(
                {
                    "inflate_s": inflate_s,
                    "deflate_s": deflate_s,
                    "inflate_discard_calls": inflate.counts.discard,
                    "inflate_madvise_calls": inflate.counts.madvise,
                    "deflate_madvise_calls": deflate.counts.madvise,
                    "rss_before_bytes": before.rss,
                    "thp_before_bytes": before.anon_huge,
                    "rss_inflated_bytes": inflated.rss,
                    "thp_inflated_bytes": inflated.anon_huge,
                    "rss_after_bytes": after.rss,
                    "thp_after_bytes": after.anon_huge,
                }
            )
            return metrics

        return run

    return Scenario(
        name="inflate",
        title="balloon inflate and deflate",
        description=(
            f"A {format_size(size)} guest inflates its balloon until it keeps "
            f"{format_size(keep)} (the balloon holds {fraction:.1%} of its RAM), then deflates "
            "back to its full size. Times are from the `balloon` QMP command to "
            "`query-balloon` reporting the target. Discard calls: madvise calls that "
            "drop memory (DONTNEED/FREE/REMOVE) plus fallocate, made by QEMU during the "
            "inflation; deflation calls madvise(WILLNEED) once per page. RSS and THP "
            "(AnonHugePages) are the QEMU process's, before inflating, inflated, and "
            "after deflating."
        ),
        variants=[
            Variant("untouched", variant(False), "inflate right after boot"),
            Variant("touched", variant(True), "the guest first touches all its free memory"),
            Variant(
                "touched-thinvm-pfn",
                variant(True, Stack(build="patched", driver="thinvm")),
                "touched; our driver, patched QEMU without ranges (PFN arrays)",
            ),
            Variant(
                "touched-ranges",
                variant(True, Stack(build="patched", driver="thinvm", ranges=True)),
                "touched; our driver with VIRTIO_BALLOON_F_RANGES",
            ),
        ],
        main_metric="inflate_s",
        second_metric="thp_inflated_bytes",
        params={
            "size": format_size(size),
            "fraction": fraction,
            "keep": format_size(keep),
            "counter": opts.counter,
            "init_on_alloc": init_on_alloc,
        },
    )


# -- 2. migrate-idle --------------------------------------------------------


IDLE_SEED = 8


def hold_then_idle(
    ctx: RunContext, src: VM, stack: Stack, used: int, seed: int, idle: float
) -> Metrics:
    """The idle guest of the migration and save scenarios: it writes `used`
    bytes of data (a pattern the destination can verify), touches and frees
    the rest of its RAM, idles, and lets free page reporting settle."""
    ctx.note("boot_s", src.boot_seconds)
    if used:
        ctx.step(f"guest writes a {format_size(used)} pattern")
        workload.pattern_write(src.agent, used, seed)
    ctx.step("guest touches its free memory")
    metrics = touch_most(src)
    time.sleep(idle)
    if stack.reporting:
        ctx.step("waiting for free page reporting to settle")
        _settle(lambda: src.host_memory().rss, timeout=60)
    metrics["src_rss_bytes"] = src.host_memory().rss
    return metrics


def idle_migration(
    opts: BenchOptions,
    size: int,
    stack: Stack,
    transport: Transport,
    idle: float,
    used: int = 0,
) -> Callable[[RunContext], Metrics]:
    """Boot, hold `used` bytes of data, touch the rest of RAM and free it, idle, migrate.

    The destination shares the config and verifies the data.
    """

    def run(ctx: RunContext) -> Metrics:
        config = stack_config(opts, "b-idle", size, stack)
        with transport.start(config) as src:
            metrics = hold_then_idle(ctx, src, stack, used, IDLE_SEED, idle)
            with transport.start(config, incoming=True) as dst:
                result = transport.migrate(src, dst, ctx, stack.caps)
                dst_mem = dst.host_memory()
                if used:
                    _verify_pattern(dst, ctx, IDLE_SEED)
        return {**migration_metrics(result), "dst_rss_bytes": dst_mem.rss, **metrics}

    return run


def _used_fraction(params: dict[str, str]) -> float:
    used = _float(params, "used")
    if not 0 <= used < 1:
        raise ThinvmError(f"--param used={used}: want a fraction of guest RAM, 0 to below 1")
    return used


def _used_bytes(params: dict[str, str], size: int) -> int:
    """The `used` fraction of a guest of `size`, in whole MiB."""
    return int(size * _used_fraction(params)) // MiB * MiB


def make_migrate_idle(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = _float(params, "idle")
    fraction = _used_fraction(params)
    used = int(size * fraction) // MiB * MiB
    transport = Transport(opts.net)
    return Scenario(
        name="migrate-idle",
        title="idle guest migration: thinvm vs the best stock setup",
        description=(
            f"A {format_size(size)} guest writes {format_size(used)} of data "
            f"({fraction:g} of its RAM, a pattern in tmpfs), touches all but "
            f"{format_size(TOUCH_LEAVE)} of its remaining free memory and frees it (a guest "
            f"that was busy and is now idle), idles {idle:g} s (with free page reporting: "
            "until the source's RSS stops falling), then live-migrates to a new local QEMU "
            f"({transport.kind}); the destination verifies the data page by page. "
            "Free page hinting (`free-page-hint=on`) lets QEMU skip the pages the guest "
            "calls free when migration starts; free page reporting has already given the "
            "freed memory back to the host, which stock QEMU still reads as zero pages and "
            "sparse-ram skips unread. Counters come from `query-migrate`: bytes sent, "
            "normal pages, zero pages (`duplicate`); the destination RSS is what the "
            "destination host had to allocate."
        ),
        variants=[
            *(
                Variant(name, idle_migration(opts, size, stack, transport, idle, used), text)
                for name, stack, text in MIGRATION_STACKS
            ),
            # Diagnostic: thinvm's QEMU and sparse-ram with the guest's own
            # driver, to tell a slow patched path from our driver's hinting.
            Variant(
                "thinvm-stock-driver",
                idle_migration(opts, size, THINVM_STOCK_DRIVER, transport, idle, used),
                "patched QEMU, sparse-ram, multifd (2 channels); the guest kernel's own "
                "driver with hinting + reporting, no page ranges (diagnostic)",
            ),
        ],
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "idle_s": idle,
            "net": opts.net,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
        targets=[
            Target(
                "issue 13: an idle guest using 1/8 of its RAM migrates at least 3x faster "
                "with thinvm than with stock-best",
                "thinvm",
                "stock-best",
                "migration_ms",
                at_most=1 / 3,
            )
        ],
    )


# -- 2b. migrate-hinting ----------------------------------------------------


def make_migrate_hinting(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    """migrate-idle's guest with and without free page hinting, on both stacks."""
    idle = _float(params, "idle")
    used = _used_bytes(params, size)
    transport = Transport(opts.net)
    stacks = [
        ("stock-best", STOCK_BEST, "stock QEMU and driver; hinting + reporting, multifd"),
        (
            "stock-best-no-hinting",
            replace(STOCK_BEST, hint=False),
            "stock QEMU and driver; reporting, multifd",
        ),
        ("thinvm", THINVM, "patched QEMU, our driver; hinting + reporting + ranges, sparse-ram"),
        (
            "thinvm-no-hinting",
            replace(THINVM, hint=False),
            "patched QEMU, our driver; reporting + ranges, sparse-ram, multifd",
        ),
    ]
    return Scenario(
        name="migrate-hinting",
        title="does free page hinting pay? migrate-idle with and without it",
        description=(
            f"migrate-idle's guest ({format_size(size)}, {format_size(used)} of data, the "
            "rest touched, freed and reported) migrated with and without free page hinting, "
            "on stock-best's stack and on thinvm's. To hint, the guest's driver allocates "
            "its free pages, and Debian's kernels zero every page they allocate "
            "(`init_on_alloc=1`): the guest writes its free memory while it migrates, "
            "which QEMU then has to track (zero pages, dirty syncs). With free page "
            "reporting the host already got that memory back."
        ),
        variants=[
            Variant(n, idle_migration(opts, size, s, transport, idle, used), text)
            for n, s, text in stacks
        ],
        main_metric="migration_ms",
        second_metric="zero_pages",
        params={"size": format_size(size), "used": format_size(used), "idle_s": idle},
        context=transport.session,
    )


# -- 2c. migrate-postcopy ---------------------------------------------------

# migrate-postcopy: an idle guest migrated in postcopy, thinvm against stock.
#
# Postcopy hands the guest to the destination at once and pulls the rest of
# its memory afterwards.  In QEMU 10.0 it cannot use multifd, and stock QEMU
# keeps free page hinting off under postcopy (the balloon device's rule), so
# the best stock postcopy setup is free page reporting alone.  thinvm adds
# sparse-ram, which postcopy accepts since patch 0012: the destination maps
# the memory the source left out as zero at the switchover.  The best stock
# precopy setup (stock-best) runs alongside as the reference users compare
# with.

POSTCOPY_SEED = 12
# Switch as soon as the migration is under way: postcopy's point is that
# the destination runs the guest before the memory has moved.
SWITCH_AFTER_S = 0.0
POSTCOPY = {"postcopy-ram": True}

# (name, stack, postcopy, description); ratios are against the first.
POSTCOPY_STACKS: list[tuple[str, Stack, bool, str]] = [
    (
        "stock-best",
        STOCK_BEST,
        False,
        "stock QEMU and driver; hinting + reporting, precopy over multifd (the baseline)",
    ),
    (
        "postcopy-stock",
        Stack(reporting=True),
        True,
        "stock QEMU and driver; free page reporting, postcopy (hinting and multifd "
        "are not available with postcopy)",
    ),
    (
        "postcopy-thinvm",
        replace(THINVM, hint=False, multifd=False),
        True,
        "patched QEMU, our driver; reporting + page ranges, sparse-ram, postcopy",
    ),
]


def postcopy_metrics(result: migrate.MigrationResult) -> Metrics:
    """What postcopy adds to the migration counters."""
    ram: dict[str, Any] = result.raw.get("ram", {})
    return {
        "postcopy_requests": result.postcopy_requests,
        "postcopy_bytes": int(ram.get("postcopy-bytes", 0)),
    }


def make_migrate_postcopy(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = _float(params, "idle")
    used = _used_bytes(params, size)

    def variant(stack: Stack, postcopy: bool) -> Callable[[RunContext], Metrics]:
        caps = {**stack.caps, **(POSTCOPY if postcopy else {})}

        def run(ctx: RunContext) -> Metrics:
            config = stack_config(opts, "b-postcopy", size, stack)
            params = {**MIGRATION_PARAMS, **CHANNELS}
            with VM(config).start() as src:
                metrics = hold_then_idle(ctx, src, stack, used, POSTCOPY_SEED, idle)
                with VM(config, incoming=True).start() as dst:
                    migrate.set_parameters(dst, {"multifd-channels": params["multifd-channels"]})
                    ctx.step("migrating" + (" (postcopy)" if postcopy else ""))
                    result = migrate.migrate(
                        src,
                        dst,
                        caps=caps,
                        params=params,
                        postcopy_after=SWITCH_AFTER_S if postcopy else None,
                    )
                    dst_rss = dst.host_memory().rss
                    _verify_pattern(dst, ctx, POSTCOPY_SEED)
            return {
                **migration_metrics(result),
                **postcopy_metrics(result),
                "dst_rss_bytes": dst_rss,
                **metrics,
            }

        return run

    return Scenario(
        name="migrate-postcopy",
        title="idle guest migrated in postcopy: thinvm vs stock",
        description=(
            f"The idle guest of migrate-idle ({format_size(size)}, {format_size(used)} of "
            "data, the rest touched and freed, free page reporting settled) migrates over "
            "loopback and switches to postcopy as soon as the migration is under way; the "
            "destination verifies the data. Postcopy cannot use multifd in QEMU 10.0 and "
            "stock QEMU keeps free page hinting off under postcopy, so stock's best "
            "postcopy is reporting alone; thinvm adds sparse-ram (patch 0012: the "
            "destination maps what the source left out as zero at the switchover, and "
            "`downtime` includes that). `postcopy_requests` counts pages the destination "
            "guest had to wait for. Ratios are against stock-best (precopy), what users "
            "compare with."
        ),
        variants=[Variant(n, variant(s, p), text) for n, s, p, text in POSTCOPY_STACKS],
        main_metric="migration_ms",
        second_metric="downtime_ms",
        params={"size": format_size(size), "used": format_size(used), "idle_s": idle},
        targets=[
            Target(
                "thinvm's postcopy at least as fast as stock's postcopy",
                "postcopy-thinvm",
                "postcopy-stock",
                "migration_ms",
                at_most=1.0,
            )
        ],
    )


# -- 3. migrate-dirty -------------------------------------------------------

DIRTY_OUT = "/tmp/thinvm-dirty.json"


def _wait_dirty_result(vm: VM, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = vm.agent.run(f"cat {DIRTY_OUT} 2>/dev/null").stdout.strip()
        if out:
            try:
                result: dict[str, Any] = json.loads(out.splitlines()[-1])
                return result
            except ValueError as exc:
                raise ThinvmError(f"thinvm-mem dirty printed {out[-300:]!r}") from exc
        time.sleep(0.5)
    raise ThinvmError(f"thinvm-mem dirty did not finish within {timeout:.0f} s")


def make_migrate_dirty(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    wss, rate = _int(params, "wss_mib"), _int(params, "rate_mibps")
    seconds, warmup = _int(params, "seconds"), _float(params, "warmup")
    # QEMU stops the guest once it expects to send the rest within this
    # budget, so downtimes are only comparable at the same limit.
    limit = {"downtime-limit": _int(params, "downtime_limit_ms")}
    transport = Transport(opts.net)

    def variant(migrating: bool, stack: Stack) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            config = stack_config(opts, "b-dirty", size, stack)
            metrics: Metrics = {}
            with transport.start(config) as src:
                ctx.note("boot_s", src.boot_seconds)
                src.agent.check(
                    f"thinvm-mem dirty {wss} --rate {rate} --seconds {seconds} "
                    f">{DIRTY_OUT} 2>&1 </dev/null &"
                )
                ctx.step(f"workload: {wss} MiB at {rate} MiB/s for {seconds} s")
                time.sleep(warmup)
                if not migrating:
                    out = _wait_dirty_result(src, seconds + 120)
                else:
                    with transport.start(config, incoming=True) as dst:
                        result = transport.migrate(src, dst, ctx, stack.caps, limit)
                        metrics.update(migration_metrics(result))
                        ctx.step("waiting for the workload to finish on the destination")
                        out = _wait_dirty_result(dst, seconds + 120)
            ctx.note("workload", out)
            metrics["achieved_mibps"] = float(out["achieved_mibps"])
            metrics["max_stall_ms"] = float(out["max_slice_ms"])
            return metrics

        return run

    return Scenario(
        name="migrate-dirty",
        title="migration of a guest dirtying memory at a fixed rate",
        description=(
            f"A {format_size(size)} guest runs `thinvm-mem dirty {wss} --rate {rate} "
            f"--seconds {seconds}`: it faults in a {wss} MiB working set, then writes one "
            f"word per page round robin at {rate} MiB/s in 10 ms slices (a reproducible "
            f"stand-in for the seeds' kernel compile). {warmup:g} s after it starts, the "
            f"guest live-migrates (downtime-limit {limit['downtime-limit']} ms); the "
            "workload finishes on the destination. The workload's "
            "achieved rate and longest slice, compared with the same workload without "
            "migration (no-migration), are its slowdown. The guest's clock stops while "
            "the VM is paused, so the longest slice shows CPU starvation, not the "
            "downtime itself."
        ),
        variants=[
            *(Variant(name, variant(True, stack), text) for name, stack, text in MIGRATION_STACKS),
            Variant("no-migration", variant(False, STOCK_BEST), "the workload alone (stock-best)"),
        ],
        main_metric="migration_ms",
        second_metric="achieved_mibps",
        params={
            "size": format_size(size),
            "wss_mib": wss,
            "rate_mibps": rate,
            "seconds": seconds,
            "warmup_s": warmup,
            "net": opts.net,
            **MIGRATION_PARAMS,
            **CHANNELS,
            **limit,
        },
        context=transport.session,
    )


# -- 4. migrate-ballooned ---------------------------------------------------


def make_migrate_ballooned(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    small = size // 8
    transport = Transport(opts.net)

    def variant(ballooned: bool, stack: Stack) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            config = stack_config(opts, "b-balloon", size if ballooned else small, stack)
            metrics: Metrics = {}
            with transport.start(config) as src:
                ctx.note("boot_s", src.boot_seconds)
                if ballooned:
                    ctx.step(f"inflating to {format_size(small)}")
                    balloon.set_target(src, small)
                    metrics["inflate_s"] = balloon.wait_actual(
                        src, small, timeout=60 + 30 * size / GiB
                    )
                metrics["src_rss_bytes"] = src.host_memory().rss
                with transport.start(config, incoming=True) as dst:
                    result = transport.migrate(src, dst, ctx, stack.caps)
                    metrics.update(migration_metrics(result))
                    metrics["dst_rss_bytes"] = dst.host_memory().rss
            return metrics

        return run

    return Scenario(
        name="migrate-ballooned",
        title="migration of a ballooned guest vs a small guest",
        description=(
            f"A {format_size(size)} guest whose balloon leaves it {format_size(small)} "
            f"live-migrates, compared with a guest that simply has {format_size(small)}. "
            "Neither touches memory first: QEMU discards ballooned pages on the "
            "host, so the difference is the cost of scanning and sending the ballooned "
            "(zero) pages that the migration does not know it could skip. The stock "
            "driver inflates page by page, ours in ranges; the inflation is not part of "
            "the migration time."
        ),
        variants=[
            *(
                Variant(name, variant(True, stack), f"balloon to 1/8; {text}")
                for name, stack, text in MIGRATION_STACKS
            ),
            Variant(
                "small-stock-best",
                variant(False, STOCK_BEST),
                f"a {format_size(small)} guest, no balloon; stock-best",
            ),
        ],
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "small": format_size(small),
            "net": opts.net,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
        targets=[
            Target(
                f"issue 13: a guest ballooned to {format_size(small)} migrates with thinvm "
                f"within 1.3x of a {format_size(small)} guest on stock-best",
                "thinvm",
                "small-stock-best",
                "migration_ms",
                at_most=1.3,
            )
        ],
    )


# -- 5. migrate-scale -------------------------------------------------------


def scale_sizes(largest: int, smallest: int = 2 * GiB) -> list[int]:
    """2, 4, 8 ... GiB up to `largest` (or just `largest` if it is smaller)."""
    sizes, size = [], min(smallest, largest)
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def _size_name(size: int) -> str:
    return f"{size // GiB}G" if size % GiB == 0 else f"{size // MiB}M"


def _size_param(params: dict[str, str], key: str) -> int:
    try:
        return parse_size(params[key])
    except ValueError as exc:
        raise ThinvmError(f"--param {key}={params[key]!r}: want a size like 512M") from exc


STRUCT_PAGE_BYTES = 64  # sizeof(struct page) in Debian's x86_64 kernels
PAGE_BYTES = 4096  # a normal page of guest RAM as migration counts it
SCALE_SEED = 5


def memmap_bytes(zoneinfo: str) -> int:
    """The struct page array for the pages /proc/zoneinfo calls present.

    It grows with guest RAM and is initialised at boot, so every byte of
    it is data a migration has to send, sparse or not.
    """
    fields = (line.split() for line in zoneinfo.splitlines())
    return sum(int(f[1]) for f in fields if f[:1] == ["present"]) * STRUCT_PAGE_BYTES


def guest_memmap_bytes(vm: VM) -> int:
    return memmap_bytes(vm.agent.check("cat /proc/zoneinfo").stdout)


def fresh_guest_migration(
    opts: BenchOptions,
    memory: int,
    stack: Stack,
    transport: Transport,
    *,
    used: int,
    idle: float,
    params: dict[str, Any] | None = None,
) -> Callable[[RunContext], Metrics]:
    """A freshly booted guest writes `used` bytes of data, idles and migrates
    with `params` on top of the usual ones; the destination verifies the data."""

    def run(ctx: RunContext) -> Metrics:
        # Untouched guest RAM costs nothing; reserve=off only where the
        # kernel's overcommit heuristic would refuse the mapping.
        config = stack_config(opts, "b-scale", memory, stack, reserve=fits_reserved(memory))
        with transport.start(config) as src:
            ctx.note("boot_s", src.boot_seconds)
            if used:
                ctx.step(f"guest writes a {format_size(used)} pattern")
                workload.pattern_write(src.agent, used, SCALE_SEED)
            time.sleep(idle)
            metrics: Metrics = {
                "src_rss_bytes": src.host_memory().rss,
                "guest_memmap_bytes": guest_memmap_bytes(src),
            }
            with transport.start(config, incoming=True) as dst:
                result = transport.migrate(src, dst, ctx, stack.caps, params)
                metrics.update(migration_metrics(result))
                # What the pages sent held before any compression.
                metrics["payload_bytes"] = result.normal_pages * PAGE_BYTES
                metrics["dst_rss_bytes"] = dst.host_memory().rss
                if used:
                    _verify_pattern(dst, ctx, SCALE_SEED)
        return metrics

    return run


def make_migrate_scale(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = _float(params, "idle")
    used, smallest = _size_param(params, "used"), _size_param(params, "from")
    transport = Transport(opts.net)

    def variant(memory: int, stack: Stack) -> Callable[[RunContext], Metrics]:
        return fresh_guest_migration(opts, memory, stack, transport, used=used, idle=idle)

    sizes = scale_sizes(size, smallest)
    first, last = _size_name(sizes[0]), _size_name(sizes[-1])
    targets = [
        Target(
            f"issue 13: at fixed used memory, thinvm migrates a {format_size(sizes[-1])} "
            f"guest within 1.5x of the time of a {format_size(sizes[0])} one",
            f"{last}-thinvm",
            f"{first}-thinvm",
            "migration_ms",
            at_most=1.5,
        )
    ]
    return Scenario(
        name="migrate-scale",
        title="migration time and bytes vs guest size at fixed used memory",
        description=(
            f"Freshly booted guests of {', '.join(format_size(s) for s in sizes)} "
            + (f"write the same {format_size(used)} pattern into tmpfs, " if used else "")
            + f"idle {idle:g} s and live-migrate; "
            + ("the destination verifies the pattern. " if used else "")
            + "Apart from that, almost all of their RAM was never touched: stock "
            "migration scans it as zero pages (multifd: in its channels), sparse-ram "
            "skips it unread. What "
            "still grows with the guest is its kernel's struct page array "
            f"({STRUCT_PAGE_BYTES} B per 4 KiB page, column guest_memmap_bytes), "
            "which the guest initialised at boot and which has to travel. Each "
            f"size's stock-best is compared with {first}-stock-best (growth), its "
            "thinvm and legacy with stock-best of the same size."
        ),
        variants=[
            Variant(
                f"{_size_name(s)}-{name}",
                variant(s, stack),
                f"{format_size(s)} guest; {text}",
                reference=None if name == "stock-best" else f"{_size_name(s)}-stock-best",
            )
            for s in sizes
            for name, stack, text in MIGRATION_STACKS
        ],
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "sizes": [format_size(s) for s in sizes],
            "used": format_size(used),
            "idle_s": idle,
            "net": opts.net,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
        targets=targets if len(sizes) > 1 else [],
    )


# -- 5b. migrate-compress ----------------------------------------------------

COMPRESSIONS = ("none", "zlib")  # zstd is not compiled into our QEMU builds


def link_name(mbps: int) -> str:
    """1000 -> '1gbit', 400 -> '400mbit': the link a bandwidth cap models."""
    return f"{mbps // 1000}gbit" if mbps % 1000 == 0 else f"{mbps}mbit"


def compress_params(compression: str, cap_mbps: int | None) -> dict[str, Any]:
    """Migration parameters of one migrate-compress variant."""
    if compression not in COMPRESSIONS:
        raise ThinvmError(
            f"--param compression={compression!r}: choose one of {', '.join(COMPRESSIONS)}"
        )
    params: dict[str, Any] = {"multifd-compression": compression}
    if cap_mbps is not None:
        # max-bandwidth is in bytes per second; a 1 Gbit/s link moves 125 MB/s.
        params["max-bandwidth"] = cap_mbps * 1_000_000 // 8
    return params


def make_migrate_compress(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = _float(params, "idle")
    used = _size_param(params, "used")
    cap = _int(params, "cap_mbps")
    if cap <= 0:
        raise ThinvmError(f"--param cap_mbps={cap}: want a positive link speed in Mbit/s")
    compression = params["compression"]
    compress_params(compression, None)  # refuse an unknown method before any run
    if compression == "none":
        raise ThinvmError("--param compression=none: name the method to compare with none")
    transport = Transport(opts.net)
    link = link_name(cap)

    def variant(stack: Stack, method: str, capped: bool) -> Callable[[RunContext], Metrics]:
        extra = compress_params(method, cap if capped else None)
        return fresh_guest_migration(
            opts, size, stack, transport, used=used, idle=idle, params=extra
        )

    def name(stack: str, method: str, capped: bool) -> str:
        return stack + (f"-{method}" if method != "none" else "") + (f"-{link}" if capped else "")

    stacks = {n: (stack, text) for n, stack, text in MIGRATION_STACKS}
    variants = []
    for capped in (False, True):
        where = f"max-bandwidth {cap} Mbit/s ({link} link)" if capped else "uncapped"
        best, thinvm = name("stock-best", "none", capped), name("thinvm", "none", capped)
        variants += [
            Variant(
                best,
                variant(stacks["stock-best"][0], "none", capped),
                f"{stacks['stock-best'][1]}; no compression; {where}",
            ),
            Variant(
                thinvm,
                variant(stacks["thinvm"][0], "none", capped),
                f"{stacks['thinvm'][1]}; no compression; {where}",
                reference=best if capped else None,
            ),
            Variant(
                name("thinvm", compression, capped),
                variant(stacks["thinvm"][0], compression, capped),
                f"thinvm with multifd-compression={compression}; {where}",
                reference=thinvm,
            ),
        ]
    return Scenario(
        name="migrate-compress",
        title=f"does multifd compression ({compression}) pay for a big guest's own memory?",
        description=(
            f"A freshly booted {format_size(size)} guest writes a {format_size(used)} "
            f"pattern into tmpfs, idles {idle:g} s and live-migrates, as in migrate-scale; "
            "the destination verifies the pattern. Most of what thinvm still sends is "
            "populated memory the guest never wrote itself: its kernel's struct page "
            f"array ({STRUCT_PAGE_BYTES} B per 4 KiB page, column guest_memmap_bytes), "
            "initialised at boot, repetitive and compressible. thinvm migrates with "
            f"`multifd-compression` none and {compression} (both sides, 2 channels), "
            f"uncapped and with `max-bandwidth` {cap * 1_000_000 // 8:,} B/s (a {link} "
            f"link); {compression} is compared with none at the same cap, thinvm with "
            "stock-best at the same cap. Payload is the normal pages sent times 4 KiB, what the "
            "pages held before compression; bytes sent is what went over the wire."
        ),
        variants=variants,
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "idle_s": idle,
            "compression": compression,
            "cap_mbps": cap,
            "net": opts.net,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
    )


def _verify_pattern(dst: VM, ctx: RunContext, seed: int) -> None:
    ctx.step("verifying the pattern on the destination")
    check = workload.pattern_verify(dst.agent, seed)
    if not check.ok:
        raise ThinvmError(
            f"pattern check failed on the destination: {check.bad} of {check.pages} "
            f"pages differ, first at page {check.first_bad}"
        )


# -- 6. density -------------------------------------------------------------


def _parallel(vms: list[VM], func: Callable[[VM], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(vms)) as pool:
        return list(pool.map(func, vms))


def _settle(
    measure: Callable[[], int], timeout: float, quiet: float = 4.0, step: int = 8 * MiB
) -> tuple[int, float]:
    """Poll `measure` until it has not fallen by more than `step` for `quiet` s.

    Returns the final value and when the last such drop happened.
    """
    start = time.monotonic()
    low, last_drop = measure(), start
    while True:
        now = time.monotonic()
        if now - last_drop >= quiet or now - start >= timeout:
            break
        time.sleep(0.5)
        current = measure()
        if current < low - step:
            low, last_drop = current, time.monotonic()
    return measure(), last_drop - start


def make_density(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    guests = _int(params, "guests")
    fraction = _float(params, "touch")
    settle_max = _float(params, "settle_max")

    def variant(reporting: bool) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            with contextlib.ExitStack() as stack:
                vms: list[VM] = []
                ctx.step(f"booting {guests} guests")
                for i in range(guests):
                    vm = VM(guest_config(opts, f"b-dense{i}", size, reporting=reporting))
                    vms.append(stack.enter_context(vm.start(wait_agent=False)))
                for vm in vms:
                    vm.wait_agent()

                def touch(vm: VM) -> int:
                    free = workload.meminfo(vm.agent)["MemFree"] - TOUCH_LEAVE
                    amount = max(0, min(int(size * fraction), free))
                    workload.touch(vm.agent, amount)
                    return amount

                def held() -> int:
                    return sum(vm.host_memory().rss for vm in vms)

                pids = [vm.pid or 0 for vm in vms]
                with SyscallCounter(pids, opts.counter) as counter:
                    ctx.step(f"{guests} guests touch {fraction:.0%} of their RAM, then free it")
                    touched = _parallel(vms, touch)
                    peak = held()
                    ctx.step("waiting for host memory to settle")
                    final, settle_s = _settle(held, settle_max)
            assert counter.counts is not None
            return {
                "held_bytes": final,
                "held_per_guest_bytes": final / guests,
                "peak_bytes": peak,
                "settle_s": settle_s,
                "discard_calls": counter.counts.discard,
                "touched_bytes": sum(touched),
            }

        return run

    return Scenario(
        name="density",
        title="host memory held by guests after they free memory",
        description=(
            f"{guests} guests of {format_size(size)} boot together, each touches "
            f"{fraction:.0%} of its RAM (at most its free memory less "
            f"{format_size(TOUCH_LEAVE)}) and frees it. Then the host memory the QEMU "
            "processes still hold (sum of RSS) is measured once it stops falling (no drop "
            f"over 8 MiB for 4 s, at most {settle_max:g} s). With free page reporting "
            "(`free-page-reporting=on`) the guest reports freed 2 MiB+ blocks and QEMU "
            "discards them; without it the host keeps everything the guests ever touched."
        ),
        variants=[
            Variant("reporting-off", variant(False), "no free page reporting"),
            Variant("reporting-on", variant(True), "free-page-reporting=on"),
        ],
        main_metric="held_bytes",
        second_metric="settle_s",
        params={
            "size": format_size(size),
            "guests": guests,
            "touch": fraction,
            "settle_max_s": settle_max,
        },
    )


# -- 6b. density-budget (memory cgroup) -------------------------------------


def make_density_budget(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    budget = parse_size(params["budget"])
    max_guests = _int(params, "max_guests")
    fraction = _float(params, "touch")
    settle_max = _float(params, "settle_max")

    def variant(reporting: bool) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            fit, held = 0, 0
            with memory_cgroup(budget) as cgroup, contextlib.ExitStack() as stack:
                vms: list[VM] = []
                for i in range(max_guests):
                    ctx.step(f"guest {i + 1}: booting ({fit} fit so far)")
                    try:
                        vms.append(_start_in(cgroup, stack, opts, f"b-budget{i}", size, reporting))
                        vm = vms[-1]
                        free = workload.meminfo(vm.agent)["MemFree"] - TOUCH_LEAVE
                        ctx.step(f"guest {i + 1}: touching and freeing")
                        workload.touch(vm.agent, max(0, min(int(size * fraction), free)))
                        _settle(cgroup.usage, settle_max)
                    except ThinvmError as exc:
                        ctx.note("stopped_by", str(exc)[:300])
                        break
                    if not all(v.alive() for v in vms):
                        ctx.note("stopped_by", "a guest was OOM-killed")
                        break
                    fit, held = i + 1, cgroup.usage()
                ctx.note("capped", fit == max_guests)
                oom, peak = cgroup.oom_kills(), cgroup.max_usage()
            return {
                "fit_guests": fit,
                "oom_guests": oom,
                "held_bytes": held,
                "peak_bytes": peak,
            }

        return run

    return Scenario(
        name="density-budget",
        title="how many guests fit under a memory cgroup budget",
        description=(
            f"Guests of {format_size(size)} start one after another inside a cgroup-v1 "
            f"memory cgroup limited to {format_size(budget)} (no swap). Each touches "
            f"{fraction:.0%} of its RAM and frees it; once the cgroup's usage settles the "
            "next one starts. A guest fits if it finished that cycle with every guest "
            "before it still alive; the first failure (the kernel's OOM killer ends a "
            f"QEMU, or a guest cannot boot) stops the run. At most {max_guests} guests "
            "are tried. `held` is the cgroup's usage with every fitting guest idle."
        ),
        variants=[
            Variant("reporting-off", variant(False), "no free page reporting"),
            Variant("reporting-on", variant(True), "free-page-reporting=on"),
        ],
        main_metric="fit_guests",
        second_metric="held_bytes",
        params={
            "size": format_size(size),
            "budget": format_size(budget),
            "max_guests": max_guests,
            "touch": fraction,
            "settle_max_s": settle_max,
        },
    )


def _start_in(
    cgroup: MemoryCgroup,
    stack: contextlib.ExitStack,
    opts: BenchOptions,
    name: str,
    size: int,
    reporting: bool,
) -> VM:
    vm = VM(guest_config(opts, name, size, reporting=reporting))
    with spawn_in(cgroup):
        vm.start(wait_agent=False)
    # Kill rather than `quit` at the end: a QEMU the OOM killer is taking
    # down can still look alive and drop the QMP connection mid-command.
    stack.callback(vm.kill)
    vm.wait_agent()
    return vm


# -- 7. start ---------------------------------------------------------------


def make_start(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    def variant(prealloc: bool, threads: int) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            config = guest_config(
                opts, "b-start", size, prealloc=prealloc, prealloc_threads=threads
            )
            vm = VM(config)
            with vm.start(wait_agent=False):
                assert vm.pid is not None
                qmp_s = process_age(vm.pid)
                ctx.step("waiting for the guest agent")
                vm.wait_agent()
                boot_s = process_age(vm.pid)
                mem = vm.host_memory()
            return {
                "boot_s": boot_s,
                "qmp_s": qmp_s,
                "rss_after_bytes": mem.rss,
                "thp_after_bytes": mem.anon_huge,
            }

        return run

    def pool_variant(kind: str) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            ctx.step(f"filling a {kind} pool slot")
            began = time.monotonic()
            with pool.temporary_pool(kind, size, tag=f"b-start-{kind}") as warm:
                fill_s = time.monotonic() - began
                start = pooled.start_from_pool(guest_config(opts, "b-start", size), warm.root)
                with start.vm as vm:
                    if not start.pooled:
                        raise ThinvmError(f"no warm slot: {start.lease}")
                    mem = vm.host_memory()
            # QEMU's RSS leaves out hugetlbfs memory: not comparable across kinds.
            return {
                "boot_s": start.agent_s,
                "qmp_s": start.qmp_s,
                "rss_after_bytes": mem.rss,
                "thp_after_bytes": mem.anon_huge,
                "pool_fill_s": fill_s,
            }

        return run

    return Scenario(
        name="start",
        title="VM start: launch to guest agent ready, preallocated RAM",
        description=(
            f"A {format_size(size)} guest starts with all of its RAM preallocated "
            "(`prealloc=on` on the memory backend, 1 or 2 `prealloc-threads`), compared "
            "with no preallocation. Times are from the QEMU process's start (its "
            "/proc start time) to QMP answering (preallocation is done by then) and to "
            "the guest agent answering."
        ),
        variants=[
            Variant("prealloc-1", variant(True, 1), "prealloc=on, 1 thread"),
            Variant("prealloc-2", variant(True, 2), "prealloc=on, 2 threads"),
            Variant("no-prealloc", variant(False, 1), "prealloc=off (reference)"),
            Variant("pool-hugetlbfs", pool_variant("hugetlbfs"), "warm pool slot on hugetlbfs"),
            Variant("pool-tmpfs", pool_variant("tmpfs"), "warm pool slot on tmpfs"),
        ],
        main_metric="qmp_s",
        second_metric="boot_s",
        params={"size": format_size(size)},
    )


# -- 8. network -------------------------------------------------------------


def make_network(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = _float(params, "idle")
    rate = params["rate"]
    used = _used_bytes(params, size)
    loopback, veth = Transport("loopback"), Transport("veth", rate)
    variants = [
        Variant(
            f"{t.kind}-{name}",
            idle_migration(opts, size, stack, t, idle, used),
            f"{text}; over {t.kind}",
            # Over veth, thinvm and legacy against stock-best over veth.
            reference="veth-stock-best" if t.kind == "veth" and name != "stock-best" else None,
        )
        for t in (loopback, veth)
        for name, stack, text in MIGRATION_STACKS
    ]
    return Scenario(
        name="network",
        title=f"idle guest migration over loopback vs a {rate} veth link",
        description=(
            f"migrate-idle ({format_size(size)} guest holding {format_size(used)} of data "
            "touches its free memory, frees it, migrates) over loopback and over a veth "
            "pair between two network namespaces, "
            f"source in one and destination in the other, each end shaped to {rate} with a "
            "tc token bucket (the seeds' network). Shows whether the transport or the "
            "host CPU limits migration here. Over veth, thinvm and legacy are compared "
            "with stock-best over veth; veth-stock-best with loopback-stock-best."
        ),
        variants=variants,
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "rate": rate,
            "idle_s": idle,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=veth.session,
    )


# -- 9. save-restore ---------------------------------------------------------

SAVE_SEED = 9
# Saving to a file: stock's best is mapped-ram (every page at a fixed file
# offset, zero pages left as holes) over multifd, what libvirt's parallel
# save uses.  thinvm saves the same way (multifd to a file needs
# mapped-ram) with sparse-ram on top: the difference is only that the
# pages the host never populated are not read at all, where stock-best's
# channels read them and find them zero.
SAVE_STACKS: list[tuple[str, Stack, dict[str, bool], str]] = [
    (
        "stock-best",
        STOCK_BEST,
        {"mapped-ram": True},
        "stock QEMU and driver; hinting + reporting, mapped-ram over multifd (2 channels)",
    ),
    (
        "thinvm",
        THINVM,
        {"mapped-ram": True},
        "patched QEMU, our driver; hinting + reporting + ranges, sparse-ram, mapped-ram "
        "over multifd (2 channels)",
    ),
    ("legacy", LEGACY, {}, "stock QEMU and driver, no extras, one stream (reference)"),
]


def _restore(config: VMConfig, uri: str, caps: dict[str, bool], ctx: RunContext) -> VM:
    """A new QEMU that loads the saved file and runs; returns it (caller owns it)."""
    dst = VM(config, incoming=True).start()
    try:
        migrate.set_capabilities(dst, caps)
        migrate.set_parameters(dst, dict(CHANNELS))
        ctx.step("restoring")
        dst.qmp("migrate-incoming", uri=uri)
        migrate.wait_destination_status(dst, "running", timeout=600)
    except BaseException:
        dst.kill()
        raise
    return dst


def make_save_restore(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = _float(params, "idle")
    fraction = _used_fraction(params)
    used = int(size * fraction) // MiB * MiB

    def variant(stack: Stack, extra: dict[str, bool]) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            config = stack_config(opts, "b-save", size, stack)
            caps = {**stack.caps, **extra}
            path = cache_dir() / "bench-save" / f"{ctx.variant}-{os.getpid()}.mig"
            path.parent.mkdir(parents=True, exist_ok=True)
            uri = f"file:{path}"
            try:
                with VM(config).start() as src:
                    metrics = hold_then_idle(ctx, src, stack, used, SAVE_SEED, idle)
                    ctx.step(f"saving to {path.name}")
                    result = migrate.migrate_to_uri(
                        src, uri, caps=caps, params={**MIGRATION_PARAMS, **CHANNELS}
                    )
                st = path.stat()
                began = time.monotonic()
                with _restore(config, uri, caps, ctx) as dst:
                    restore_ms = (time.monotonic() - began) * 1000
                    dst.wait_agent(timeout=60)
                    if used:
                        _verify_pattern(dst, ctx, SAVE_SEED)
                    dst_rss = dst.host_memory().rss
            finally:
                path.unlink(missing_ok=True)
            return {
                "save_ms": result.total_time_ms,
                "restore_ms": restore_ms,
                "file_bytes": st.st_blocks * 512,
                "file_size_bytes": st.st_size,
                "transferred_bytes": result.transferred,
                "normal_pages": result.normal_pages,
                "zero_pages": result.zero_pages,
                "sparse_skipped_pages": result.sparse_skipped,
                "dst_rss_bytes": dst_rss,
                **metrics,
            }

        return run

    targets = [
        Target(
            f"issue 13: save/restore of a mostly idle guest at least 5x smaller and "
            f"faster with thinvm than with stock-best ({what})",
            "thinvm",
            "stock-best",
            metric,
            at_most=0.2,
        )
        for metric, what in (
            ("file_bytes", "allocated file size"),
            ("save_ms", "save time"),
            ("restore_ms", "restore time"),
        )
    ]
    return Scenario(
        name="save-restore",
        title="save to a file and restore, thinvm vs stock-best",
        description=(
            f"A {format_size(size)} guest writes {format_size(used)} of data "
            f"({fraction:g} of its RAM, a pattern in tmpfs), touches the rest of its free "
            f"memory and frees it, idles {idle:g} s (with free page reporting: until the "
            "source's RSS stops falling), then `migrate` saves it to `file:` on the host's "
            "disk (page cache); a new QEMU restores it from that file "
            "(`migrate-incoming`) and verifies the data page by page. Save time is "
            "`query-migrate`'s total time; restore time is from `migrate-incoming` until "
            "the guest runs again. File bytes are the blocks the file holds on disk "
            "(mapped-ram leaves zero pages as holes); file size is its apparent size."
        ),
        variants=[
            Variant(name, variant(stack, extra), text) for name, stack, extra, text in SAVE_STACKS
        ],
        main_metric="save_ms",
        second_metric="file_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "idle_s": idle,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        targets=targets,
    )


# -- registry ---------------------------------------------------------------


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    title: str
    make: Callable[[BenchOptions, dict[str, str], int], Scenario]
    default_size: str
    size_help: str
    default_runs: int = 3
    params: dict[str, str] = field(default_factory=dict)
    todo: str = ""

    def build(self, options: BenchOptions) -> Scenario:
        size = options.size or parse_size(self.default_size)
        params = _params(self.params, options.params, self.name)
        scenario = self.make(options, params, size)
        scenario.params.setdefault("build", options.build)
        return scenario

    @property
    def command(self) -> str:
        return f"thinvm bench {self.name}"


SCENARIOS: dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in (
        ScenarioSpec(
            "inflate",
            "balloon inflate to 7/8 and deflate",
            make_inflate,
            "4G",
            "guest RAM (8G on bigger hosts)",
            default_runs=2,
            params={"fraction": "0.875", "init_on_alloc": "1"},
        ),
        ScenarioSpec(
            "migrate-idle",
            "idle guest using 1/8 of its RAM: thinvm vs stock-best",
            make_migrate_idle,
            "2G",
            "guest RAM",
            default_runs=3,
            params={"idle": "2", "used": "0.125"},
        ),
        ScenarioSpec(
            "migrate-hinting",
            "does free page hinting pay? migrate-idle with and without it",
            make_migrate_hinting,
            "2G",
            "guest RAM",
            default_runs=3,
            params={"idle": "2", "used": "0.125"},
        ),
        ScenarioSpec(
            "migrate-dirty",
            "migration under a fixed-rate dirtying workload",
            make_migrate_dirty,
            "1G",
            "guest RAM",
            default_runs=2,
            params={
                "wss_mib": "512",
                "rate_mibps": "256",
                "seconds": "20",
                "warmup": "6",
                "downtime_limit_ms": "300",
            },
        ),
        ScenarioSpec(
            "migrate-ballooned",
            "ballooned guest vs small guest migration, thinvm vs stock-best",
            make_migrate_ballooned,
            "4G",
            "RAM of the ballooned guest (the small one has 1/8)",
        ),
        ScenarioSpec(
            "migrate-scale",
            "migration vs guest size at fixed used memory",
            make_migrate_scale,
            "8G",
            "largest guest; sizes double from `from` up to it",
            default_runs=2,
            params={"idle": "2", "used": "512M", "from": "2G"},
        ),
        ScenarioSpec(
            "migrate-compress",
            "multifd compression none vs zlib for a big guest, uncapped and on a 1 Gbit/s link",
            make_migrate_compress,
            "16G",
            "guest RAM",
            default_runs=3,
            params={"idle": "2", "used": "512M", "compression": "zlib", "cap_mbps": "1000"},
        ),
        ScenarioSpec(
            "density",
            "host memory held after guests free memory",
            make_density,
            "1G",
            "RAM per guest",
            default_runs=2,
            params={"guests": "3", "touch": "0.8", "settle_max": "30"},
        ),
        ScenarioSpec(
            "density-budget",
            "guests that fit under a memory cgroup",
            make_density_budget,
            "512M",
            "RAM per guest",
            default_runs=1,
            params={"budget": "1G", "max_guests": "8", "touch": "0.8", "settle_max": "20"},
        ),
        ScenarioSpec(**overcommit.SPEC),
        ScenarioSpec(**fleet_bench.SPEC),
        ScenarioSpec(
            "migrate-postcopy",
            "idle guest migrated in postcopy: thinvm vs stock",
            make_migrate_postcopy,
            "4G",
            "guest RAM",
            default_runs=3,
            params={"used": "0.125", "idle": "2"},
        ),
        ScenarioSpec(
            "start",
            "launch to agent ready with preallocation",
            make_start,
            "4G",
            "guest RAM (16G on bigger hosts)",
        ),
        ScenarioSpec(
            "network",
            "migration over loopback vs a shaped veth pair",
            make_network,
            "1G",
            "guest RAM",
            default_runs=2,
            params={"idle": "2", "used": "0.125", "rate": "10gbit"},
        ),
        ScenarioSpec(
            "save-restore",
            "save to a file and restore: thinvm vs stock-best",
            make_save_restore,
            "4G",
            "guest RAM",
            default_runs=2,
            params={"idle": "2", "used": "0.125"},
        ),
    )
}


def get(name: str) -> ScenarioSpec:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ThinvmError(
            f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}"
        ) from None


def describe_spec(spec: ScenarioSpec) -> str:
    params = " ".join(f"--param {k}={v}" for k, v in spec.params.items())
    return (
        f"{spec.name:18} {spec.title}\n{'':18} --size {spec.default_size} ({spec.size_help}), "
        f"--runs {spec.default_runs}" + (f", {params}" if params else "")
    )


# Parts of issue 4 the registry does not cover (yet); listed in the docs.
TODO: list[CatalogueEntry] = []


def catalogue() -> list[CatalogueEntry]:
    entries = [
        CatalogueEntry(spec.name, spec.title, spec.command, spec.todo)
        for spec in SCENARIOS.values()
    ]
    return entries + TODO
