"""QEMU's own sparse-ram migration qtests, everything but postcopy."""

from tests.unit.test_qemu_patches import run_qtests


def test_sparse_ram_precopy_qtests_pass() -> None:
    run_qtests("/sparse-ram/(?!postcopy/)", minimum=19)
