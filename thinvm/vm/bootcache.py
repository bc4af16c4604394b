"""Booted guests, kept: the state of a guest right after its boot, loaded
into a new QEMU instead of booting the same guest again.

For the test suite (THINVM_BOOT_CACHE=DIR, set by tests/conftest.py), not
for users: under TCG a busybox guest's boot costs its QEMU 3-7 s of CPU to
its agent, and the suite boots some ninety of them on two CPUs.  Loading
the state of the same guest, saved when its agent first answered, costs
0.1-0.6 s (measured 2026-11-27, 1 GiB 6.1 and 6.12 guests, stock and
patched QEMU: ~80 MiB of pages with data, in a mapped-ram file).

"The same guest" is strict: the same QEMU command line but for the VM's
name and run directory (neither reaches the guest), and the same QEMU
binary, kernel and initrd files (size and modification time).  A guest
is kept only where its state is all in its RAM and devices: no disk, and
no preallocated, file-backed or pooled RAM (tests about those look at how
the host backs the memory).  Saving the state is a migration of a stopped
guest: with free page hinting, the device asks the guest for hints and
ends the round before the guest runs again, as after any migration.

What a loaded guest differs in from a booted one: the host holds only
the pages with data (a boot also leaves pages the guest zeroed or freed),
QEMU's counters start at zero, QEMU's serial log begins after the boot
(the template's is kept beside the state), and the guest's clock is set
from the host's again once its agent answers.
"""

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from thinvm.host.locks import FileLock

if TYPE_CHECKING:
    from thinvm.vm.machine import VMConfig

ENV = "THINVM_BOOT_CACHE"
STATE_FILE = "state"  # the guest's RAM and devices (mapped-ram)
SERIAL_FILE = "serial.log"  # what the template's boot printed
# Bumped when what is kept, or how, changes.
FORMAT = 1
# Entries not loaded for this long go when a new one is made.
STALE_SECONDS = 7 * 86400
# Saving waits for another process making the same entry this long.
CREATE_TIMEOUT = 600.0


def cache_root() -> Path | None:
    """Where booted guests are kept; None: boot every guest."""
    env = os.environ.get(ENV)
    return Path(env) if env else None


def kept_kind(config: "VMConfig", accel: str | None) -> bool:
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
    digest = hashlib.sha256(f"format {FORMAT}\n".encode())
    for arg in args:
        digest.update(arg.encode() + b"\0")
    for path in files:
        st = path.stat()
        digest.update(f"{path} {st.st_size} {st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


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
