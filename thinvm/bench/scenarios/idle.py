"""Idle guests migrating: migrate-idle and network.  Whether free page
hinting pays is measured in every migration scenario (its `-hint`
candidates); the migrate-hinting scenario that asked it alone is retired."""

import functools
from collections.abc import Callable
from typing import Any

from thinvm.bench.scenarios.common import (
    THINVM_STOCK_DRIVER,
    TOUCH_LEAVE,
    Candidate,
    hold_then_idle,
    migration_rows,
    verify_pattern,
)
from thinvm.bench.scenarios.params import (
    float_param,
    used_bytes,
    used_fraction,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.transport import (
    CHANNELS,
    MIGRATION_PARAMS,
    Transport,
)
from thinvm.bench.types import (
    BenchOptions,
    Best,
    Metrics,
    RunContext,
    Scenario,
    Target,
    Variant,
)
from thinvm.units import MiB, format_size
from thinvm.vm.stack import Stack

IDLE_SEED = 8


def idle_migration(
    opts: BenchOptions,
    size: int,
    stack: Stack,
    transport: Transport,
    idle: float,
    used: int = 0,
    params: dict[str, Any] | None = None,
) -> Callable[[RunContext], Metrics]:
    """Boot, hold `used` bytes of data, touch the rest of RAM and free it, idle, migrate
    (with `params` on top of the usual ones).

    The destination shares the config and verifies the data.
    """

    def run(ctx: RunContext) -> Metrics:
        config = opts.vm_config("b-idle", size, stack)
        with transport.start(config) as src:
            metrics = hold_then_idle(ctx, src, stack, used, IDLE_SEED, idle)
            with transport.start(config, incoming=True) as dst:
                migrated = transport.migrate(src, dst, ctx, stack.caps, params)
                dst_mem = dst.host_memory()
                if used:
                    verify_pattern(dst, ctx, IDLE_SEED)
        return {**migrated.metrics, "dst_rss_bytes": dst_mem.rss, **metrics}

    return run


def make_migrate_idle(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    fraction = used_fraction(params)
    used = int(size * fraction) // MiB * MiB
    transport = Transport(opts.net, vm_class=opts.vm_class, pin=opts.pin_sides)

    def make(c: Candidate) -> Callable[[RunContext], Metrics]:
        return idle_migration(opts, size, c.stack, transport, idle, used, c.params)

    variants, best = migration_rows(make)
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
            *variants,
            # Diagnostic: thinvm's QEMU and sparse-ram with the guest's own
            # driver, to tell a slow patched path from our driver's hinting.
            Variant(
                "thinvm-stock-driver",
                idle_migration(opts, size, THINVM_STOCK_DRIVER, transport, idle, used),
                "patched QEMU, sparse-ram, multifd (2 channels); the guest kernel's own "
                "driver with reporting, no page ranges (diagnostic)",
            ),
        ],
        best=best,
        baseline="stock-best",
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


def make_network(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    rate = params["rate"]
    used = used_bytes(params, size)
    loopback, veth = (
        Transport("loopback", vm_class=opts.vm_class, pin=opts.pin_sides),
        Transport("veth", rate, vm_class=opts.vm_class, pin=opts.pin_sides),
    )
    variants: list[Variant] = []
    best: list[Best] = []

    def make(t: Transport, c: Candidate) -> Callable[[RunContext], Metrics]:
        return idle_migration(opts, size, c.stack, t, idle, used, c.params)

    for t in (loopback, veth):
        # Over veth, everything but stock-best against stock-best over veth.
        reference = "veth-stock-best" if t.kind == "veth" else None
        rows = migration_rows(
            functools.partial(make, t),
            prefix=f"{t.kind}-",
            what=f"over {t.kind}: ",
            reference=reference,
        )
        variants += rows[0]
        best += rows[1]
    return Scenario(
        name="network",
        title=f"idle guest migration over loopback vs a {rate} veth link",
        description=(
            f"migrate-idle ({format_size(size)} guest holding {format_size(used)} of data "
            "touches its free memory, frees it, migrates) over loopback and over a veth "
            "pair between two network namespaces, "
            f"source in one and destination in the other, each end shaped to {rate} with a "
            "tc token bucket (the seeds' network). Shows whether the transport or the "
            "host CPU limits migration here. Over veth, every row is compared with "
            "stock-best over veth; veth-stock-best with loopback-stock-best."
        ),
        variants=variants,
        best=best,
        baseline="loopback-stock-best",
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


SPEC = ScenarioSpec(
    "migrate-idle",
    "idle guest using 1/8 of its RAM: thinvm vs stock-best",
    make_migrate_idle,
    "2G",
    "guest RAM",
    default_runs=3,
    params={"idle": "2", "used": "0.125"},
)
NETWORK_SPEC = ScenarioSpec(
    "network",
    "migration over loopback vs a shaped veth pair",
    make_network,
    "1G",
    "guest RAM",
    default_runs=2,
    params={"idle": "2", "used": "0.125", "rate": "10gbit"},
)
