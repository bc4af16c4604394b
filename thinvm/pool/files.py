"""Slot files: allocate zeroed pages, punch them out, check what a file holds."""

import ctypes
import errno
import mmap
import os

from thinvm.units import KiB, MiB

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE_SIZE = 4 * KiB

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch(fd: int, offset: int, length: int) -> None:
    """Free the blocks of a range; it reads as zeros afterwards."""
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)


def populate_zeros(fd: int, offset: int, length: int) -> None:
    """Make every tmpfs page of the range exist and be zero.

    fallocate() on tmpfs allocates pages but leaves them to be cleared at
    their first fault; a write fault on every page does that now, in the
    pool's context, instead of in QEMU's.
    """
    with mmap.mmap(
        fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
    ) as m:
        try:
            m.madvise(MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: kernel older than 5.14
                raise
            for off in range(0, length, PAGE_SIZE):
                m[off] = 0


def fill_chunk(fd: int, kind: str, offset: int, length: int) -> None:
    """Allocate a range of a slot file as zeroed, populated pages."""
    fallocate(fd, 0, offset, length)  # hugetlbfs: allocates and zeroes
    if kind == "tmpfs":
        populate_zeros(fd, offset, length)


def is_zero(path: str, limit: int | None = None) -> bool:
    """Whether the file reads as zeros (its first `limit` bytes)."""
    zero = bytes(MiB)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while limit is None or done < limit:
            data = f.read(MiB)
            if not data:
                return True
            if data != zero[: len(data)]:
                return False
            done += len(data)
    return True


def allocated(path: str) -> int:
    """Bytes a slot file really holds (punched holes do not count; a symlink holds none)."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
