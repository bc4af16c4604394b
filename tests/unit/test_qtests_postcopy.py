"""QEMU's own sparse-ram postcopy qtests (plain, preempt, recovery)."""

from tests.unit.test_qemu_patches import run_qtests


def test_sparse_ram_postcopy_qtests_pass() -> None:
    run_qtests("/sparse-ram/postcopy/", minimum=8)
