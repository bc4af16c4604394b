"""Booted guests, kept: the state of a guest right after its boot, loaded
into a new QEMU (or restored by libvirt) instead of booting the same
guest again.

For the test suite (GuestProfile.kept_boots, thinvm.testing.profile), not
for users.  Under TCG a busybox guest's boot costs its QEMU 3-7 s of CPU
to its agent, and the suite boots some ninety of them on two CPUs; a
Debian guest's costs ~33 s (systemd, udev and the initramfs, all
CPU-bound on a vCPU that never idles), and the suite boots five of them
under libvirt.  Loading the state of the same guest, saved when its agent
first answered, costs 0.1-0.6 s (measured 2026-11-27, 1 GiB 6.1 and 6.12
guests, stock and patched QEMU: ~80 MiB of pages with data, in a
mapped-ram file); restoring the same domain (`virsh save`, `virsh
restore`) ~1 s (a 512 MiB 6.1 guest: a 120 MB save image, a 2.3 MB
overlay).

Guests thinvm starts (KeptBootVM).  "The same guest" is strict: the same
QEMU command line but for the VM's name and run directory (neither
reaches the guest), and the same QEMU binary, kernel and initrd files
(size and modification time).  A guest is kept only where its state is
all in its RAM and devices: no disk, and no preallocated, file-backed or
pooled RAM (tests about those look at how the host backs the memory).
Saving the state is a migration of a stopped guest: with free page
hinting, the device asks the guest for hints and ends the round before
the guest runs again, as after any migration.

Libvirt domains (start_domain).  "The same domain" is strict: its
inactive XML but for its UUID and the cluster's shared directory (per
run), the emulator binary as the host sees it, and the kernel, initrd and
base disk image files (size and modification time).  An entry is the
save image, the guest's disk overlay and console log as they were when it
was saved, and the live XML libvirt saved: a restore must match it (the
UUID, and what libvirt assigned at start), so a kept domain is defined
again with its UUID.  A restore that fails removes the entry and boots
the domain.

What a loaded guest differs in from a booted one: the host holds only the
pages with data (a boot also leaves pages the guest zeroed or freed),
QEMU's counters start at zero, QEMU's serial log begins after the boot
(the template's is kept beside the state, serial-boot.log in the run
directory), and the guest's clock is set from the host's again once its
agent answers.

Entries are made under a lock file per key and renamed into place once
complete, so concurrent test workers wait for one another instead of
booting the same guest twice; an entry not loaded for a week goes when a
new one is made.
"""

import hashlib
import logging
import os
import re
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.fleet.cluster import Host, virsh
from thinvm.fleet.guest import run_in_guest, wait_booted
from thinvm.guest.image import DiskImage, create_overlay
from thinvm.host.locks import FileLock
from thinvm.testing.profile import GuestProfile, current
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig

log = logging.getLogger(__name__)

STATE_FILE = "state"  # the guest's RAM and devices (mapped-ram), or libvirt's save image
SERIAL_FILE = "serial.log"  # what the template's boot printed
DISK_FILE = "disk.qcow2"  # a domain's overlay, as the saved guest left it
CONSOLE_FILE = "console.log"  # what a domain's boot printed (file consoles)
XML_FILE = "domain.xml"  # a domain's saved live XML, its shared directory SHARED
SHARED = "@SHARED@"  # the cluster's shared directory, per run
# Bumped when what is kept, or how, changes.
GUEST_FORMAT = 1
DOMAIN_FORMAT = 2
# Entries not loaded for this long go when a new one is made.
STALE_SECONDS = 7 * 86400
# Saving waits for another process making the same entry this long.
CREATE_TIMEOUT = 600.0
# The VM that boots a guest whose state is kept.
BOOT_TEMPLATE_NAME = "boot-template"
KEPT_BOOT_TIMEOUT = 120.0  # saving or loading a kept boot (~0.5 s)
_UUID_RE = re.compile(r"<uuid>[^<]*</uuid>")


# -- entries -------------------------------------------------------------
def is_complete(entry: Path) -> bool:
    return (entry / STATE_FILE).is_file()


def creation_lock(root: Path, key: str, timeout: float = CREATE_TIMEOUT) -> FileLock:
    """Held while one process boots and saves an entry; others wait."""
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / f"{key}.lock")
    if not lock.acquire(timeout):
        raise TimeoutError(f"{lock.path} stayed locked for {timeout:.0f} s")
    return lock


def ensure_entry(root: Path, key: str, make: Callable[[Path], None]) -> Path:
    """The complete entry `key` under `root`, marked used; if missing,
    `make` fills a fresh directory with it under the creation lock, and
    that directory is renamed into place only once `make` returned (a
    concurrent worker waits for the lock, then finds the entry made)."""
    entry = root / key
    if not is_complete(entry):
        lock = creation_lock(root, key)
        try:
            if not is_complete(entry):
                _make_entry(entry, make)
        finally:
            lock.release()
    mark_used(entry)
    return entry


def _make_entry(entry: Path, make: Callable[[Path], None]) -> None:
    partial = entry.with_name(f"{entry.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        make(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(entry)
    remove_stale(entry.parent)


def mark_used(entry: Path) -> None:
    """An entry's age is the time it was last loaded."""
    os.utime(entry)


def remove_stale(root: Path, now: float | None = None) -> list[Path]:
    """Remove entries not loaded for STALE_SECONDS (older images, QEMUs)."""
    now = time.time() if now is None else now
    removed = []
    for entry in root.iterdir():
        if entry.is_dir() and now - entry.stat().st_mtime > STALE_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            (root / f"{entry.name}.lock").unlink(missing_ok=True)
            removed.append(entry)
    return removed


# -- guests thinvm starts ------------------------------------------------
def kept_kind(config: VMConfig, accel: str | None) -> bool:
    """Whether a guest of this configuration can be kept (module doc)."""
    return (
        accel == "tcg"
        and config.image == "initramfs"
        and config.backend in ("ram", "memfd")
        and not config.prealloc
        and config.pool is None
        and not config.extra_args
    )


def guest_key(command_line: list[str], name: str, rundir: Path, files: list[Path]) -> str:
    """What makes two guests the same (module doc), as a file name."""
    run = str(rundir)
    own_name = f"thinvm-{name}"
    args = ["@NAME@" if a == own_name else a.replace(run, "@RUN@") for a in command_line]
    digest = hashlib.sha256(f"format {GUEST_FORMAT}\n".encode())
    for arg in args:
        digest.update(arg.encode() + b"\0")
    for path in files:
        st = path.stat()
        digest.update(f"{path} {st.st_size} {st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


class KeptBootVM(VM):
    """A guest as the test suite starts it: booted as its GuestProfile says
    (by default the one THINVM_TEST_PROFILE holds), and loaded from its
    kept boot where the profile keeps boots and the guest can be kept."""

    def __init__(
        self,
        config: VMConfig,
        *,
        incoming: bool = False,
        rundir: Path | None = None,
        detached: bool = False,
        profile: GuestProfile | None = None,
    ) -> None:
        super().__init__(config, incoming=incoming, rundir=rundir, detached=detached)
        self.profile = profile or current() or GuestProfile()
        self._loading = False  # QEMU waits for a kept boot (-incoming defer)

    def _kernel(self) -> Path:
        return self.profile.kernel(super()._kernel())

    def _leading_append(self) -> str:
        return self.profile.append

    def command_line(self) -> list[str]:
        args = super().command_line()
        if self._loading and not self.incoming:
            args += ["-incoming", "defer"]
        return args

    def _boot(self, wait_agent: bool) -> None:
        """Load the guest's kept boot, made now if there is none, or boot it."""
        entry = self._kept_boot() if wait_agent and not self.incoming else None
        if entry is None:
            super()._boot(wait_agent)
            return
        self._loading = True
        self._spawn()
        self._wait_for_qmp()
        self._load(entry)
        self.wait_agent()
        # The guest's clock stopped when its state was saved.
        self.agent.check(f"date -s @{int(time.time())} >/dev/null")

    def _boot_key(self) -> str:
        assert self.build is not None and self.image is not None
        files = [self.build.binary, self._kernel(), self.image.initrd]
        return guest_key(self.command_line(), self.config.name, self.rundir, files)

    def _kept_boot(self) -> Path | None:
        """The kept boot of this guest, made now if there is none; None:
        boot the guest (no kept boots, a guest not kept, or no template)."""
        root = self.profile.kept_boots
        if root is None or not kept_kind(self.config, self.accel):
            return None
        key = self._boot_key()
        try:
            return ensure_entry(root, key, lambda d: self._keep_boot(d, key))
        except (ThinvmError, TimeoutError) as exc:
            # Booting this guest will say what is wrong, in its context.
            log.warning("%s: no kept boot: %s", self.config.name, exc)
            return None

    def _keep_boot(self, directory: Path, key: str) -> None:
        """Boot a template of this guest and save its state in `directory`."""
        template = KeptBootVM(
            replace(self.config, name=BOOT_TEMPLATE_NAME, memory_cgroup=None),
            profile=replace(self.profile, kept_boots=None),
        )
        try:
            template.start()
            if template._boot_key() != key:
                raise ThinvmError("the boot template's QEMU command line differs from the guest's")
            template.qmp("migrate-set-capabilities", capabilities=[_mapped_ram(True)])
            template.qmp("stop")
            template.qmp("migrate", uri=f"file:{directory / STATE_FILE}")
            migrate.wait_status(template, ("completed",), KEPT_BOOT_TIMEOUT)
            shutil.copy(template.serial_log, directory / SERIAL_FILE)
        finally:
            template.kill()

    def _load(self, entry: Path) -> None:
        """Load a kept boot into this QEMU (-incoming defer), and run it."""
        try:
            self.qmp("migrate-set-capabilities", capabilities=[_mapped_ram(True)])
            self.qmp("migrate-incoming", uri=f"file:{entry / STATE_FILE}")
            migrate.wait_status(self, ("completed",), KEPT_BOOT_TIMEOUT)
        except ThinvmError as exc:
            # Not kept for the next guest: it boots, and keeps a new one.
            shutil.rmtree(entry, ignore_errors=True)
            raise ThinvmError(f"loading the kept boot {entry} failed: {exc}") from exc
        # The guest's own migrations go over sockets, which mapped-ram refuses.
        self.qmp("migrate-set-capabilities", capabilities=[_mapped_ram(False)])
        self.qmp("cont")
        shutil.copy(entry / SERIAL_FILE, self.rundir / "serial-boot.log")


def _mapped_ram(on: bool) -> dict[str, Any]:
    return {"capability": "mapped-ram", "state": on}


def vm_class() -> type[VM]:
    """The class of the VMs `thinvm up` starts (thinvm.vm.registry): the
    suite's under a test profile, else thinvm's own."""
    return KeptBootVM if current() is not None else VM


# -- libvirt domains -----------------------------------------------------
def start_domain(
    host: Host, name: str, image: DiskImage, profile: GuestProfile | None = None
) -> float:
    """Start the defined domain `name` on `host` and wait for its agent;
    returns the seconds waited.  Where the profile (by default the test
    profile) keeps boots, a domain booted before is restored from its
    state after that boot (module doc)."""
    root = (profile or current() or GuestProfile()).kept_boots
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
    digest = hashlib.sha256(f"domain format {DOMAIN_FORMAT}\n{text}\n".encode())
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
        entry = ensure_entry(root, key, lambda d: _keep_domain_boot(host, name, xml, d))
    except (ThinvmError, TimeoutError) as exc:
        log.warning("%s: no kept boot: %s", name, exc)
        _as_defined(host, name, xml, image)
        return None
    started = time.monotonic()
    try:
        _restore(host, name, xml, entry)
    except (ThinvmError, OSError) as exc:
        # Not kept for the next domain: this one boots, the next keeps anew.
        shutil.rmtree(entry, ignore_errors=True)
        log.warning("%s: restoring %s failed, booting: %s", name, entry, exc)
        _as_defined(host, name, xml, image)
        return None
    wait_booted(host, name)
    # The guest's clock stopped when its state was saved.
    run_in_guest(host, name, f"date -s @{int(time.time())} >/dev/null")
    return time.monotonic() - started


def _keep_domain_boot(host: Host, name: str, xml: str, directory: Path) -> None:
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
        shutil.move(image, directory / STATE_FILE)
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
    shutil.copyfile(entry / STATE_FILE, image)
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
