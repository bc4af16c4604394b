"""start: VM launch to guest agent ready, preallocated or from a warm pool."""

import time
from collections.abc import Callable

from thinvm import pool
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.types import (
    BenchOptions,
    Best,
    Metrics,
    RunContext,
    Scenario,
    Target,
    Variant,
)
from thinvm.errors import ThinvmError
from thinvm.host.procs import process_age
from thinvm.units import format_size
from thinvm.vm import pooled

STOCK_BEST_PREALLOC = Best(
    "stock-best",
    ("prealloc-1", "prealloc-2"),
    "the faster stock preallocation measured (1 or 2 prealloc-threads)",
)
POOL_TARGET = Target(
    "the warm pool's start: a preallocated guest answers QMP at least 20x "
    "sooner from a hugetlbfs slot than with stock-best's preallocation",
    "pool-hugetlbfs",
    "stock-best",
    "qmp_s",
    at_most=1 / 20,
)


def make_start(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    def variant(prealloc: bool, threads: int) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            config = opts.vm_config("b-start", size, prealloc=prealloc, prealloc_threads=threads)
            vm = opts.vm_class(config)
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
                start = pooled.start_from_pool(opts.vm_config("b-start", size), warm.root)
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
            "the guest agent answering. **stock-best** is the faster of the two "
            "preallocating stock configurations in the same run (by time to QMP); "
            "no-prealloc is shown for what skipping preallocation would save, not as "
            "a candidate, since the guest then faults its RAM in while it runs."
        ),
        best=[STOCK_BEST_PREALLOC],
        variants=[
            Variant("prealloc-1", variant(True, 1), "prealloc=on, 1 thread"),
            Variant("prealloc-2", variant(True, 2), "prealloc=on, 2 threads"),
            Variant("no-prealloc", variant(False, 1), "prealloc=off (reference)"),
            Variant("pool-hugetlbfs", pool_variant("hugetlbfs"), "warm pool slot on hugetlbfs"),
            Variant("pool-tmpfs", pool_variant("tmpfs"), "warm pool slot on tmpfs"),
        ],
        targets=[POOL_TARGET],
        main_metric="qmp_s",
        second_metric="boot_s",
        params={"size": format_size(size)},
    )


SPEC = ScenarioSpec(
    "start",
    "launch to agent ready with preallocation",
    make_start,
    "4G",
    "guest RAM (16G on bigger hosts)",
)
