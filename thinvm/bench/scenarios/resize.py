"""resize: the levers side by side (issue 22, docs/resize.md).

A guest that touched and freed most of its memory is shrunk to a small
size, idles, live-migrates while small, then is grown back to its full
size on the destination and allocates what it got.  Four ways to do it:

- stock-balloon: Debian's QEMU and the in-tree balloon driver, with free
  page reporting and multifd (the stock-best stack without hinting, which
  costs more than it saves once reporting runs: docs/benchmarks.md);
- thinvm-balloon: patched QEMU, our driver with page ranges, reporting,
  sparse-ram, multifd;
- virtio-mem-stock: Debian's QEMU, a small base and a virtio-mem device
  for the rest, the in-tree virtio_mem driver;
- virtio-mem-thinvm: the same device on the patched QEMU with sparse-ram.

Every variant starts with the same memory available to the guest (the
full size: virtio-mem all plugged), so only the lever differs.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from thinvm.bench.scenarios.common import TOUCH_LEAVE, touch_most
from thinvm.bench.scenarios.params import float_param, size_param
from thinvm.bench.scenarios.spec import ScenarioSpec
from thinvm.bench.scenarios.transport import CHANNELS, MIGRATION_PARAMS, Transport
from thinvm.bench.types import BenchOptions, Metrics, RunContext, Scenario, Target, Variant
from thinvm.errors import ThinvmError
from thinvm.host.memory import wait_settled
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import balloon, resize
from thinvm.vm.machine import VM, VMConfig
from thinvm.vm.stack import Stack

# x86-64 Linux keeps one 64-byte struct page per 4 KiB page of online memory.
STRUCT_PAGE_BYTES = 64
PAGE_BYTES = 4096


def guest_leave(size: int) -> int:
    """Free memory a guest of `size` keeps when it touches or allocates "all"
    of it: its watermarks and the agent, which grow with its RAM (an 8 GiB
    guest left 96 MiB was OOM-killed; the inflate scenario's rule)."""
    return max(TOUCH_LEAVE, size // 32)


STOCK_REPORTING = Stack(reporting=True, multifd=True)
THINVM_RANGES = Stack(
    build="patched", driver="thinvm", reporting=True, sparse=True, ranges=True, multifd=True
)
VIRTIO_MEM_STOCK = Stack(reporting=True, multifd=True)
VIRTIO_MEM_THINVM = Stack(build="patched", reporting=True, sparse=True, multifd=True)


@dataclass(frozen=True)
class Lever:
    """One way to shrink and grow: its stack, and whether it is virtio-mem."""

    name: str
    stack: Stack
    virtio_mem: bool
    description: str


LEVERS = [
    Lever(
        "stock-balloon",
        STOCK_REPORTING,
        False,
        "stock QEMU, in-tree balloon driver; reporting, multifd (2 channels)",
    ),
    Lever(
        "thinvm-balloon",
        THINVM_RANGES,
        False,
        "patched QEMU, our driver with page ranges; reporting, sparse-ram, multifd",
    ),
    Lever(
        "virtio-mem-stock",
        VIRTIO_MEM_STOCK,
        True,
        "stock QEMU, in-tree virtio_mem (base = the small size); reporting, multifd",
    ),
    Lever(
        "virtio-mem-thinvm",
        VIRTIO_MEM_THINVM,
        True,
        "patched QEMU, in-tree virtio_mem; reporting, sparse-ram, multifd",
    ),
]


def lever_config(config: VMConfig, lever: Lever, size: int, small: int) -> VMConfig:
    """The VM for a lever: a balloon VM of `size`, or `small` plus virtio-mem."""
    if not lever.virtio_mem:
        return config
    rest = size - small
    return replace(config, memory=small, virtio_mem=rest, virtio_mem_plugged=rest)


def guest_memmap_bytes(vm: VM) -> int:
    """The guest's struct page array: 64 bytes per 4 KiB of online memory.

    Counted from the memory blocks the guest has online, which is what
    the kernel keeps a memmap for (virtio-mem removes the blocks it
    unplugs; a balloon keeps every block online).
    """
    out = vm.agent.check(
        "cat /sys/devices/system/memory/block_size_bytes; "
        "cat /sys/devices/system/memory/memory*/online | grep -c 1"
    ).stdout.split()
    block, online = int(out[0], 16), int(out[1])
    return online * block // PAGE_BYTES * STRUCT_PAGE_BYTES


def shrink(vm: VM, lever: Lever, small: int, timeout: float) -> float:
    """Ask the lever for `small`; seconds until the guest has it."""
    start = time.monotonic()
    if lever.virtio_mem:
        resize.request_virtio_mem(vm, 0)
        resize.wait_plugged(vm, 0, timeout=timeout)
    else:
        balloon.set_target(vm, small)
        balloon.wait_actual(vm, small, timeout=timeout)
    return time.monotonic() - start


def grow(vm: VM, lever: Lever, size: int, small: int, timeout: float) -> float:
    """Ask the lever for `size` again; seconds until the guest has it."""
    start = time.monotonic()
    if lever.virtio_mem:
        resize.request_virtio_mem(vm, size - small)
        resize.wait_plugged(vm, size - small, timeout=timeout)
    else:
        balloon.set_target(vm, size)
        balloon.wait_actual(vm, size, timeout=timeout)
    return time.monotonic() - start


def make_resize(opts: BenchOptions, params: dict[str, str], size: int) -> Scenario:
    small = size_param(params, "small")
    idle = float_param(params, "idle")
    if not 0 < small < size or small % (128 * MiB):
        raise ThinvmError(
            f"--param small={format_size(small)}: want a multiple of 128 MiB below the "
            f"guest's {format_size(size)}"
        )
    transport = Transport(opts.net, vm_class=opts.vm_class, pin=opts.pin_sides)
    timeout = 120 + 60 * size / GiB

    def variant(lever: Lever) -> Callable[[RunContext], Metrics]:
        def run(ctx: RunContext) -> Metrics:
            base = opts.vm_config("b-resize", size, lever.stack)
            config = lever_config(base, lever, size, small)
            metrics: Metrics = {}
            with transport.start(config) as src:
                ctx.note("boot_s", src.boot_seconds)
                if lever.virtio_mem:
                    # The guest plugs what is requested at start after it
                    # booted: wait, so every variant begins at full size.
                    ctx.step("guest plugs its virtio-mem memory")
                    metrics["plug_s"] = resize.wait_plugged(src, size - small, timeout=timeout)
                ctx.step("guest touches and frees most of its memory")
                metrics.update(touch_most(src, leave=guest_leave(size)))
                ctx.step("waiting for free page reporting to settle")
                metrics["rss_before_bytes"] = wait_settled(lambda: src.host_memory().rss, 60).value
                metrics["memmap_full_bytes"] = guest_memmap_bytes(src)
                ctx.step(f"shrinking to {format_size(small)}")
                metrics["shrink_ms"] = 1000 * shrink(src, lever, small, timeout)
                metrics["rss_shrunk_bytes"] = wait_settled(lambda: src.host_memory().rss, 30).value
                metrics["memmap_shrunk_bytes"] = guest_memmap_bytes(src)
                time.sleep(idle)
                with transport.start(config, incoming=True) as dst:
                    migrated = transport.migrate(src, dst, ctx, lever.stack.caps)
                    metrics.update(migrated.metrics)
                    metrics["dst_rss_shrunk_bytes"] = dst.host_memory().rss
                    src.shutdown()
                    ctx.step(f"growing to {format_size(size)} on the destination")
                    metrics.update(grow_and_allocate(dst, lever, size, small, timeout))
            return metrics

        return run

    return Scenario(
        name="resize",
        title="shrink, migrate and grow: stock balloon, range balloon, virtio-mem",
        description=(
            f"A {format_size(size)} guest touches and frees all but its last "
            f"{format_size(guest_leave(size))} of free memory, free page reporting settles, and it "
            f"is shrunk to {format_size(small)}, idles {idle:g} s, live-migrates "
            f"({transport.kind}) while small, and on the destination is grown back to "
            f"{format_size(size)} and allocates all but {format_size(guest_leave(size))} of what "
            "is then free. The balloon variants have all the memory as RAM and a balloon; "
            f"the virtio-mem variants a {format_size(small)} base plus a virtio-mem device "
            f"for the rest, fully plugged at start (`memhp_default_state=online_movable`). "
            "`shrink_ms` and `grow_ms` run from the request (balloon target or "
            "`requested-size`) until `actual` or the device's `size` reaches it; "
            "`alloc_ready_ms` from the grow request until the guest's allocation returned. "
            "`memmap_shrunk_bytes` is the guest's `struct page` array while small (64 B "
            "per 4 KiB of online memory), which a balloon cannot shed and which "
            "migration must send. Host RSS and THP are the QEMU process's."
        ),
        variants=[Variant(lv.name, variant(lv), lv.description) for lv in LEVERS],
        baseline="stock-balloon",
        main_metric="shrink_ms",
        second_metric="transferred_bytes",
        params={
            "size": format_size(size),
            "small": format_size(small),
            "idle_s": idle,
            "net": opts.net,
            **MIGRATION_PARAMS,
            **CHANNELS,
        },
        context=transport.session,
        targets=TARGETS,
    )


def grow_and_allocate(dst: VM, lever: Lever, size: int, small: int, timeout: float) -> Metrics:
    """Grow, then allocate what the guest got; both timed from the request."""
    start = time.monotonic()
    grow_s = grow(dst, lever, size, small, timeout)
    free = dst.agent.check("grep MemFree /proc/meminfo").stdout.split()[1]
    want = max(0, int(free) * 1024 - guest_leave(size))
    touched: dict[str, Any] = dst.agent.check(f"thinvm-mem touch {want // MiB}", timeout=600).json()
    ready = time.monotonic() - start
    after = dst.host_memory()
    return {
        "grow_ms": 1000 * grow_s,
        "alloc_ready_ms": 1000 * ready,
        "alloc_guest_ms": float(touched["ms"]),
        "alloc_bytes": want,
        "rss_grown_bytes": after.rss,
        "thp_grown_bytes": after.anon_huge,
    }


TARGETS = [
    Target(
        "issue 22: the range balloon gives memory back at least 10x faster than the stock balloon",
        "thinvm-balloon",
        "stock-balloon",
        "grow_ms",
        at_most=0.1,
    ),
]

SPEC = ScenarioSpec(
    name="resize",
    title="shrink, migrate while small, grow: balloon, range balloon, virtio-mem",
    make=make_resize,
    default_size="8G",
    size_help="guest RAM (the virtio-mem variants: base + device)",
    default_runs=5,
    params={"small": "1G", "idle": "2"},
)
