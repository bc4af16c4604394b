"""Booted libvirt domains, kept: thinvm.vm.bootcache's idea for the Debian
guests the test suite runs on cluster hosts.

For the test suite (THINVM_BOOT_CACHE=DIR, set by tests/conftest.py), not
for users: under TCG a Debian guest's boot costs its QEMU ~33 s of CPU to
its agent (systemd, udev and the initramfs, all CPU-bound on a vCPU that
never idles), and the suite boots five of them beside its other tests on
two CPUs.  Restoring the state libvirt saved of the same domain right
after its boot (`virsh save`, `virsh restore`) costs ~1 s (measured
2026-11-27, a 512 MiB 6.1 guest: a 120 MB save image, a 2.3 MB overlay).

"The same domain" is strict: its inactive XML but for its UUID and the
cluster's shared directory (per run), the emulator binary as the host
sees it, and the kernel, initrd and base disk image files (size and
modification time).  An entry is the save image, the guest's disk
overlay and console log as they were when it was saved, and the live
XML libvirt saved: a restore must match it (the UUID, and what libvirt
assigned at start), so a kept domain is defined again with its UUID.
A restore that fails removes the entry and boots the domain.

What a restored guest differs in from a booted one: the host holds only
the pages with data, QEMU's counters start at zero, and the guest's
clock is set from the host's once its agent answers.
"""

import hashlib
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.fleet.cluster import Host, virsh
from thinvm.fleet.guest import run_in_guest, wait_booted
from thinvm.guest.image import DiskImage, create_overlay
from thinvm.vm import bootcache

# Bumped when what is kept, or how, changes.
FORMAT = 2
DISK_FILE = "disk.qcow2"  # the overlay, as the saved guest left it
CONSOLE_FILE = "console.log"  # what its boot printed (file consoles)
XML_FILE = "domain.xml"  # the saved live XML, its shared directory SHARED
SHARED = "@SHARED@"  # the cluster's shared directory, per run
_UUID_RE = re.compile(r"<uuid>[^<]*</uuid>")


def start_domain(host: Host, name: str, image: DiskImage) -> float:
    """Start the defined domain `name` on `host` and wait for its agent;
    returns the seconds waited.  With a boot cache (module doc), a domain
    booted before is restored from its state after that boot."""
    root = bootcache.cache_root()
    if root is not None:
        restored = _start_kept(root, host, name, image)
        if restored is not None:
            return restored
    virsh(host, "start", name)
    return wait_booted(host, name)


def domain_key(xml: str, base_disk: Path, host_root: Path | None = None) -> str:
    """What makes two domains the same (module doc), as a file name.
    `host_root`: where the host's own root is, if it has one (the
    emulator path in the XML is inside it)."""
    dom = ET.fromstring(xml)
    uuid = dom.find("uuid")
    if uuid is not None:
        dom.remove(uuid)
    shared = str(_disk(dom).parent)
    text = ET.tostring(dom, encoding="unicode").replace(shared, SHARED)
    emulator = dom.findtext("devices/emulator") or ""
    files = [
        host_root / emulator.lstrip("/") if host_root else Path(emulator),
        Path(dom.findtext("os/kernel") or ""),
        Path(dom.findtext("os/initrd") or ""),
        base_disk,
    ]
    digest = hashlib.sha256(f"domain format {FORMAT}\n{text}\n".encode())
    for path in files:
        st = path.stat()
        digest.update(f"{path.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return "domain-" + digest.hexdigest()[:32]


def _disk(dom: ET.Element) -> Path:
    source = dom.find("devices/disk/source")
    if source is None or not source.get("file"):
        raise ThinvmError("a kept domain needs a file disk")
    return Path(source.get("file", ""))


def _console(dom: ET.Element) -> Path | None:
    source = dom.find("devices/serial[@type='file']/source")
    return Path(source.get("path", "")) if source is not None else None


def _start_kept(root: Path, host: Host, name: str, image: DiskImage) -> float | None:
    """The domain restored from its kept boot, made now if there is none;
    None: boot it (no entry could be made)."""
    xml = virsh(host, "dumpxml", "--inactive", name)
    key = domain_key(xml, image.disk, host.rootfs if host.packaged else None)
    try:
        entry = bootcache.ensure_entry(root, key, lambda d: _keep_boot(host, name, xml, d))
    except (ThinvmError, TimeoutError) as exc:
        print(f"thinvm: {name}: no kept boot: {exc}", file=sys.stderr)
        _as_defined(host, name, xml, image)
        return None
    started = time.monotonic()
    try:
        _restore(host, name, xml, entry)
    except (ThinvmError, OSError) as exc:
        # Not kept for the next domain: this one boots, the next keeps anew.
        shutil.rmtree(entry, ignore_errors=True)
        print(f"thinvm: {name}: restoring {entry} failed, booting: {exc}", file=sys.stderr)
        _as_defined(host, name, xml, image)
        return None
    wait_booted(host, name)
    # The guest's clock stopped when its state was saved.
    run_in_guest(host, name, f"date -s @{int(time.time())} >/dev/null")
    return time.monotonic() - started


def _keep_boot(host: Host, name: str, xml: str, directory: Path) -> None:
    """Boot the domain, save it once its agent answers, and keep its state,
    disk, console and saved XML in `directory` (the domain is left shut off)."""
    dom = ET.fromstring(xml)
    disk, console = _disk(dom), _console(dom)
    image = _save_path(disk, name)
    try:
        virsh(host, "start", name)
        wait_booted(host, name)
        # libvirtd writes the image, so where the host sees it: beside the disk.
        virsh(host, "save", name, str(image))
        # The XML a restore must match: the live one, with what libvirt
        # assigned at start (a memory device's address, say).
        saved = virsh(host, "save-image-dumpxml", str(image))
        (directory / XML_FILE).write_text(saved.replace(str(disk.parent), SHARED))
        shutil.move(image, directory / bootcache.STATE_FILE)
        shutil.copyfile(disk, directory / DISK_FILE)
        if console is not None and console.exists():
            shutil.copyfile(console, directory / CONSOLE_FILE)
    finally:
        image.unlink(missing_ok=True)


def _restore(host: Host, name: str, xml: str, entry: Path) -> None:
    """Define the domain again with the kept UUID, put its kept disk and
    console in place, and restore its saved state on `host`."""
    dom = ET.fromstring(xml)
    disk, console = _disk(dom), _console(dom)
    saved = (entry / XML_FILE).read_text().replace(SHARED, str(disk.parent))
    uuid = ET.fromstring(saved).findtext("uuid") or ""
    if dom.findtext("uuid") != uuid:
        definition = disk.with_suffix(".kept.xml")
        definition.write_text(_UUID_RE.sub(f"<uuid>{uuid}</uuid>", xml, count=1))
        virsh(host, "undefine", name)
        virsh(host, "define", str(definition))
        definition.unlink()
    shutil.copyfile(entry / DISK_FILE, disk)
    if console is not None and (entry / CONSOLE_FILE).exists():
        shutil.copyfile(entry / CONSOLE_FILE, console)
    image = _save_path(disk, name)
    restore_xml = image.with_suffix(".xml")
    shutil.copyfile(entry / bootcache.STATE_FILE, image)
    restore_xml.write_text(saved)
    try:
        virsh(host, "restore", str(image), "--xml", str(restore_xml))
    finally:
        image.unlink(missing_ok=True)
        restore_xml.unlink(missing_ok=True)


def _save_path(disk: Path, name: str) -> Path:
    return disk.with_name(f"{name}.kept-state.{os.getpid()}")


def _as_defined(host: Host, name: str, xml: str, image: DiskImage) -> None:
    """The domain as guest.define left it, to boot: shut off, a new disk
    overlay and no console log, whatever a failure left behind."""
    if virsh(host, "domstate", name).strip() != "shut off":
        virsh(host, "destroy", name)
    dom = ET.fromstring(xml)
    create_overlay(image.disk, _disk(dom))
    console = _console(dom)
    if console is not None:
        console.unlink(missing_ok=True)
