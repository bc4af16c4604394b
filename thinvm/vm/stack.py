"""Which parts a guest runs on: QEMU build, balloon driver, features.

The benchmarks compare variants built from these, and the demo runs the
stock stack against thinvm's.
"""

from dataclasses import dataclass

from thinvm.errors import ThinvmError
from thinvm.vm.machine import BalloonOptions

# Migration capabilities thinvm sets (QMP migrate-set-capabilities).
SPARSE_RAM = "sparse-ram"  # the patched QEMU's alone (qemu/patches)
MULTIFD = "multifd"
POSTCOPY_RAM = "postcopy-ram"
PATCHED = "patched"  # the QEMU build with sparse-ram and page ranges


def caps_for(build: str, *, sparse: bool, postcopy: bool) -> dict[str, bool]:
    """The capabilities `thinvm migrate` sets on both sides for a VM of
    `build`, each said on or off: a VM that arrived by an earlier migration
    still has the capabilities it was received with.  sparse-ram only on
    the patched build: another QEMU refuses a capability it does not know,
    even one set off."""
    if sparse and build != PATCHED:
        raise ThinvmError(
            f"{SPARSE_RAM} needs the patched QEMU build: start the VM with --build {PATCHED}"
        )
    caps = {POSTCOPY_RAM: postcopy}
    if build == PATCHED:
        caps[SPARSE_RAM] = sparse
    return caps


@dataclass(frozen=True)
class Stack:
    build: str = "stock"
    driver: str = "stock"
    hint: bool = False
    reporting: bool = False
    sparse: bool = False  # the sparse-ram migration capability (patched QEMU)
    ranges: bool = False  # VIRTIO_BALLOON_F_RANGES offered (patched QEMU)
    multifd: bool = False  # multifd migration, QEMU's default 2 channels

    @property
    def caps(self) -> dict[str, bool]:
        """Migration capabilities, to be set on both sides."""
        caps = {SPARSE_RAM: True} if self.sparse else {}
        return {**caps, MULTIFD: True} if self.multifd else caps

    def balloon(self, **options: bool) -> BalloonOptions:
        return BalloonOptions(
            free_page_hint=self.hint,
            free_page_reporting=self.reporting,
            ranges=self.ranges,
            **options,
        )

    def describe(self) -> str:
        features = [
            name
            for name, on in (
                ("hinting", self.hint),
                ("reporting", self.reporting),
                ("page ranges", self.ranges),
                ("sparse-ram", self.sparse),
                ("multifd", self.multifd),
            )
            if on
        ]
        return f"{self.build} QEMU, {self.driver} driver, {', '.join(features) or 'no extras'}"


# The best a user can configure on stock QEMU: free page reporting in the
# guest, multifd with its zero-page detection (QEMU's default since 9.0) on
# the wire.  Not free page hinting: once reporting has returned free memory,
# hinting makes the guest allocate (and Debian's kernels zero) every free
# page again, and it measured slower in every recorded run (migrate-idle of
# 2026-11-25: twice the source CPU, 0.57 against 0.28 s with the ranges
# apart, and 446 against 243 ms median; bench/notes.md).  The benchmarks
# still measure it as a candidate.  thinvm's numbers are quoted
# against the best candidate of each run, which is usually this one.
STOCK_BEST = Stack(reporting=True, multifd=True)
# thinvm's stack over the same transport, likewise without hinting: it bought
# nothing on an idle 2 GiB guest and cost 2x at 128 GiB (migrate-scale).
THINVM = Stack(
    build="patched",
    driver="thinvm",
    reporting=True,
    sparse=True,
    ranges=True,
    multifd=True,
)
