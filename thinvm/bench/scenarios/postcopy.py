"""migrate-postcopy: an idle guest migrated in postcopy, thinvm against stock."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from thinvm.bench.scenarios.common import (
    hold_then_idle,
    verify_pattern,
)
from thinvm.bench.scenarios.params import (
    float_param,
    used_bytes,
)
from thinvm.bench.scenarios.transport import Transport
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.units import format_size
from thinvm.vm import migrate
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

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
        "stock QEMU and driver; reporting, precopy over multifd (the baseline)",
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
        replace(THINVM, multifd=False),
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
    idle = float_param(params, "idle")
    used = used_bytes(params, size)
    # Over loopback only: what postcopy changes does not depend on the link.
    transport = Transport("loopback", vm_class=opts.vm_class, pin=opts.pin_sides)

    def variant(stack: Stack, postcopy: bool) -> Callable[[RunContext], Metrics]:
        caps = {**stack.caps, **(POSTCOPY if postcopy else {})}

        def run(ctx: RunContext) -> Metrics:
            config = opts.vm_config("b-postcopy", size, stack)
            with transport.start(config) as src:
                metrics = hold_then_idle(ctx, src, stack, used, POSTCOPY_SEED, idle)
                with transport.start(config, incoming=True) as dst:
                    migrated = transport.migrate(
                        src, dst, ctx, caps, postcopy_after=SWITCH_AFTER_S if postcopy else None
                    )
                    dst_rss = dst.host_memory().rss
                    verify_pattern(dst, ctx, POSTCOPY_SEED)
            return {
                **migrated.metrics,
                **postcopy_metrics(migrated.result),
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
