"""Balloon control through QMP: target, `actual`, guest statistics."""

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.guest.workload import meminfo
from thinvm.units import MiB, format_size
from thinvm.vm.machine import VM

BALLOON_PATH = "/machine/peripheral/balloon0"
STATS_POLLING = "guest-stats-polling-interval"  # seconds; 0: the guest sends none
# What an operator's target leaves a guest beyond the memory it uses now
# (docs/architecture.md, "Balloon safety"): room for the page cache of the
# programs it runs and for the kernel's own allocations while the balloon
# inflates, which takes memory with __GFP_NORETRY and so stops short of
# the OOM killer but leaves a guest with no more free memory than this.
GUEST_HEADROOM = 64 * MiB
# How long a guest agent may take to say what its guest uses.
NEED_TIMEOUT = 15.0


@dataclass(frozen=True)
class BalloonStatus:
    actual: int  # guest memory not in the balloon, bytes
    target: int | None


def query(vm: VM) -> BalloonStatus:
    info = vm.qmp("query-balloon")
    return BalloonStatus(actual=int(info["actual"]), target=None)


def check_target(vm: VM, size: int) -> None:
    memory = vm.config.memory
    if size <= 0 or size > memory:
        raise ThinvmError(
            f"balloon target {format_size(size)} is outside 1 byte .. {format_size(memory)}"
        )


@dataclass(frozen=True)
class GuestNeed:
    """What a guest uses of the memory outside its balloon, from its own
    /proc/meminfo; the lowest target it is safe to ask for is `floor`."""

    actual: int  # outside the balloon (QMP query-balloon)
    available: int  # the guest's MemAvailable: free and reclaimable

    @property
    def in_use(self) -> int:
        """Memory the guest cannot give the balloon without killing something.

        actual - MemAvailable either way the driver accounts: with
        deflate-on-OOM ballooned pages stay in MemTotal and count as used,
        without it they leave MemTotal, and both times they are not
        available.  What the kernel keeps for itself (not in MemTotal) is
        in it too, as it must be: the balloon cannot take that either.
        """
        return max(0, self.actual - self.available)

    @property
    def floor(self) -> int:
        return self.in_use + GUEST_HEADROOM


def guest_need(vm: VM) -> GuestNeed:
    """Ask the guest (through its agent) what it uses; ThinvmError if it cannot say."""
    actual = query(vm).actual
    try:
        available = meminfo(vm.agent)["MemAvailable"]
    except (ThinvmError, KeyError, TimeoutError) as exc:
        raise ThinvmError(
            f"cannot tell how much memory the guest of {vm.config.name!r} uses, so cannot "
            f"check that it can give up the memory asked for ({exc}); pass --force to "
            "set the target anyway"
        ) from exc
    return GuestNeed(actual=actual, available=available)


def check_guest_floor(vm: VM, size: int) -> GuestNeed | None:
    """Refuse a target below what the guest needs (GuestNeed.floor).

    A target at or above the memory the guest has now never takes any: it
    is not checked, and the guest is not asked (None).
    """
    if size >= query(vm).actual:
        return None
    need = guest_need(vm)
    if size < need.floor:
        raise ThinvmError(
            f"balloon target {format_size(size)} is below what the guest of "
            f"{vm.config.name!r} needs: it uses {format_size(need.in_use)} of the "
            f"{format_size(need.actual)} it has ({format_size(need.available)} available), "
            f"and keeps {format_size(GUEST_HEADROOM)} of headroom, so the lowest target now "
            f"is {format_size(need.floor)}; free memory in the guest first, or pass --force"
        )
    return need


def move(vm: VM, size: int, back_to: int, timeout: float = 120.0) -> float:
    """Set the target and wait until `actual` reaches it; returns seconds taken.

    If it does not get there (stuck, timed out, interrupted), the target
    is set back to `back_to` before the error goes on: a balloon left
    pulling at a target the guest cannot give squeezes it until something
    else gives up (docs/guest-driver.md, "Allocation failure").
    """
    set_target(vm, size)
    try:
        return wait_actual(vm, size, timeout=timeout)
    except ThinvmError as exc:
        _roll_back(vm, back_to)
        raise ThinvmError(f"{exc}: target set back to {format_size(back_to)}") from exc
    except BaseException:
        _roll_back(vm, back_to)
        raise


def _roll_back(vm: VM, back_to: int) -> None:
    # Best effort: a QEMU that stopped answering cannot hold the balloon either.
    with contextlib.suppress(ThinvmError, OSError, TimeoutError):
        set_target(vm, back_to)


def set_target(vm: VM, size: int) -> None:
    """Ask the guest to leave `size` bytes of memory outside the balloon."""
    check_target(vm, size)
    vm.qmp("balloon", value=size)


def wait_actual(
    vm: VM, target: int, timeout: float = 120.0, tolerance: int = 0, settle: float = 3.0
) -> float:
    """Wait until `actual` reaches the target; returns seconds taken.

    A guest that cannot reach the target (too little free memory) stops
    moving; once `actual` has not changed for `settle` seconds we raise with
    the value it got stuck at rather than waiting out the whole timeout.
    """
    start = time.monotonic()
    deadline = start + timeout
    last = query(vm).actual
    last_change = start
    while abs(last - target) > tolerance:
        now = time.monotonic()
        if now > deadline or (now - last_change > max(settle, timeout / 4) and now > start + 10):
            raise ThinvmError(
                f"balloon stuck at actual={format_size(last)}, target {format_size(target)}"
            )
        time.sleep(0.05)
        current = query(vm).actual
        if current != last:
            last, last_change = current, time.monotonic()
    return time.monotonic() - start


def enable_stats(vm: VM, interval: int = 1) -> None:
    vm.qmp("qom-set", path=BALLOON_PATH, property=STATS_POLLING, value=interval)


def stats_polling_enabled(vm: VM) -> bool:
    """Whether the device asks the guest for statistics (an interval of 0 is off)."""
    return int(vm.qmp("qom-get", path=BALLOON_PATH, property=STATS_POLLING)) >= 1


def ensure_stats(vm: VM, interval: int = 1) -> None:
    """Turn statistics polling on at `interval` seconds if it is off; an
    interval someone else set is left as it is."""
    if not stats_polling_enabled(vm):
        enable_stats(vm, interval)


def stats(vm: VM) -> dict[str, Any]:
    """The device's latest copy of the guest's statistics (bytes / counts)."""
    result: dict[str, Any] = vm.qmp("qom-get", path=BALLOON_PATH, property="guest-stats")
    return result


def wait_stats(vm: VM, timeout: float = 30.0) -> dict[str, Any]:
    """Poll until the guest has delivered a statistics update."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = stats(vm)
        if current.get("last-update", 0) and current["stats"].get("stat-total-memory", -1) > 0:
            return current
        time.sleep(0.25)
    raise ThinvmError(f"no balloon statistics from the guest within {timeout:.0f} s")
