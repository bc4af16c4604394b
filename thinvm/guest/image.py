"""Guest images: a Debian kernel plus a busybox initramfs with our agent.

guest/image/build.sh does the work and caches by its inputs, so asking
for an image that already exists costs a hash check.
"""

import json
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
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
