"""Libvirt domain XML for a thinvm guest.

Every thinvm feature maps onto the XML as follows (docs/fleet.md):

- free page reporting, stats period, autodeflate: libvirt's own
  `<memballoon>` attributes;
- page ranges: the machine type thinvm-qemu adds, `pc-q35-10.0-thinvm`
  (QEMU 0019), which offers them (and reporting) by default; libvirt has
  no attribute for them, and a machine type is what Nova and KubeVirt
  let an operator choose;
- free page hinting (the stock-best baseline only): a virtio-balloon-pci
  property libvirt has no attribute for, set with `<qemu:override>` on
  the balloon's alias;
- sparse-ram: a migration capability libvirt does not know, set on the
  command line as `-global migration.<cap>=on`, so that both ends of a
  migration have it (the XML travels with the domain); the only use of
  `<qemu:commandline>` (thinvm reads its counters through libvirt's own
  monitor, thinvm.fleet.migrate);
- a portable guest (one that also runs on hosts still on stock QEMU):
  no page ranges and no sparse-ram in the XML, and
  `<metadata><thinvm:guest portable="yes"/></metadata>`, which libvirt
  keeps across migrations, so `thinvm fleet migrate` knows to keep the
  capability off (over multifd thinvm's QEMU skips without it, 0017);
- virtio-mem (docs/resize.md): libvirt's `<memory model='virtio-mem'>`,
  which needs `<maxMemory>` and a guest NUMA node; resized with
  `virsh update-memory-device NAME --alias ua-vmem0 --requested-size SIZE`.
"""

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.guest.agent import AGENT_PORT
from thinvm.units import MiB
from thinvm.vm.machine import (
    GUEST_CONSOLE_ARGS,
    TCG_CPU_FEATURES_OFF,
    VIRTIO_MEM_BLOCK_SIZE,
    VIRTIO_MEM_KERNEL_ARGS,
    VMConfig,
    check_virtio_mem,
)

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)
# Our own element in <metadata>: libvirt keeps an application's metadata,
# one element per namespace, and moves it with the domain.
THINVM_NS = "https://thinvm.invalid/xmlns/guest/1"
ET.register_namespace("thinvm", THINVM_NS)

# pc-q35-10.0 with page ranges and reporting on (QEMU 0019).  Plain "q35"
# stays pc-q35-10.0 on thinvm-qemu too, which stock hosts also run.
THINVM_MACHINE = "pc-q35-10.0-thinvm"
STOCK_MACHINE = "q35"
# A user alias ("ua-" prefix) gives the balloon a stable QOM path, for
# <qemu:override> and for reading its counters with qom-get.
BALLOON_ALIAS = "ua-balloon"
BALLOON_QOM_PATH = f"/machine/peripheral/{BALLOON_ALIAS}"
VIRTIO_MEM_ALIAS = "ua-vmem0"


@dataclass
class DomainSpec:
    name: str
    emulator: Path
    kernel: Path
    initrd: Path
    disk: Path
    cmdline: str = f"root=/dev/vda rw {GUEST_CONSOLE_ARGS}"
    memory: int = 1024 * MiB
    current_memory: int | None = None
    cpus: int = 1
    console_log: Path | None = None
    # Balloon: reporting, stats and autodeflate are libvirt attributes.
    # Reporting None: no attribute, as Nova writes it; the machine type
    # decides (on with page ranges, off on plain q35).
    free_page_reporting: bool | None = True
    stats_period: int = 2
    # On, as `thinvm up` has deflate-on-oom (docs/architecture.md, "Balloon safety").
    autodeflate: bool = True
    free_page_hint: bool = False
    ranges: bool = True
    # Migration capability name (emulator.sparse_ram_capability()), or
    # None for a domain that does not ask for sparse-ram.
    sparse_ram: str | None = "sparse-ram"
    extra_globals: list[str] = field(default_factory=list)
    # virtio-mem: how much the guest can grow beyond `memory` (0: none),
    # and how much of it is plugged at start.
    virtio_mem: int = 0
    virtio_mem_requested: int = 0
    portable: bool = False
    # TCG's translation cache (libvirt's <tcg><tb-cache>), None: QEMU's
    # default of 1 GiB.  A lab cost KVM guests do not have: a Debian guest
    # fills ~125 MiB of it, charged to the host like guest memory.
    tb_cache: int | None = None

    def validate(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ThinvmError(f"bad domain name {self.name!r}: use letters, digits, '-', '_'")
        if self.memory < 128 * MiB or self.memory % MiB:
            raise ThinvmError("guest memory must be a whole number of MiB, at least 128 MiB")
        current = self.current_memory or self.memory
        if current > self.memory or current % MiB:
            raise ThinvmError("current memory must be whole MiB and at most the memory")
        if self.cpus < 1:
            raise ThinvmError("a guest needs at least one vCPU")
        # The same rules as for `thinvm up --virtio-mem`.
        check_virtio_mem(
            VMConfig(virtio_mem=self.virtio_mem, virtio_mem_plugged=self.virtio_mem_requested)
        )
        if self.tb_cache is not None:
            check_tb_cache(self.tb_cache)
        if self.portable and (self.ranges or self.sparse_ram):
            raise ThinvmError(
                "a portable guest runs on stock QEMU too: no page ranges, no sparse-ram in its XML"
            )


def check_tb_cache(size: int) -> None:
    """libvirt and QEMU size TCG's translation cache in whole MiB."""
    if size < MiB or size % MiB:
        raise ThinvmError("the TCG translation cache must be whole MiB, at least 1 MiB")


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrs: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrs)
    if text is not None:
        el.text = text
    return el


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _memballoon(devices: ET.Element, spec: DomainSpec) -> None:
    attrs = {"model": "virtio", "autodeflate": _on_off(spec.autodeflate)}
    if spec.free_page_reporting is not None:
        attrs["freePageReporting"] = _on_off(spec.free_page_reporting)
    balloon = _sub(devices, "memballoon", **attrs)
    _sub(balloon, "alias", name=BALLOON_ALIAS)
    _sub(balloon, "stats", period=str(spec.stats_period))


def _balloon_override(root: ET.Element, spec: DomainSpec) -> None:
    """Free page hinting, which libvirt has no attribute for (page ranges
    come with the machine type)."""
    if not spec.free_page_hint:
        return
    override = ET.SubElement(root, f"{{{QEMU_NS}}}override")
    device = ET.SubElement(override, f"{{{QEMU_NS}}}device", alias=BALLOON_ALIAS)
    frontend = ET.SubElement(device, f"{{{QEMU_NS}}}frontend")
    ET.SubElement(
        frontend, f"{{{QEMU_NS}}}property", name="free-page-hint", type="bool", value="true"
    )
    # QEMU wants hinting on an iothread: libvirt's <iothreads> makes
    # "iothread1", which libvirt has no balloon attribute to name.
    ET.SubElement(
        frontend, f"{{{QEMU_NS}}}property", name="iothread", type="string", value="iothread1"
    )


def machine_type(spec: DomainSpec) -> str:
    """The machine type: thinvm's when the domain wants page ranges."""
    return THINVM_MACHINE if spec.ranges else STOCK_MACHINE


def has_ranges(xml: str) -> bool:
    """Whether a domain (its live XML) runs on the machine type with page
    ranges, which only thinvm-qemu has."""
    el = ET.fromstring(xml).find("os/type")
    return el is not None and el.get("machine") == THINVM_MACHINE


def _virtio_mem(devices: ET.Element, spec: DomainSpec) -> None:
    if not spec.virtio_mem:
        return
    memory = _sub(devices, "memory", model="virtio-mem")
    target = _sub(memory, "target")
    _sub(target, "size", str(spec.virtio_mem // MiB), unit="MiB")
    _sub(target, "node", "0")
    _sub(target, "block", str(VIRTIO_MEM_BLOCK_SIZE // 1024), unit="KiB")
    _sub(target, "requested", str(spec.virtio_mem_requested // MiB), unit="MiB")
    _sub(memory, "alias", name=VIRTIO_MEM_ALIAS)


def _cpu(root: ET.Element, spec: DomainSpec) -> None:
    # TCG's most capable CPU model; both ends of a migration run the same.
    cpu = _sub(root, "cpu", mode="maximum", migratable="on")
    for feature in TCG_CPU_FEATURES_OFF:  # byte-wise string ops, slow under TCG
        _sub(cpu, "feature", policy="disable", name=feature)
    if spec.virtio_mem:
        # libvirt plugs memory devices only into a guest NUMA node.
        numa = _sub(cpu, "numa")
        cpus = f"0-{spec.cpus - 1}" if spec.cpus > 1 else "0"
        _sub(numa, "cell", id="0", cpus=cpus, memory=str(spec.memory // MiB), unit="MiB")


def _cmdline(spec: DomainSpec) -> str:
    """The kernel command line; with virtio-mem, hotplugged memory goes movable."""
    if spec.virtio_mem and VIRTIO_MEM_KERNEL_ARGS not in spec.cmdline:
        return f"{spec.cmdline} {VIRTIO_MEM_KERNEL_ARGS}"
    return spec.cmdline


def _commandline(root: ET.Element, spec: DomainSpec) -> None:
    globals_ = list(spec.extra_globals)
    if spec.sparse_ram:
        globals_.insert(0, f"migration.{spec.sparse_ram}=on")
    args: list[str] = []
    for value in globals_:
        args += ["-global", value]
    if not args:
        return
    cmd = ET.SubElement(root, f"{{{QEMU_NS}}}commandline")
    for value in args:
        ET.SubElement(cmd, f"{{{QEMU_NS}}}arg", value=value)


def _devices(root: ET.Element, spec: DomainSpec) -> None:
    devices = _sub(root, "devices")
    _sub(devices, "emulator", str(spec.emulator))
    disk = _sub(devices, "disk", type="file", device="disk")
    # cache='none' (O_DIRECT): no host page cache holds guest writes, so
    # libvirt considers live migration on shared storage safe.
    _sub(disk, "driver", name="qemu", type="qcow2", cache="none", discard="unmap")
    _sub(disk, "source", file=str(spec.disk))
    _sub(disk, "target", dev="vda", bus="virtio")
    if spec.console_log:
        serial = _sub(devices, "serial", type="file")
        _sub(serial, "source", path=str(spec.console_log), append="on")
    else:
        serial = _sub(devices, "serial", type="pty")
    _sub(serial, "target", port="0")
    # No path: libvirt picks one under its channel directory.
    channel = _sub(devices, "channel", type="unix")
    _sub(channel, "source", mode="bind")
    _sub(channel, "target", type="virtio", name=AGENT_PORT)
    _memballoon(devices, spec)
    _virtio_mem(devices, spec)


def _metadata(root: ET.Element, spec: DomainSpec) -> None:
    if spec.portable:
        metadata = _sub(root, "metadata")
        ET.SubElement(metadata, f"{{{THINVM_NS}}}guest", portable="yes")


def is_portable(xml: str) -> bool:
    """Whether a domain (its live XML) was defined as portable."""
    el = ET.fromstring(xml).find(f"metadata/{{{THINVM_NS}}}guest")
    return el is not None and el.get("portable") == "yes"


def domain_xml(spec: DomainSpec) -> str:
    """The domain XML for `spec` (validated first)."""
    spec.validate()
    root = ET.Element("domain", type="qemu")
    _sub(root, "name", spec.name)
    _metadata(root, spec)
    if spec.virtio_mem:
        # One slot, as QEMU's -m wants with maxmem (virtio-mem needs none,
        # libvirt's check on memory devices may count it).
        top = (spec.memory + spec.virtio_mem) // MiB
        _sub(root, "maxMemory", str(top), slots="1", unit="MiB")
    # libvirt counts memory devices into <memory>: base + virtio-mem.
    _sub(root, "memory", str((spec.memory + spec.virtio_mem) // MiB), unit="MiB")
    _sub(root, "currentMemory", str((spec.current_memory or spec.memory) // MiB), unit="MiB")
    _sub(root, "vcpu", str(spec.cpus))
    if spec.free_page_hint:
        _sub(root, "iothreads", "1")
    os_ = _sub(root, "os")
    _sub(os_, "type", "hvm", arch="x86_64", machine=machine_type(spec))
    _sub(os_, "kernel", str(spec.kernel))
    _sub(os_, "initrd", str(spec.initrd))
    _sub(os_, "cmdline", _cmdline(spec))
    # Without <acpi/> libvirt turns ACPI off: no graceful shutdown.
    features = _sub(root, "features")
    _sub(features, "acpi")
    _sub(features, "apic")
    if spec.tb_cache is not None:
        tcg = _sub(features, "tcg")
        _sub(tcg, "tb-cache", str(spec.tb_cache // MiB), unit="MiB")
    _cpu(root, spec)
    # No HPET, as Nova writes its domains: an idle guest's QEMU then stops
    # waking at the guest's HZ (thinvm.vm.machine.MACHINE says why).
    clock = _sub(root, "clock", offset="utc")
    _sub(clock, "timer", name="hpet", present="no")
    _sub(root, "on_poweroff", "destroy")
    _sub(root, "on_reboot", "restart")
    _sub(root, "on_crash", "destroy")
    _devices(root, spec)
    _commandline(root, spec)
    _balloon_override(root, spec)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode") + "\n"
