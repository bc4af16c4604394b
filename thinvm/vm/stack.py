"""Which parts a guest runs on: QEMU build, balloon driver, features.

The benchmarks compare variants built from these, and the demo runs the
stock stack against thinvm's.
"""

from dataclasses import dataclass

from thinvm.vm.machine import BalloonOptions


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
        caps = {"sparse-ram": True} if self.sparse else {}
        return {**caps, "multifd": True} if self.multifd else caps

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


# The best a user can configure on stock QEMU: free page reporting and
# hinting in the guest, multifd with its zero-page detection (QEMU's
# default since 9.0) on the wire.  thinvm's numbers are quoted against it.
STOCK_BEST = Stack(hint=True, reporting=True, multifd=True)
# thinvm's full stack over the same transport.
THINVM = Stack(
    build="patched",
    driver="thinvm",
    hint=True,
    reporting=True,
    sparse=True,
    ranges=True,
    multifd=True,
)
