"""Balloon control through QMP: target, `actual`, guest statistics."""

import time
from dataclasses import dataclass
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.units import format_size
from thinvm.vm.machine import VM

BALLOON_PATH = "/machine/peripheral/balloon0"


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
    vm.qmp("qom-set", path=BALLOON_PATH, property="guest-stats-polling-interval", value=interval)


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
