"""thinvm.guest.pvh: finding the vmlinux in a bzImage and its PVH entry."""

import lzma
import struct
from pathlib import Path

from thinvm.guest import pvh
from thinvm.testing.profile import GuestProfile


def note(name: bytes, kind: int, desc: bytes) -> bytes:
    def pad(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return struct.pack("<III", len(name) + 1, len(desc), kind) + pad(name + b"\0") + pad(desc)


def elf_with_notes(notes: bytes) -> bytes:
    """A 64-bit little-endian ELF with one PT_NOTE program header."""
    ehdr = bytearray(64)
    ehdr[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", ehdr, 0x20, 64)  # e_phoff
    struct.pack_into("<HH", ehdr, 0x36, 56, 1)  # e_phentsize, e_phnum
    phdr = struct.pack("<IIQQQQQQ", pvh.PT_NOTE, 0, 64 + 56, 0, 0, len(notes), len(notes), 4)
    return bytes(ehdr) + phdr + notes


def bzimage(payload: bytes) -> bytes:
    """A bzImage's setup header around `payload` (1 setup sector)."""
    setup = bytearray(1024)
    setup[0x1F1] = 1
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<II", setup, 0x248, 0, len(payload))
    return bytes(setup) + payload + b"trailer"


def test_the_pvh_entry_note_is_found_among_others() -> None:
    entry = note(b"Xen", pvh.XEN_ELFNOTE_PHYS32_ENTRY, b"\0\0\0\x01")
    assert pvh.has_pvh_entry(elf_with_notes(note(b"GNU", 3, b"id") + entry))
    assert not pvh.has_pvh_entry(elf_with_notes(note(b"Xen", 5, b"xen-3.0\0")))
    assert not pvh.has_pvh_entry(b"MZ" + bytes(100))


def test_an_xz_kernel_is_unpacked_and_anything_else_left_alone() -> None:
    vmlinux = elf_with_notes(note(b"Xen", pvh.XEN_ELFNOTE_PHYS32_ENTRY, b"\0" * 4))
    packed = lzma.compress(vmlinux, format=lzma.FORMAT_XZ) + struct.pack("<I", len(vmlinux))
    assert pvh.extract(bzimage(packed)) == vmlinux
    assert pvh.extract(bzimage(b"\x1f\x8b\x08" + bytes(40))) is None  # gzip: not undone
    assert pvh.extract(b"not a kernel") is None


def test_the_vmlinux_is_used_only_when_asked(tmp_path: Path) -> None:
    vmlinux = elf_with_notes(note(b"Xen", pvh.XEN_ELFNOTE_PHYS32_ENTRY, b"\0" * 4))
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(bzimage(lzma.compress(vmlinux, format=lzma.FORMAT_XZ)))
    assert GuestProfile(pvh=False).kernel(kernel) == kernel
    booted = GuestProfile(pvh=True).kernel(kernel)
    assert booted != kernel and booted.read_bytes() == vmlinux
    assert pvh.kernel_for(kernel) == booted  # cached
    plain = tmp_path / "plain"
    plain.write_bytes(bzimage(b"\x1f\x8b\x08" + bytes(40)))
    assert pvh.kernel_for(plain) == plain
