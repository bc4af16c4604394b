"""Guest images: a Debian kernel plus a busybox initramfs with our agent,
and the Debian disk image with our packages.

guest/image/build.sh and build-disk.sh do the work and cache by their
inputs, so asking for an image that already exists costs a hash check.
Both thinvm.vm (single VMs) and thinvm.fleet (libvirt domains) boot them,
so they live here, below both.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.guest.agent import AgentClient
from thinvm.paths import REPO

KERNELS = ("6.1", "6.12")


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    meta: dict[str, Any]

    @property
    def kernel_version(self) -> str:
        return str(self.meta.get("kernel_version", "unknown"))


def _balloon_arg(kernel: str, driver: str) -> str:
    """Map a guest driver choice to build.sh's --balloon argument."""
    if driver in ("stock", "none"):
        return driver
    if driver == "thinvm":
        return str(build_balloon_module(kernel))
    path = Path(driver)
    if path.suffix == ".ko" and path.is_file():
        return str(path.resolve())
    raise ThinvmError(
        f"unknown guest balloon driver {driver!r}: use stock, none, thinvm or a path to a .ko"
    )


def _last_line(cmd: list[str], what: str) -> str:
    if not Path(cmd[0]).is_file():
        # The thinvm Debian package has the library but not the builders.
        raise ThinvmError(
            f"{what}: {cmd[0]} is missing; the test guest images are built from "
            "thinvm's source repository, which this installation does not have "
            "(run thinvm from a checkout after 'make setup')"
        )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ThinvmError(f"{what} failed:\n{proc.stderr.strip()[-1500:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise ThinvmError(f"{what} printed no result")
    return lines[-1]


def build_balloon_module(kernel: str) -> Path:
    """Build (or reuse) our balloon driver for that guest kernel."""
    script = REPO / "guest" / "balloon" / "build.sh"
    return Path(_last_line([str(script), kernel], f"building the balloon module for {kernel}"))


@cache
def ensure_image(kernel: str = "6.1", driver: str = "stock") -> GuestImage:
    """Build the image if its inputs changed; return its files."""
    if kernel not in KERNELS:
        raise ThinvmError(f"unknown guest kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    script = REPO / "guest" / "image" / "build.sh"
    cmd = [str(script), "--kernel", kernel, "--balloon", _balloon_arg(kernel, driver)]
    outdir = Path(_last_line(cmd, f"building the {kernel} guest image"))
    meta = json.loads((outdir / "image.json").read_text())
    return GuestImage(outdir / "vmlinuz", outdir / "initramfs.cpio.gz", meta)


# The Debian disk image (guest/image/build-disk.sh), installed where a
# system libvirtd's QEMU (libvirt-qemu) may read it.
IMAGES_DIR = Path("/var/lib/thinvm/images")
IMAGE_FILES = ("disk.qcow2", "vmlinuz", "initrd.img", "image.json")


@dataclass(frozen=True)
class DiskImage:
    directory: Path
    kernel: str
    kernel_version: str
    cmdline: str

    @property
    def disk(self) -> Path:
        return self.directory / "disk.qcow2"

    @property
    def vmlinuz(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"


def ensure_disk_image(kernel: str = "6.1", images: Path = IMAGES_DIR) -> DiskImage:
    """The Debian disk image for `kernel`, built if missing or stale, and
    installed in `images` (install_image)."""
    if kernel not in KERNELS:
        raise ThinvmError(f"--kernel {kernel}: want {' or '.join(KERNELS)}")
    proc = subprocess.run(
        [str(REPO / "guest" / "image" / "build-disk.sh"), "--kernel", kernel],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ThinvmError(f"building the {kernel} disk image failed (see the messages above)")
    return install_image(Path(lines[-1]), images)


def install_image(built: Path, images: Path = IMAGES_DIR) -> DiskImage:
    """Copy a built image directory (build-disk.sh's output) to
    `images`/<its name>, which names the kernel and the hash of the
    image's inputs: root-owned, directories 0755 and files 0644, so QEMU
    reads them as libvirt-qemu too.  A file is copied only when its size
    or modification time differ from the copy's (copies keep the
    original's), and replaced atomically: a running guest keeps the file
    it opened."""
    try:
        return _install_image(built, images / built.name)
    except PermissionError as exc:
        raise ThinvmError(
            f"cannot install the guest image in {images}: {exc} (run as root)"
        ) from exc
    except OSError as exc:
        raise ThinvmError(f"cannot install the guest image in {images}: {exc}") from exc


def _install_image(built: Path, dest: Path) -> DiskImage:
    dest.mkdir(parents=True, exist_ok=True)
    for d in (dest.parent, dest):
        d.chmod(0o755)
    for name in IMAGE_FILES:
        src, dst = built / name, dest / name
        if not src.is_file():
            raise ThinvmError(f"{src} missing: rebuild with guest/image/build-disk.sh")
        have = dst.stat() if dst.is_file() else None
        want = src.stat()
        if have and (have.st_size, have.st_mtime_ns) == (want.st_size, want.st_mtime_ns):
            continue
        _copy_into_place(src, dst, want)
    meta = json.loads((dest / "image.json").read_text())
    return DiskImage(dest, str(meta["kernel"]), str(meta["kernel_version"]), str(meta["cmdline"]))


def _copy_into_place(src: Path, dst: Path, want: os.stat_result) -> None:
    """Copy `src` to `dst` through a temporary file of this call's own:
    two processes may install the same image at once (pytest workers did,
    sharing one temporary name, and one renamed it from under the other)."""
    fd, name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        shutil.copyfile(src, tmp)
        tmp.chmod(0o644)
        os.utime(tmp, ns=(want.st_atime_ns, want.st_mtime_ns))
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)


def create_overlay(base: Path, overlay: Path) -> None:
    overlay.unlink(missing_ok=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(base), str(overlay)],
        check=True,
    )


_INFO_RE = re.compile(r"(\w+)=(\S+)")


def guest_info(client: AgentClient) -> dict[str, str]:
    """thinvm-guest-info from inside the guest: kernel, balloon driver."""
    out = client.check("/usr/local/sbin/thinvm-guest-info").stdout
    return dict(_INFO_RE.findall(out))
