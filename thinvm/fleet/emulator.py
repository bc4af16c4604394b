"""Installing thinvm's QEMU builds where libvirt can run them.

libvirt runs QEMU as the libvirt-qemu user, which cannot read /root, so
the builds under ~/.cache/thinvm are copied to /usr/local/lib/thinvm.
The binaries find their firmware in Debian's packages (qemu/build.sh
sets --firmwarepath to /usr/share/qemu, /usr/share/seabios, ...), so the
binary is all there is to copy.
"""

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.paths import REPO
from thinvm.qemu import builds

INSTALL_ROOT = Path("/usr/local/lib/thinvm")
BINARY = "qemu-system-x86_64"
# On a host that installed QEMU with apt: Debian's (qemu-system-x86) and
# thinvm's (thinvm-qemu, beside Debian's, never instead).
PACKAGED_STOCK = Path("/usr/bin/qemu-system-x86_64")
PACKAGED_THINVM = Path("/usr/lib/thinvm-qemu/bin/qemu-system-x86_64")
PACKAGED = (PACKAGED_STOCK, PACKAGED_THINVM)

# The QEMU patch that adds the migration capability; the capability's
# name is read from it so that a rename in the series is followed here.
SPARSE_PATCH_GLOB = "0002-migration-add-the-sparse-ram-capability.patch"
_CAP_RE = re.compile(r'DEFINE_PROP_MIG_CAP\("([a-z0-9-]*sparse-ram)"')


def sparse_ram_capability(patches: Path = REPO / "qemu" / "patches") -> str:
    """The name of the sparse-ram migration capability in our QEMU series
    ("sparse-ram" or an experimental "x-sparse-ram")."""
    for patch in sorted(patches.glob("*sparse-ram*.patch")):
        match = _CAP_RE.search(patch.read_text(errors="replace"))
        if match:
            return match.group(1)
    raise ThinvmError(f"no sparse-ram capability found in {patches}: is the QEMU series complete?")


def emulator_path(flavour: str, root: Path = INSTALL_ROOT) -> Path:
    """Where `thinvm fleet install` puts the binary of that build."""
    builds.check_flavour(flavour)
    return root / f"qemu-{flavour}" / BINARY


@dataclass(frozen=True)
class InstalledEmulator:
    flavour: str
    path: Path
    patch_hash: str
    changed: bool


def install(flavour: str, root: Path = INSTALL_ROOT) -> InstalledEmulator:
    """Copy the build to `root`, atomically, when it differs from what is
    there; world-readable and executable so libvirt-qemu can run it."""
    build = builds.find_build(flavour)
    dest = emulator_path(flavour, root)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.parent.chmod(0o755)
    stamp = dest.parent / "build.json"
    want = {"flavour": flavour, "patch_hash": build.patch_hash, "source": str(build.binary)}
    changed = not (dest.is_file() and _same_file(build.binary, dest))
    if changed:
        tmp = dest.with_name(f".{BINARY}.tmp")
        shutil.copyfile(build.binary, tmp)
        tmp.chmod(0o755)
        tmp.replace(dest)
    stamp.write_text(json.dumps(want, indent=2) + "\n")
    stamp.chmod(0o644)
    return InstalledEmulator(flavour, dest, build.patch_hash, changed)


def _same_file(a: Path, b: Path) -> bool:
    sa, sb = a.stat(), b.stat()
    if sa.st_size != sb.st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            ca, cb = fa.read(1 << 20), fb.read(1 << 20)
            if ca != cb:
                return False
            if not ca:
                return True


def domcapabilities(path: Path, connect: str | None = None) -> str:
    """`virsh domcapabilities --emulatorbin PATH`: libvirt probing the
    binary; raises with libvirt's message when it cannot use it."""
    cmd = ["virsh"]
    if connect:
        cmd += ["-c", connect]
    cmd += ["domcapabilities", "--emulatorbin", str(path), "--virttype", "qemu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ThinvmError(f"libvirt cannot use {path}: {proc.stderr.strip()}")
    return proc.stdout


def has_emulator(connect: str, path: Path) -> bool:
    """Whether the libvirt at `connect` can run `path` (its host has it)."""
    try:
        domcapabilities(path, connect)
    except ThinvmError:
        return False
    return True


def packaged_emulator(connect: str) -> Path:
    """The QEMU a package-installed host runs guests on: thinvm-qemu where
    it is installed, else Debian's.  Asked of the host's libvirt, as the
    control plane of a real cluster would (it cannot look at the host's
    files)."""
    return PACKAGED_THINVM if has_emulator(connect, PACKAGED_THINVM) else PACKAGED_STOCK
