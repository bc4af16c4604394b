"""Resizing a guest through whichever lever it has (docs/resize.md).

A VM with a virtio-mem device grows and shrinks by plugging and
unplugging its blocks: QEMU's `requested-size` is the request, the
device's `size` what the guest has plugged so far.  A VM without one
falls back to its balloon.  Either way SIZE is the guest's total memory:
base memory plus what virtio-mem has plugged, or what the balloon leaves.
"""

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.units import format_size
from thinvm.vm import balloon
from thinvm.vm.machine import VIRTIO_MEM_ID, VM, VMConfig

VIRTIO_MEM_PATH = f"/machine/peripheral/{VIRTIO_MEM_ID}"
# A guest that plugs or unplugs keeps `size` moving; one that has not
# moved for this long is not going to soon (no driver, or memory it cannot
# free: Linux's driver retries a failed unplug only after tens of seconds).
STALL_SECONDS = 30.0
POLL_SECONDS = 0.2
# How x-query-virtio-status names the status bit a running driver sets.
DRIVER_OK = "VIRTIO_CONFIG_S_DRIVER_OK"


class Lever(StrEnum):
    """What a VM can be resized with (docs/resize.md)."""

    BALLOON = "balloon"
    VIRTIO_MEM = "virtio-mem"


def requested_size(total: int, base: int, block_size: int, max_size: int) -> int:
    """virtio-mem's `requested-size` for a guest that keeps `total` in all:
    the part above the base memory, in whole blocks, within [0, max_size].

    The one rounding rule for `thinvm resize` and the balance controller:
    DOWN to a whole block.  A size is a budget (the controller's share of
    the host, an operator's ceiling, `thinvm resize`'s SIZE), and rounding
    down never gives a guest more than its budget; the cost is at most a
    block less than asked when growing, which `thinvm resize` says in its
    note.  Rounding to the nearest block could put a guest up to half a
    block above an operator's ceiling (VmSample.fit) or the host's budget.
    """
    wanted = max(0, total - base)
    return min(max_size, wanted - wanted % block_size)


@dataclass(frozen=True)
class VirtioMem:
    """A VM's virtio-mem device as QEMU (or libvirt) reports it, in bytes."""

    base: int  # the memory the guest booted with: never unplugged
    plugged: int  # the device's `size`: what the guest has plugged
    requested: int  # the device's `requested-size`
    block_size: int
    max_size: int

    @property
    def total(self) -> int:
        """The guest's memory with what it has plugged (a balloon aside)."""
        return self.base + self.plugged

    def requested_for(self, target: int) -> int:
        """`requested-size` for a guest that keeps `target` in all (requested_size)."""
        return requested_size(target, self.base, self.block_size, self.max_size)

    def round(self, target: int) -> int:
        """The nearest total at or below `target` that virtio-mem can give
        (never below the base memory)."""
        return self.base + self.requested_for(target)


@dataclass(frozen=True)
class Plan:
    """What to ask of a lever for a requested guest size."""

    lever: Lever
    size: int  # the guest's total memory once done (SIZE, maybe rounded)
    target: int  # virtio-mem requested-size, or the balloon target
    note: str = ""  # for the user: a rounding that was done


@dataclass(frozen=True)
class ResizeResult:
    lever: Lever
    size: int  # the guest's total memory at the end
    seconds: float


Progress = Callable[[int, int], None]  # (current total, wanted total), bytes


def lever(config: VMConfig) -> Lever:
    """The lever `resize` drives on this VM: virtio-mem first, else the balloon."""
    if config.virtio_mem:
        return Lever.VIRTIO_MEM
    if config.balloon.enabled:
        return Lever.BALLOON
    raise ThinvmError(
        f"VM {config.name!r} has neither virtio-mem nor a balloon to resize with: "
        "start it with --virtio-mem SIZE, or without --no-balloon"
    )


def plan(config: VMConfig, size: int, block_size: int) -> Plan:
    """Check SIZE (the guest's total memory) against the VM and turn it into a target.

    virtio-mem plugs whole blocks: SIZE is rounded down to one
    (requested_size), and the note says so.  Pure, so the rules are unit-tested without a guest.
    """
    kind = lever(config)
    if kind is Lever.BALLOON:
        if not 0 < size <= config.memory:
            raise ThinvmError(
                f"cannot resize {config.name!r} to {format_size(size)}: its balloon "
                f"can leave it between 1 byte and {format_size(config.memory)}"
            )
        return Plan(kind, size, size)
    base, top = config.memory, config.max_memory
    if size < base:
        raise ThinvmError(
            f"cannot resize {config.name!r} to {format_size(size)}: below its base memory "
            f"{format_size(base)}, which virtio-mem cannot unplug (the smallest it gets is "
            f"{format_size(base)}; 'thinvm balloon' goes lower)"
        )
    if size > top:
        raise ThinvmError(
            f"cannot resize {config.name!r} to {format_size(size)}: above its maximum "
            f"{format_size(top)} ({format_size(base)} base + {format_size(config.virtio_mem)} "
            "virtio-mem)"
        )
    target = requested_size(size, base, block_size, config.virtio_mem)
    note = ""
    if base + target != size:
        note = (
            f"{format_size(size)} is not a whole number of {format_size(block_size)} "
            f"virtio-mem blocks: resizing to {format_size(base + target)}"
        )
    return Plan(kind, base + target, target, note)


def virtio_mem_status(vm: VM) -> VirtioMem:
    """The VM's virtio-mem device (query-memory-devices); ThinvmError without one."""
    for device in vm.qmp("query-memory-devices"):
        data = device.get("data", {})
        if device.get("type") == "virtio-mem" and data.get("id") == VIRTIO_MEM_ID:
            return VirtioMem(
                base=vm.config.memory,
                plugged=int(data["size"]),
                requested=int(data["requested-size"]),
                max_size=int(data["max-size"]),
                block_size=int(data["block-size"]),
            )
    raise ThinvmError(f"VM {vm.config.name!r} has no virtio-mem device {VIRTIO_MEM_ID!r}")


def request_virtio_mem(vm: VM, requested: int) -> None:
    vm.qmp("qom-set", path=VIRTIO_MEM_PATH, property="requested-size", value=requested)


def guest_driver_ready(vm: VM) -> bool | None:
    """Whether the guest's virtio-mem driver runs (DRIVER_OK); None if QEMU cannot say.

    x-query-virtio-status is unstable QMP: used only to explain a stall.
    """
    with contextlib.suppress(ThinvmError, KeyError, TypeError, AttributeError):
        info: dict[str, Any] = vm.qmp(
            "x-query-virtio-status", path=f"{VIRTIO_MEM_PATH}/virtio-backend"
        )
        statuses = info["status"]["statuses"]
        return any(str(s).startswith(DRIVER_OK) for s in statuses)
    return None


def wait_plugged(
    vm: VM,
    requested: int,
    timeout: float = 300.0,
    progress: Progress | None = None,
    stall: float = STALL_SECONDS,
) -> float:
    """Wait until the guest has plugged exactly `requested`; returns seconds taken.

    Raises, saying how far the guest got, once `size` stops moving for
    `stall` seconds or at `timeout`.
    """
    base = vm.config.memory
    start = time.monotonic()
    last = virtio_mem_status(vm).plugged
    last_change = start
    while last != requested:
        now = time.monotonic()
        if now - last_change > stall or now - start > timeout:
            raise ThinvmError(_stall_message(vm, last, requested, now - start))
        time.sleep(POLL_SECONDS)
        current = virtio_mem_status(vm).plugged
        if current != last:
            last, last_change = current, time.monotonic()
            if progress is not None:
                progress(base + current, base + requested)
    return time.monotonic() - start


def _stall_message(vm: VM, plugged: int, requested: int, seconds: float) -> str:
    base = vm.config.memory
    got = (
        f"{vm.config.name}: the guest has {format_size(base + plugged)} "
        f"({format_size(plugged)} plugged by virtio-mem) after {seconds:.0f} s, "
        f"not the {format_size(base + requested)} asked for"
    )
    if guest_driver_ready(vm) is False:
        return (
            f"{got}: the guest has no virtio-mem driver running (load virtio_mem; "
            "see docs/resize.md)"
        )
    if plugged > requested:
        return (
            f"{got}: it could not free the rest (memory in use, or onlined where it "
            "cannot move: see docs/resize.md); the request stands and Linux retries it "
            "by itself, or resize it again"
        )
    return (
        f"{got}: the request stands; the guest may still plug the rest, or cannot "
        "(no free memory for its bookkeeping, or no room in its address space)"
    )


def plan_for(vm: VM, size: int) -> Plan:
    """plan() for a running VM, with its device's block size."""
    kind = lever(vm.config)
    block = virtio_mem_status(vm).block_size if kind is Lever.VIRTIO_MEM else 1
    return plan(vm.config, size, block)


def apply(
    vm: VM, target: Plan, timeout: float = 300.0, progress: Progress | None = None
) -> ResizeResult:
    """Send a plan to its lever and wait until the guest follows."""
    if target.lever is Lever.VIRTIO_MEM:
        request_virtio_mem(vm, target.target)
        seconds = wait_plugged(vm, target.target, timeout, progress)
        return ResizeResult(target.lever, virtio_mem_status(vm).total, seconds)
    balloon.set_target(vm, target.target)
    seconds = balloon.wait_actual(vm, target.target, timeout=timeout)
    return ResizeResult(target.lever, balloon.query(vm).actual, seconds)


def apply_total(vm: VM, total: int) -> None:
    """Ask the guest to keep `total` bytes in all with its lever, without
    waiting (the balance controller's verb: it samples again next cycle).

    With virtio-mem, `requested-size` is the part above the base memory
    (requested_size), and a balloon, if any, gives back all of the base
    memory: an operator may have inflated it earlier, and the controller
    drives one lever.  Without virtio-mem, `total` is the balloon target.
    """
    if not vm.config.virtio_mem:
        balloon.set_target(vm, total)
        return
    device = virtio_mem_status(vm)
    request_virtio_mem(vm, device.requested_for(total))
    if vm.config.balloon.enabled and balloon.query(vm).actual < device.base:
        balloon.set_target(vm, device.base)


def resize(
    vm: VM, size: int, timeout: float = 300.0, progress: Progress | None = None
) -> ResizeResult:
    """Resize the guest to `size` bytes in total with its lever and wait for it."""
    return apply(vm, plan_for(vm, size), timeout, progress)


def describe(vm: VM) -> str:
    """The guest's virtio-mem state for `thinvm status`, or '' without a device."""
    if not vm.config.virtio_mem:
        return ""
    status = virtio_mem_status(vm)
    text = f"virtio-mem {format_size(status.plugged)} of {format_size(status.max_size)} plugged"
    if status.requested != status.plugged:
        text += f" (requested {format_size(status.requested)})"
    return text
