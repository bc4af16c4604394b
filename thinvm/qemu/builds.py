"""The two QEMU builds thinvm runs: "stock" (Debian's QEMU) and "patched".

Both are produced by qemu/build.sh from one Debian source package; each
install directory holds the binary and a build.json naming its patch hash.
On a host without the build cache, the patched build is the one the
thinvm-qemu package installed (packaging/build-debs.sh), which carries the
same build.json.
"""

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.paths import REPO, cache_dir

FLAVOURS = ("stock", "patched")

# The build.json of each flavour a Debian package installs, looked at
# when the build cache has none.
PACKAGED = {"patched": Path("/usr/lib/thinvm-qemu/build.json")}


@dataclass(frozen=True)
class QemuBuild:
    flavour: str
    binary: Path
    debian_version: str
    patch_hash: str
    patches: tuple[str, ...]

    def version(self) -> str:
        """First line of `qemu-system-x86_64 --version`."""
        out = subprocess.run(
            [str(self.binary), "--version"], capture_output=True, text=True, check=True
        ).stdout
        return out.splitlines()[0] if out else "unknown"

    def describe(self) -> dict[str, object]:
        return {
            "flavour": self.flavour,
            "binary": str(self.binary),
            "debian_version": self.debian_version,
            "patch_hash": self.patch_hash,
            "patches": list(self.patches),
            "version": self.version(),
        }


def check_flavour(flavour: str) -> None:
    if flavour not in FLAVOURS:
        raise ThinvmError(f"unknown QEMU build {flavour!r}: choose one of {', '.join(FLAVOURS)}")


def find_build(flavour: str, packaged: dict[str, Path] | None = None) -> QemuBuild:
    """The build of that flavour: a developer's own (qemu/build.sh), else
    the one a Debian package installed; a clear error if there is none."""
    check_flavour(flavour)
    stamp = cache_dir() / "qemu" / flavour / "build.json"
    if not stamp.is_file():
        system = (PACKAGED if packaged is None else packaged).get(flavour)
        if system is None or not system.is_file():
            raise ThinvmError(
                f"QEMU build {flavour!r} is missing ({stamp.parent}): run 'make setup' "
                f"or 'qemu/build.sh {flavour}'"
                + (f", or install the thinvm-qemu package ({system})" if system else "")
            )
        stamp = system
    meta = json.loads(stamp.read_text())
    binary = Path(meta["binary"])
    if not binary.is_file():
        raise ThinvmError(f"QEMU binary {binary} is missing: run 'qemu/build.sh {flavour}'")
    return QemuBuild(
        flavour=flavour,
        binary=binary,
        debian_version=str(meta["debian_version"]),
        patch_hash=str(meta["patch_hash"]),
        patches=tuple(meta.get("patches", [])),
    )


def build_qemu(flavour: str = "all") -> None:
    """Run the incremental build script (fast when nothing changed)."""
    subprocess.run([str(REPO / "qemu" / "build.sh"), flavour], check=True)
