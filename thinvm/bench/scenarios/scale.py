"""Freshly booted guests of growing size: migrate-scale and migrate-compress."""

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from thinvm.bench.scenarios.common import (
    STOCK_CANDIDATES,
    Candidate,
    fits_reserved,
    migration_rows,
    verify_pattern,
)
from thinvm.bench.scenarios.params import (
    float_param,
    int_param,
    size_param,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.transport import (
    CHANNELS,
    MIGRATION_PARAMS,
    Transport,
)
from thinvm.bench.types import BenchOptions, Best, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.units import GiB, MiB, format_size
from thinvm.vm.machine import VM
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack


def scale_sizes(largest: int, smallest: int = 2 * GiB) -> list[int]:
    """2, 4, 8 ... GiB up to `largest` (or just `largest` if it is smaller)."""
    sizes, size = [], min(smallest, largest)
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def _size_name(size: int) -> str:
    return f"{size // GiB}G" if size % GiB == 0 else f"{size // MiB}M"


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
        config = opts.vm_config("b-scale", memory, stack, reserve=fits_reserved(memory))
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
                migrated = transport.migrate(src, dst, ctx, stack.caps, params)
                metrics.update(migrated.metrics)
                # What the pages sent held before any compression.
                metrics["payload_bytes"] = migrated.result.normal_pages * PAGE_BYTES
                metrics["dst_rss_bytes"] = dst.host_memory().rss
                if used:
                    verify_pattern(dst, ctx, SCALE_SEED)
        return metrics

    return run


def make_migrate_scale(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    used, smallest = size_param(params, "used"), size_param(params, "from")
    transport = Transport(opts.net, vm_class=opts.vm_class, pin=opts.pin_sides)

    def variant(memory: int, c: Candidate) -> Callable[[RunContext], Metrics]:
        return fresh_guest_migration(
            opts, memory, c.stack, transport, used=used, idle=idle, params=c.params
        )

    sizes = scale_sizes(size, smallest)
    variants: list[Variant] = []
    best: list[Best] = []
    for s in sizes:
        # Each size's rows against stock-best of that size; its stock-best
        # against the first size's (growth).
        rows = migration_rows(
            functools.partial(variant, s),
            prefix=f"{_size_name(s)}-",
            what=f"{format_size(s)} guest; ",
            reference=f"{_size_name(s)}-stock-best",
        )
        variants += rows[0]
        best += rows[1]
    first = _size_name(sizes[0])
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
            f"size's stock-best is compared with {first}-stock-best (growth), every "
            "other row with stock-best of the same size."
        ),
        variants=variants,
        best=best,
        baseline=f"{first}-stock-best",
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "sizes": [format_size(s) for s in sizes],
            "used": format_size(used),
            "idle_s": idle,
            "net": opts.net,
            **({"link": transport.rate} if opts.net == "veth" else {}),
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
        targets=scale_targets(sizes, link=opts.net == "veth"),
    )


def scale_targets(sizes: list[int], *, link: bool = False) -> list[Target]:
    """Growth at fixed used memory (with more than one size), the biggest
    guest against stock-best of its size, and over a shaped link thinvm
    against the link's own time for what it sent."""
    first, last = _size_name(sizes[0]), _size_name(sizes[-1])
    growth = Target(
        f"issue 13: at fixed used memory, thinvm migrates a {format_size(sizes[-1])} "
        f"guest within 1.5x of the time of a {format_size(sizes[0])} one",
        f"{last}-thinvm",
        f"{first}-thinvm",
        "migration_ms",
        at_most=1.5,
    )
    against_stock = [
        Target(
            f"issue 48: a {format_size(sizes[-1])} guest migrates at least 3x faster "
            "with thinvm than with stock-best, each side on its own CPU",
            f"{last}-thinvm",
            f"{last}-stock-best",
            "migration_ms",
            at_most=1 / 3,
        ),
        Target(
            f"issue 48: thinvm's whole source QEMU uses at most 1/10 of stock-best's "
            f"CPU seconds for a {format_size(sizes[-1])} guest",
            f"{last}-thinvm",
            f"{last}-stock-best",
            "src_cpu_s",
            at_most=1 / 10,
        ),
    ]
    # What is left when skipping has removed every page it can: the data
    # and the guest's page descriptors, which must cross the link.
    against_link = Target(
        f"issue 48: a {format_size(sizes[-1])} guest migrates with thinvm within 1.3x "
        "of the time the link needs for the bytes it sends",
        f"{last}-thinvm",
        f"{last}-thinvm",
        "migration_ms",
        at_most=1.3,
        reference_metric="link_ms",
    )
    targets = [growth] if len(sizes) > 1 else []
    return [*targets, *against_stock, *([against_link] if link else [])]


# multifd's methods in QEMU 10.0 that our builds have (qemu/build.sh
# enables zstd; qpl, uadk and qatzip want hardware this host lacks).
COMPRESSIONS = ("none", "zlib", "zstd")


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


def compress_variant_name(stack: str, method: str, link: str | None) -> str:
    """'thinvm', 'stock-zstd', 'thinvm-zlib-1gbit': stack, method unless
    none, the link a cap models if capped."""
    return stack + (f"-{method}" if method != "none" else "") + (f"-{link}" if link else "")


STOCK_MULTIFD = "stock-mfd2"  # the stock candidate compression is set on


def compress_candidates(compression: str) -> list[Candidate]:
    """stock-best's candidates (issue 48): every stock configuration the
    migration scenarios measure, and stock's multifd (2 channels) with
    `compression`, which is a stock configuration too."""
    compressed = Candidate(
        compress_variant_name("stock", compression, None),
        STOCK_BEST,
        f"stock QEMU and driver; reporting, multifd (2 channels), "
        f"multifd-compression={compression}",
        {"multifd-compression": compression},
    )
    return [*STOCK_CANDIDATES, compressed]


THINVM_TEXT = "patched QEMU, our driver; reporting + page ranges, sparse-ram, multifd (2 channels)"


@dataclass(frozen=True)
class CompressRun:
    """What every migrate-compress row shares: one fresh guest's migration."""

    opts: BenchOptions
    size: int
    used: int
    idle: float
    cap: int  # Mbit/s of the capped rows
    transport: Transport

    def of(self, candidate: Candidate, capped: bool) -> Callable[[RunContext], Metrics]:
        method = candidate.params.get("multifd-compression", "none")
        extra = {**candidate.params, **compress_params(method, self.cap if capped else None)}
        return fresh_guest_migration(
            self.opts, self.size, candidate.stack, self.transport, used=self.used,
            idle=self.idle, params=extra,
        )  # fmt: skip


def compress_rows(
    run: CompressRun, compression: str, link: str | None, where: str
) -> tuple[list[Variant], Best]:
    """migrate-compress's rows at one cap (link None: uncapped): every stock
    candidate, stock-best chosen among them, thinvm with and without
    `compression`.  Compression is compared with none on the same stack,
    thinvm with stock-best at the same cap."""
    suffix = f"-{link}" if link else ""
    best = f"stock-best{suffix}"
    capped = link is not None
    compressed = compress_variant_name("stock", compression, None)
    variants = [
        Variant(
            c.name + suffix,
            run.of(c, capped),
            f"{c.description}; {where}",
            reference=STOCK_MULTIFD + suffix if c.name == compressed else best,
        )
        for c in compress_candidates(compression)
    ]
    chosen = Best(
        best,
        tuple(v.name for v in variants),
        f"the best stock configuration measured; {where}",
    )
    thinvm = Candidate("thinvm", THINVM, THINVM_TEXT)
    thinvm_compressed = Candidate(
        compress_variant_name("thinvm", compression, None),
        THINVM,
        f"{THINVM_TEXT}, multifd-compression={compression}",
        {"multifd-compression": compression},
    )
    variants += [
        Variant("thinvm" + suffix, run.of(thinvm, capped), f"{thinvm.description}; {where}",
                reference=best if capped else None),
        Variant(thinvm_compressed.name + suffix, run.of(thinvm_compressed, capped),
                f"{thinvm_compressed.description}; {where}", reference="thinvm" + suffix),
    ]  # fmt: skip
    return variants, chosen


def compress_variants(
    run: CompressRun, compression: str, link: str | None, uncapped: str
) -> tuple[list[Variant], list[Best]]:
    """The rows uncapped and, with a link, capped to it."""
    variants, best = compress_rows(run, compression, None, uncapped)
    if link is None:
        return variants, [best]
    where = f"max-bandwidth {run.cap} Mbit/s ({link} link)"
    capped, capped_best = compress_rows(run, compression, link, where)
    return variants + capped, [best, capped_best]


def make_migrate_compress(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    used = size_param(params, "used")
    cap = int_param(params, "cap_mbps")
    if cap < 0:
        raise ThinvmError(
            f"--param cap_mbps={cap}: want a link speed in Mbit/s (0: no capped rows)"
        )
    compression = params["compression"]
    compress_params(compression, None)  # refuse an unknown method before any run
    if compression == "none":
        raise ThinvmError("--param compression=none: name the method to compare with none")
    rate = params["rate"]
    transport = Transport(opts.net, rate, vm_class=opts.vm_class, pin=opts.pin_sides)
    link = link_name(cap) if cap else None
    # Where the uncapped rows migrate: loopback is as fast as the CPUs.
    uncapped = f"over a {rate} veth link" if opts.net == "veth" else "uncapped over loopback"

    run = CompressRun(opts, size, used, idle, cap, transport)
    variants, best = compress_variants(run, compression, link, uncapped)
    capped_text = (
        f" and with `max-bandwidth` {cap * 1_000_000 // 8:,} B/s (a {link} link)" if link else ""
    )
    return Scenario(
        name="migrate-compress",
        title=f"does multifd compression ({compression}) pay for a big guest's own memory?",
        description=(
            f"A freshly booted {format_size(size)} guest writes a {format_size(used)} "
            f"pattern into tmpfs, idles {idle:g} s and live-migrates, as in migrate-scale; "
            "the destination verifies the pattern. Most of what thinvm still sends is "
            "populated memory the guest never wrote itself: its kernel's struct page "
            f"array ({STRUCT_PAGE_BYTES} B per 4 KiB page, column guest_memmap_bytes), "
            "initialised at boot, repetitive and compressible; stock-best sends the "
            "same pages and reads the untouched rest as zero pages, which multifd "
            "finds before it compresses. Both stacks migrate with "
            f"`multifd-compression` none and {compression} (both sides, 2 channels, "
            f"QEMU's default level) and stock also in its other configurations, "
            f"{uncapped}{capped_text}. At each cap stock-best is the "
            "stock configuration with the lowest median migration time among those the "
            f"migration scenarios measure and stock's multifd with {compression}; "
            f"{compression} is compared with none on the same stack (stock-{compression} "
            f"with {STOCK_MULTIFD}), thinvm with stock-best at the same cap. Payload is "
            "the normal pages sent times 4 KiB, what the pages held before compression; "
            "bytes sent is what went over the wire; the CPU columns show what "
            "compressing and decompressing cost the two QEMUs."
        ),
        variants=variants,
        best=best,
        baseline="stock-best",
        main_metric="migration_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "used": format_size(used),
            "idle_s": idle,
            "compression": compression,
            "cap_mbps": cap,
            "net": opts.net,
            **({"rate": rate} if opts.net == "veth" else {}),
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
    )


SPEC = ScenarioSpec(
    "migrate-scale",
    "migration vs guest size at fixed used memory",
    make_migrate_scale,
    "8G",
    "largest guest; sizes double from `from` up to it",
    default_runs=2,
    params={"idle": "2", "used": "512M", "from": "2G"},
)
COMPRESS_SPEC = ScenarioSpec(
    "migrate-compress",
    "multifd compression none vs zstd (or zlib), stock-best and thinvm, for a big "
    "guest: uncapped (or over veth) and on a 1 Gbit/s link",
    make_migrate_compress,
    "16G",
    "guest RAM",
    default_runs=3,
    # rate: the veth link's (--net veth); cap_mbps=0: no capped rows.
    params={
        "idle": "2",
        "used": "512M",
        "compression": "zstd",
        "cap_mbps": "1000",
        "rate": "10gbit",
    },
)
