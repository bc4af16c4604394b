"""migrate-dirty: migrating a guest that dirties memory at a fixed rate."""

import json
import time
from collections.abc import Callable
from typing import Any

from thinvm.bench.scenarios.common import (
    migration_rows,
)
from thinvm.bench.scenarios.params import (
    float_param,
    int_param,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.transport import (
    CHANNELS,
    MIGRATION_PARAMS,
    Transport,
)
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Variant
from thinvm.errors import ThinvmError
from thinvm.units import format_size
from thinvm.vm.machine import VM
from thinvm.vm.stack import STOCK_BEST, Stack

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
    wss, rate = int_param(params, "wss_mib"), int_param(params, "rate_mibps")
    seconds, warmup = int_param(params, "seconds"), float_param(params, "warmup")
    # QEMU stops the guest once it expects to send the rest within this
    # budget, so downtimes are only comparable at the same limit.
    limit = {"downtime-limit": int_param(params, "downtime_limit_ms")}
    transport = Transport(opts.net, vm_class=opts.vm_class, pin=opts.pin_sides)

    def variant(
        migrating: bool, stack: Stack, extra: dict[str, Any] | None = None
    ) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            config = opts.vm_config("b-dirty", size, stack)
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
                        migrated = transport.migrate(
                            src, dst, ctx, stack.caps, {**limit, **(extra or {})}
                        )
                        metrics.update(migrated.metrics)
                        ctx.step("waiting for the workload to finish on the destination")
                        out = _wait_dirty_result(dst, seconds + 120)
            ctx.note("workload", out)
            metrics["achieved_mibps"] = float(out["achieved_mibps"])
            metrics["max_stall_ms"] = float(out["max_slice_ms"])
            return metrics

        return run

    variants, best = migration_rows(lambda c: variant(True, c.stack, c.params))
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
            *variants,
            Variant(
                "no-migration",
                variant(False, STOCK_BEST),
                "the workload alone (stock-mfd2's stack)",
            ),
        ],
        best=best,
        baseline="stock-best",
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


SPEC = ScenarioSpec(
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
)
