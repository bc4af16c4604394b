"""Debian guests on cluster hosts: domains, the agent, trims.

The disk image comes from thinvm.guest.image (installed in
/var/lib/thinvm/images, where a system libvirtd's QEMU user reads it).
A guest's disk is a qcow2 overlay in the cluster's shared directory, on
top of the installed image: every host sees the same path, so live
migration needs no storage copy.
"""

import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from thinvm.errors import GuestError, ThinvmError
from thinvm.fleet import emulator
from thinvm.fleet.cluster import ClusterState, Host, machine_pid, virsh
from thinvm.fleet.domain import DomainSpec, domain_xml
from thinvm.guest.agent import (
    AGENT_PORT,
    AgentClient,
    CommandResult,
    channel_lock,
    libvirt_agent_socket,
)
from thinvm.guest.image import DiskImage, create_overlay, guest_info
from thinvm.guest.trim import TrimResult, set_background, trim_guest
from thinvm.host.memory import process_memory
from thinvm.units import MiB

BOOT_TIMEOUT = 180.0


@dataclass(frozen=True)
class GuestSpec:
    name: str
    memory: int = 1024 * MiB
    kernel: str = "6.1"
    build: str = "patched"  # whose emulator path the domain names
    thinvm: bool = True  # ranges + sparse-ram (False: stock's best)
    # Runs on stock hosts too (a cluster being upgraded): no page ranges,
    # which the guest sees and a stock QEMU lacks, and no sparse-ram in the
    # XML, which a stock QEMU would refuse to start with: over multifd
    # thinvm's QEMU skips without it (QEMU 0017).
    portable: bool = False
    # Free page hinting (QEMU's, on an iothread): off, as in thinvm.vm.stack,
    # where it measured slower once reporting runs.  Off also spares the
    # domain its <qemu:override>.
    hint: bool = False
    virtio_mem: int = 0  # docs/resize.md; 0: no virtio-mem device
    virtio_mem_requested: int = 0


def spec_for(
    guest: GuestSpec, image: DiskImage, shared: Path, binary: Path | None = None
) -> DomainSpec:
    """The domain for `guest`: thinvm's features, or stock's best
    (reporting; multifd is a migration flag) with thinvm=False.  Neither
    hints unless asked (GuestSpec.hint), as thinvm.vm.stack's stacks.
    `binary`: the emulator of a package-installed host
    (emulator.packaged_emulator) instead of `thinvm fleet install`'s."""
    thinvm = guest.thinvm and not guest.portable
    stock = binary == emulator.PACKAGED_STOCK if binary else guest.build == "stock"
    if thinvm and stock:
        raise ThinvmError(
            "page ranges and sparse-ram need the patched QEMU: use --build patched "
            "(on a package-installed host: install thinvm-qemu), --portable, "
            "or --no-thinvm for the stock emulator"
        )
    return DomainSpec(
        name=guest.name,
        emulator=binary or emulator.emulator_path(guest.build),
        kernel=image.vmlinuz,
        initrd=image.initrd,
        disk=shared / f"{guest.name}.qcow2",
        cmdline=image.cmdline,
        memory=guest.memory,
        console_log=shared / f"{guest.name}.console.log",
        ranges=thinvm,
        free_page_hint=guest.hint,
        sparse_ram=emulator.sparse_ram_capability() if thinvm else None,
        virtio_mem=guest.virtio_mem,
        virtio_mem_requested=guest.virtio_mem_requested,
        portable=guest.portable,
    )


def define(host: Host, spec: DomainSpec, image: DiskImage) -> str:
    """Create the guest's disk overlay and define the domain on `host`."""
    create_overlay(image.disk, spec.disk)
    if spec.console_log:
        spec.console_log.unlink(missing_ok=True)
    xml = domain_xml(spec)
    path = spec.disk.with_suffix(".xml")
    path.write_text(xml)
    virsh(host, "define", str(path))
    return xml


def agent_socket(host: Host, name: str) -> Path:
    """Where libvirt put the agent port's socket, seen from outside."""
    path = libvirt_agent_socket(virsh(host, "dumpxml", name))
    if path is None:
        raise ThinvmError(f"{name} on {host.name} has no {AGENT_PORT} channel")
    return host.outside(path)


def agent(host: Host, name: str) -> AgentClient:
    """A client that takes turns with the host's controller (channel_lock)."""
    path = str(agent_socket(host, name))
    return AgentClient(path, lock=channel_lock(path))


def run_in_guest(host: Host, name: str, command: str, *, check: bool = True) -> CommandResult:
    """Run a shell line in a cluster guest through its agent, on a
    connection of its own; `check`: a non-zero exit raises GuestError."""
    client = agent(host, name)
    try:
        return client.check(command) if check else client.run(command)
    finally:
        client.close()


def qemu_pid(host: Host, name: str) -> int:
    """The domain's QEMU process, from the pid file libvirt keeps."""
    path = host.outside(f"/run/libvirt/qemu/{name}.pid")
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError) as exc:
        raise ThinvmError(f"{name} on {host.name}: no QEMU pid in {path}") from exc
    return machine_pid(host, pid) if host.systemd else pid


def reporting_on(host: Host, name: str) -> bool:
    """Whether the domain's balloon has free page reporting on."""
    root = ET.fromstring(virsh(host, "dumpxml", name))
    balloon = root.find("./devices/memballoon")
    return balloon is not None and balloon.get("freePageReporting") == "on"


def set_reclaim(host: Host, name: str, background: bool) -> dict[str, object]:
    """Switch the guest reclaimer's background mode; its counters after.
    The packaged agent starts with it on (/etc/default/thinvm-agent)."""
    client = agent(host, name)
    try:
        counters = set_background(client, background)
    finally:
        client.close()
    if counters is None:
        raise ThinvmError(f"{name} on {host.name}: the guest's agent has no reclaimer")
    return counters


def trim(host: Host, name: str, max_bytes: int = 0, timeout: float = 30.0) -> TrimResult:
    """thinvm.guest.trim for a libvirt domain: the guest gives back cold
    memory, and we wait until its QEMU's RSS has settled."""
    pid = qemu_pid(host, name)
    client = agent(host, name)
    try:
        return trim_guest(
            client,
            lambda: process_memory(pid).rss,
            reporting_on(host, name),
            max_bytes=max_bytes,
            timeout=timeout,
        )
    finally:
        client.close()


def wait_booted(host: Host, name: str, timeout: float = BOOT_TIMEOUT) -> float:
    """Wait until the guest's agent answers; returns the seconds waited."""
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        try:
            client = agent(host, name)
        except ThinvmError:
            time.sleep(0.5)
            continue
        try:
            client.wait_ready(max(1.0, deadline - time.monotonic()))
            return time.monotonic() - start
        except GuestError:
            continue
        finally:
            client.close()
    raise GuestError(f"{name} on {host.name}: agent silent after {timeout:.0f} s")


def use_intree_driver(client: AgentClient) -> None:
    """Swap our driver for the kernel's own virtio_balloon, in a running
    guest whose balloon is not inflated (the stock-best baseline).  insmod
    by file: the thinvm package blacklists virtio_balloon for modprobe."""
    client.check('rmmod thinvm_balloon && insmod "$(modinfo -F filename virtio_balloon)"')
    driver = guest_info(client).get("balloon_driver")
    if driver != "virtio_balloon":
        raise GuestError(f"the in-tree balloon driver did not take the device ({driver})")


def domstate(host: Host, name: str) -> str:
    try:
        return virsh(host, "domstate", name).strip()
    except ThinvmError as exc:
        if "failed to get domain" in str(exc) or "Domain not found" in str(exc):
            return "absent"
        raise


def remove(host: Host, name: str) -> None:
    """Stop and undefine `name` on `host`, whatever state it is in."""
    if domstate(host, name) == "running":
        virsh(host, "destroy", name)
    if domstate(host, name) != "absent":
        virsh(host, "undefine", name)


def find_guest(state: ClusterState, name: str) -> Host:
    """The host where `name` is running."""
    running = [h for h in state.hosts if domstate(h, name) == "running"]
    if not running:
        raise ThinvmError(f"{name} is not running on any cluster host")
    return running[0]
