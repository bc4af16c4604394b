"""What the scenarios share: the stacks they compare and guest-side steps."""

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from thinvm.bench.types import Metrics, RunContext
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.host.memory import host_meminfo
from thinvm.units import MiB, format_size
from thinvm.vm.machine import VM
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

TOUCH_LEAVE = 96 * MiB  # free memory a "touch most of RAM" leaves the guest


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


def touch_most(vm: VM, leave: int = TOUCH_LEAVE) -> Metrics:
    """The guest faults in (and frees) all but `leave` of its free memory."""
    size = max(0, workload.meminfo(vm.agent)["MemFree"] - leave)
    result = workload.touch(vm.agent, size)
    return {"touched_bytes": size, "touch_guest_s": float(result["ms"]) / 1000}


def fits_reserved(memory: int) -> bool:
    """Whether a reserved mapping of `memory` passes the overcommit check."""
    info = host_meminfo()
    return memory <= info["MemTotal"] + info.get("SwapTotal", 0)


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
        settle(lambda: src.host_memory().rss, timeout=60)
    metrics["src_rss_bytes"] = src.host_memory().rss
    return metrics


def verify_pattern(dst: VM, ctx: RunContext, seed: int) -> None:
    ctx.step("verifying the pattern on the destination")
    check = workload.pattern_verify(dst.agent, seed)
    if not check.ok:
        raise ThinvmError(
            f"pattern check failed on the destination: {check.bad} of {check.pages} "
            f"pages differ, first at page {check.first_bad}"
        )


def parallel(vms: list[VM], func: Callable[[VM], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=len(vms)) as pool:
        return list(pool.map(func, vms))


def settle(
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
