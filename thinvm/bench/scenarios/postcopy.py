"""migrate-postcopy: an idle guest migrated in postcopy, thinvm against stock."""

from collections.abc import Callable
from dataclasses import replace

from thinvm.bench.scenarios.common import (
    STOCK_CANDIDATES,
    Candidate,
    hold_then_idle,
    verify_pattern,
)
from thinvm.bench.scenarios.params import (
    float_param,
    used_bytes,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.transport import Transport
from thinvm.bench.types import (
    BenchOptions,
    Best,
    Metrics,
    RunContext,
    Scenario,
    Target,
    Variant,
)
from thinvm.units import format_size
from thinvm.vm import migrate
from thinvm.vm.stack import POSTCOPY_RAM, THINVM, Stack

# Postcopy hands the guest to the destination at once and pulls the rest of
# its memory afterwards.  In QEMU 10.0 it cannot use multifd, and stock QEMU
# keeps free page hinting off under postcopy (the balloon device's rule), so
# the best stock postcopy setup is free page reporting alone.  thinvm adds
# sparse-ram, which postcopy accepts since patch 0012: the destination places
# a zero page where the guest touches memory the source left out.  stock-best
# is the best of every stock configuration measured in the run, precopy ones
# included: what users would pick instead.

POSTCOPY_SEED = 12
# Switch as soon as the migration is under way: postcopy's point is that
# the destination runs the guest before the memory has moved.
SWITCH_AFTER_S = 0.0
POSTCOPY = {POSTCOPY_RAM: True}

POSTCOPY_STOCK = Candidate(
    "postcopy-stock",
    Stack(reporting=True),
    "stock QEMU and driver; free page reporting, postcopy (hinting and multifd "
    "are not available with postcopy)",
)
POSTCOPY_THINVM = Candidate(
    "postcopy-thinvm",
    replace(THINVM, multifd=False),
    "patched QEMU, our driver; reporting + page ranges, sparse-ram, postcopy",
)
# Every stock configuration, precopy and postcopy: stock-best is their best.
STOCK_ROWS: list[tuple[Candidate, bool]] = [
    *((c, False) for c in STOCK_CANDIDATES),
    (POSTCOPY_STOCK, True),
]


def postcopy_metrics(result: migrate.MigrationResult) -> Metrics:
    """What postcopy adds to the migration counters."""
    return {
        "postcopy_requests": result.postcopy_requests,
        "postcopy_bytes": result.postcopy_bytes,
    }


def make_migrate_postcopy(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    idle = float_param(params, "idle")
    used = used_bytes(params, size)
    # Over loopback only: what postcopy changes does not depend on the link.
    transport = Transport("loopback", vm_class=opts.vm_class, pin=opts.pin_sides)

    def variant(candidate: Candidate, postcopy: bool) -> Callable[[RunContext], Metrics]:
        stack = candidate.stack
        caps = {**stack.caps, **(POSTCOPY if postcopy else {})}

        def run(ctx: RunContext) -> Metrics:
            config = opts.vm_config("b-postcopy", size, stack)
            with transport.start(config) as src:
                metrics = hold_then_idle(ctx, src, stack, used, POSTCOPY_SEED, idle)
                with transport.start(config, incoming=True) as dst:
                    migrated = transport.migrate(
                        src,
                        dst,
                        ctx,
                        caps,
                        candidate.params,
                        postcopy_after=SWITCH_AFTER_S if postcopy else None,
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

    rows = [*STOCK_ROWS, (POSTCOPY_THINVM, True)]
    stock_best = Best(
        "stock-best",
        tuple(c.name for c, _ in STOCK_ROWS),
        "the best stock configuration measured, precopy or postcopy",
    )
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
            "destination places a zero page where the guest touches memory the source "
            "left out). `postcopy_requests` counts pages the destination guest had to "
            "wait for. **stock-best** is the best of every stock configuration measured "
            "in the run, the precopy ones of migrate-idle and stock's postcopy: what "
            "users would pick instead; ratios are against it."
        ),
        variants=[Variant(c.name, variant(c, p), c.description) for c, p in rows],
        best=[stock_best],
        baseline="stock-best",
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
            ),
            Target(
                "thinvm's postcopy at least as fast as stock-best (any stock configuration)",
                "postcopy-thinvm",
                "stock-best",
                "migration_ms",
                at_most=1.0,
            ),
        ],
    )


SPEC = ScenarioSpec(
    "migrate-postcopy",
    "idle guest migrated in postcopy: thinvm vs stock",
    make_migrate_postcopy,
    "4G",
    "guest RAM",
    default_runs=3,
    params={"used": "0.125", "idle": "2"},
)
