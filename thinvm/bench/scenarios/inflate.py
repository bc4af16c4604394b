"""inflate: balloon inflation and deflation, stock and our driver."""

from dataclasses import dataclass

from thinvm.bench.probe import (
    SyscallCounter,
)
from thinvm.bench.scenarios.common import (
    LEGACY,
    TOUCH_LEAVE,
    touch_most,
)
from thinvm.bench.scenarios.params import (
    float_param,
)
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import balloon
from thinvm.vm.machine import VM
from thinvm.vm.stack import Stack

DRIVER_PARAMS = "/sys/module/thinvm_balloon/parameters"


def driver_requests(vm: VM) -> Metrics:
    """Virtqueue round trips our guest driver made (its own counters)."""
    names = ("inflate_requests", "deflate_requests", "range_requests", "deflated_blocks")
    out = vm.agent.run(f"cd {DRIVER_PARAMS} && grep -H . " + " ".join(names)).stdout
    metrics: Metrics = {}
    for line in out.splitlines():
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            metrics[f"driver_{name}"] = int(value)
    return metrics


@dataclass(frozen=True)
class InflateRun:
    """One inflate-and-deflate of a fresh guest."""

    opts: BenchOptions
    size: int
    keep: int  # what the guest keeps when the balloon is inflated
    init_on_alloc: str
    touched: bool
    stack: Stack = LEGACY

    @property
    def timeout(self) -> float:
        return 60 + 30 * self.size / GiB

    def __call__(self, ctx: RunContext) -> Metrics:
        metrics: Metrics = {}
        config = self.opts.vm_config("b-inflate", self.size, self.stack)
        config.append = f"{config.append} init_on_alloc={self.init_on_alloc}".strip()
        with self.opts.vm_class(config).start() as vm:
            ctx.note("boot_s", vm.boot_seconds)
            if self.touched:
                ctx.step("guest touches its free memory")
                # Leave the guest its watermarks: they grow with its RAM.
                metrics.update(touch_most(vm, leave=max(TOUCH_LEAVE, self.size // 32)))
            metrics.update(self._balloon(vm, ctx))
            if self.stack.driver == "thinvm":
                metrics.update(driver_requests(vm))
        return metrics

    def _balloon(self, vm: VM, ctx: RunContext) -> Metrics:
        """Inflate to `keep`, deflate to the full size: times, discard calls
        and the QEMU process's memory before, inflated and after."""
        before = vm.host_memory()
        ctx.step(f"inflating to {format_size(self.keep)}")
        with SyscallCounter([vm.pid or 0], self.opts.counter) as inflate:
            balloon.set_target(vm, self.keep)
            inflate_s = balloon.wait_actual(vm, self.keep, timeout=self.timeout)
        inflated = vm.host_memory()
        ctx.step("deflating")
        with SyscallCounter([vm.pid or 0], self.opts.counter) as deflate:
            balloon.set_target(vm, self.size)
            deflate_s = balloon.wait_actual(vm, self.size, timeout=self.timeout)
        after = vm.host_memory()
        assert inflate.counts is not None and deflate.counts is not None
        return {
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


def make_inflate(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    fraction = float_param(params, "fraction")
    if not 0 < fraction < 1:
        raise ThinvmError(f"--param fraction={fraction}: want a fraction between 0 and 1")
    keep = int(size * (1 - fraction)) // MiB * MiB
    # Debian's kernels zero every page they allocate (init_on_alloc=1),
    # balloon pages included; under TCG that zeroing dominates inflation
    # for every driver.  init_on_alloc=0 measures the balloon itself.
    init_on_alloc = params["init_on_alloc"]
    if init_on_alloc not in ("0", "1"):
        raise ThinvmError(f"--param init_on_alloc={init_on_alloc}: want 0 or 1")

    def variant(touched: bool, stack: Stack = LEGACY) -> InflateRun:
        return InflateRun(opts, size, keep, init_on_alloc, touched, stack)

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
        targets=[
            Target(
                "issue 22: the range balloon in its default (movable) mode deflates at least "
                "10x faster than the stock balloon",
                "touched-ranges",
                "touched",
                "deflate_s",
                at_most=0.1,
            ),
        ],
        params={
            "size": format_size(size),
            "fraction": fraction,
            "keep": format_size(keep),
            "counter": opts.counter,
            "init_on_alloc": init_on_alloc,
        },
    )


SPEC = ScenarioSpec(
    "inflate",
    "balloon inflate to 7/8 and deflate",
    make_inflate,
    "4G",
    "guest RAM (8G on bigger hosts)",
    default_runs=2,
    params={"fraction": "0.875", "init_on_alloc": "1"},
)
