"""Boot a guest kernel through PVH: the ELF vmlinux inside a Debian
bzImage, loaded by QEMU where it wants to be, with no decompressor.

Debian compresses its kernels with xz (CONFIG_KERNEL_XZ), and under TCG
the bzImage's decompressor spends seconds of CPU on every boot unpacking
the ~65 MB vmlinux.  Debian's kernels also have CONFIG_PVH: their vmlinux
carries the Xen PHYS32_ENTRY note, and QEMU's -kernel boots such an ELF
directly (through the pvh.bin option ROM on pc and q35).  The vmlinux is
extracted once, next to the bzImage, and reused.

For the test suite's guests only (thinvm.testing.profile): the guest then
starts with less memory touched than after a bzImage boot (no
decompression buffers), so users' guests and the benchmarks keep the
bzImage their records were taken with.
"""

import contextlib
import lzma
import os
import shutil
import struct
import subprocess
from pathlib import Path

XZ_MAGIC = b"\xfd7zXZ\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ELF_MAGIC = b"\x7fELF"
PT_NOTE = 4
XEN_ELFNOTE_PHYS32_ENTRY = 18


def has_pvh_entry(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF has the Xen PHYS32_ENTRY note
    QEMU needs to boot it as PVH."""
    if elf[:4] != ELF_MAGIC or elf[4] != 2 or elf[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", elf, phoff + i * phentsize
        )
        if p_type == PT_NOTE and _xen_note(elf[p_offset : p_offset + p_filesz]):
            return True
    return False


def _xen_note(notes: bytes) -> bool:
    pos = 0
    while pos + 12 <= len(notes):
        namesz, descsz, kind = struct.unpack_from("<III", notes, pos)
        name = notes[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
        if name == b"Xen" and kind == XEN_ELFNOTE_PHYS32_ENTRY:
            return True
        pos += 12 + _aligned(namesz) + _aligned(descsz)
    return False


def _aligned(n: int) -> int:
    return (n + 3) & ~3


def payload(bzimage: bytes) -> bytes:
    """The compressed kernel a bzImage carries (boot protocol 2.08+:
    payload_offset and payload_length in the setup header)."""
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        return b""
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    return bzimage[start : start + length]


def extract(bzimage: bytes) -> bytes | None:
    """The vmlinux a bzImage carries, if its compression is one this can
    undo (xz: Debian 12's 6.1; zstd, with the zstd tool: backports'
    6.12); None otherwise."""
    packed = payload(bzimage)
    elf = None
    if packed.startswith(XZ_MAGIC):
        with contextlib.suppress(lzma.LZMAError):
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(packed)
    elif packed.startswith(ZSTD_MAGIC) and shutil.which("zstd"):
        # Kbuild appends the uncompressed size (4 bytes) after the frame.
        frame = packed[:-4]
        proc = subprocess.run(["zstd", "-dcq"], input=frame, capture_output=True, check=False)
        elf = proc.stdout if proc.returncode == 0 else None
    return elf if elf is not None and elf[:4] == ELF_MAGIC else None


def kernel_for(bzimage: Path) -> Path:
    """What to give QEMU's -kernel to boot `bzimage` through PVH: the
    cached vmlinux beside it when it has one that boots so, else `bzimage`."""
    if not bzimage.is_file():
        return bzimage  # a missing kernel is QEMU's to report
    cached = bzimage.with_name(bzimage.name + ".pvh")
    if cached.is_file() and cached.stat().st_mtime >= bzimage.stat().st_mtime:
        return cached
    elf = extract(bzimage.read_bytes())
    if elf is None or not has_pvh_entry(elf):
        return bzimage
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    tmp.write_bytes(elf)
    tmp.replace(cached)  # atomic: test workers may extract at once
    return cached
