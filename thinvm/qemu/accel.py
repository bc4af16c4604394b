"""Choosing the accelerator: KVM only where it really runs at hardware speed.

Some hosts expose a /dev/kvm that works but is very slow (a nested or
para-virtualised backend).  `auto` therefore times the same tiny guest
under KVM and under TCG and picks KVM only when it is clearly faster.  The
verdict is cached per host kernel and QEMU binary.
"""

import json
import os
import platform
import subprocess
import time
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.paths import cache_dir, write_json_atomic
from thinvm.qemu.builds import QemuBuild

ACCELS = ("auto", "tcg", "kvm")
# The probe guest spins this many iterations, then leaves through
# isa-debug-exit.  Hardware KVM does it in milliseconds; TCG in ~0.1-0.5 s.
PROBE_LOOPS = 50_000_000
PROBE_TIMEOUT = 10.0
# KVM must beat TCG by this factor to be chosen.
KVM_MIN_SPEEDUP = 5.0


def _probe_firmware() -> bytes:
    """A 64 KiB flat BIOS: count down a register, then write port 0xf4.

    Entry is the reset vector (last 16 bytes), which jumps to offset 0 of
    the image (segment 0xf000 offset 0 maps the start of a 64 KiB BIOS).
    """
    size = 64 * 1024
    code = bytes(
        [
            *(0x66, 0xB9, *PROBE_LOOPS.to_bytes(4, "little")),  # mov ecx, loops
            *(0x66, 0x49),  # dec ecx
            *(0x75, 0xFC),  # jnz -4
            *(0xB0, 0x00, 0xE6, 0xF4),  # mov al, 0; out 0xf4, al
            *(0xF4, 0xEB, 0xFD),  # hlt; jmp hlt
        ]
    )
    reset = bytes([0xEA, 0x00, 0x00, 0x00, 0xF0])  # jmp far f000:0000
    image = bytearray(size)
    image[: len(code)] = code
    image[size - 16 : size - 16 + len(reset)] = reset
    return bytes(image)


def _time_probe(
    build: QemuBuild, accel: str, firmware: Path, timeout: float = PROBE_TIMEOUT
) -> float | None:
    """Seconds the probe guest took, or None if it failed or timed out."""
    cmd = [
        str(build.binary),
        "-accel",
        accel,
        "-machine",
        "pc",
        "-m",
        "16",
        "-nodefaults",
        "-display",
        "none",
        "-no-user-config",
        "-bios",
        str(firmware),
        "-device",
        "isa-debug-exit,iobase=0xf4,iosize=1",
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    # isa-debug-exit exits with (value << 1) | 1 = 1 for our write of 0.
    return time.monotonic() - start if proc.returncode == 1 else None


def probe(build: QemuBuild) -> dict[str, object]:
    firmware = cache_dir() / "accel-probe.bin"
    firmware.parent.mkdir(parents=True, exist_ok=True)
    firmware.write_bytes(_probe_firmware())
    tcg = _time_probe(build, "tcg", firmware)
    kvm = None
    if tcg is not None and os.access("/dev/kvm", os.W_OK):
        # KVM slower than TCG loses anyway: no need to wait for it longer.
        kvm = _time_probe(build, "kvm", firmware, timeout=max(1.0, tcg))
    use_kvm = kvm is not None and tcg is not None and kvm * KVM_MIN_SPEEDUP < tcg
    return {"tcg_seconds": tcg, "kvm_seconds": kvm, "choice": "kvm" if use_kvm else "tcg"}


def _identity(build: QemuBuild) -> dict[str, object]:
    """What a verdict holds for: this host kernel and this binary."""
    return {"kernel": platform.release(), "mtime_ns": build.binary.stat().st_mtime_ns}


def _read_verdicts(path: Path) -> dict[str, dict[str, object]]:
    """The cached verdicts by binary path; a missing or unreadable file
    (or one of the older single-verdict form) holds none."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    verdicts = cached.get("verdicts") if isinstance(cached, dict) else None
    return verdicts if isinstance(verdicts, dict) else {}


def probe_cached(build: QemuBuild) -> dict[str, object]:
    """The probe's verdict for `build`, probed once per host kernel and
    binary.  Each binary keeps its own verdict: with one shared entry, a
    process that alternates the stock and patched builds (the test suite,
    the benchmarks) probed again at every switch, ~4 s of CPU each time."""
    path = cache_dir() / "accel.json"
    binary, identity = str(build.binary), _identity(build)
    cached = _read_verdicts(path).get(binary, {})
    result = cached.get("result")
    if {k: cached.get(k) for k in identity} == identity and isinstance(result, dict):
        return dict(result)
    result = probe(build)
    # Read again: another process may have probed another build meanwhile.
    verdicts = _read_verdicts(path)
    verdicts[binary] = {**identity, "result": result}
    write_json_atomic(path, {"verdicts": verdicts})
    return result


def resolve(requested: str, build: QemuBuild) -> str:
    """'auto' -> kvm or tcg by the probe; explicit choices are honoured."""
    if requested not in ACCELS:
        raise ThinvmError(f"unknown accelerator {requested!r}: choose one of {', '.join(ACCELS)}")
    if requested != "auto":
        if requested == "kvm" and not os.access("/dev/kvm", os.W_OK):
            raise ThinvmError("--accel kvm: /dev/kvm is not usable here; use --accel tcg")
        return requested
    return str(probe_cached(build)["choice"])
