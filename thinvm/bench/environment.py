"""Facts about the host and the guests that decide what the numbers mean."""

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.guest.image import ensure_image
from thinvm.host.memory import host_meminfo
from thinvm.paths import REPO
from thinvm.qemu import accel as accel_mod
from thinvm.qemu import builds
from thinvm.vm.machine import MACHINE, TCG_CPU


def _first_line(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    except OSError:
        return ""
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def _bracketed(path: str) -> str:
    """The selected value of a sysfs choice file: 'always [madvise] never' -> madvise."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "unknown"
    match = re.search(r"\[(\w+)\]", text)
    return match.group(1) if match else text.strip()


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def host_warming_enabled() -> bool:
    """Whether scenarios warm free host memory before a consumer faults it
    in (thinvm.bench.scenarios.transport); THINVM_BENCH_WARM_HOST=0 turns
    it off to measure its effect, and the record must say so."""
    return os.environ.get("THINVM_BENCH_WARM_HOST", "1") != "0"


def host_environment() -> dict[str, Any]:
    """Facts about the host that decide what the numbers mean."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    meminfo = host_meminfo()
    # Uncommitted or untracked changes to the code that ran make the commit
    # an incomplete description.
    status = _first_line(["git", "status", "--porcelain", "--", "thinvm", "guest", "qemu"])
    return {
        "cpu_model": cpu_model(cpuinfo),
        "nproc": os.cpu_count(),
        "mem_total": meminfo.get("MemTotal"),
        "swap_total": meminfo.get("SwapTotal", 0),
        "host_kernel": platform.release(),
        "thp_enabled": _bracketed("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _bracketed("/sys/kernel/mm/transparent_hugepage/defrag"),
        "thinvm_commit": _first_line(["git", "rev-parse", "--short=12", "HEAD"]) or "unknown",
        "thinvm_dirty": bool(status),
        "python": platform.python_version(),
        "host_warming": host_warming_enabled(),
    }


def guest_environment(build: str, kernel: str, driver: str, accel: str) -> dict[str, Any]:
    """Both QEMU builds, the guest kernel and the accelerator the guests use."""
    qemu: dict[str, Any] = {}
    for flavour in builds.FLAVOURS:
        try:
            qemu[flavour] = builds.find_build(flavour).describe()
        except (ThinvmError, OSError, subprocess.CalledProcessError) as exc:
            qemu[flavour] = {"flavour": flavour, "error": str(exc)}
    image = ensure_image(kernel, driver)
    resolved = accel_mod.resolve(accel, builds.find_build(build))
    return {
        "qemu": qemu,
        "qemu_used": build,
        "guest_kernel": image.kernel_version,
        "guest_kernel_package": str(image.meta.get("package_version", "unknown")),
        "guest_kernel_series": kernel,
        "guest_driver": driver,
        "accel": resolved,
        # Records before 2026-11-27 ran TCG guests on plain "max", whose
        # byte-wise string ops made guest memory work 2-3x dearer.
        "guest_cpu": TCG_CPU if resolved == "tcg" else "host",
        # Records before 2026-11-27 15:00 UTC ran guests with q35's HPET.
        "guest_machine": MACHINE,
    }
