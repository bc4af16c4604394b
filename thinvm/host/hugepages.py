"""The kernel's persistent huge page pool, per page size (sysfs)."""

from pathlib import Path

from thinvm.host import HostError
from thinvm.units import KiB

HUGEPAGES_SYSFS = Path("/sys/kernel/mm/hugepages")


def hugepage_dir(page_size: int) -> Path:
    return HUGEPAGES_SYSFS / f"hugepages-{page_size // KiB}kB"


def hugepages_free(page_size: int) -> int:
    """Huge pages of that size nobody has allocated or reserved (0 if none exist)."""
    d = hugepage_dir(page_size)
    try:
        free = int((d / "free_hugepages").read_text())
        reserved = int((d / "resv_hugepages").read_text())
    except OSError:
        return 0
    return max(0, free - reserved)


def nr_hugepages(page_size: int) -> int:
    """Persistent huge pages of that size the kernel holds, in use or not."""
    return int((hugepage_dir(page_size) / "nr_hugepages").read_text())


def set_nr_hugepages(page_size: int, count: int) -> int:
    """Ask the kernel for `count` persistent huge pages; returns what it got.

    Growing may get fewer than asked (memory too fragmented or too little
    free); shrinking frees only pages nobody uses.
    """
    path = hugepage_dir(page_size) / "nr_hugepages"
    try:
        path.write_text(str(max(0, count)))
    except OSError as exc:
        raise HostError(f"cannot set {path}: {exc.strerror} (run as root)") from exc
    return int(path.read_text())
