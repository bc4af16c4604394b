"""QEMU's own sparse-ram migration qtests that are neither postcopy nor
in test_qtests_precopy.py: pages discarded before and after they were
sent, file and mapped-ram migration, cancel and retry, the destination's
refusals, ignore-shared and the vTPM."""

from tests.unit.test_qemu_patches import run_qtests


def test_sparse_ram_file_and_refusal_qtests_pass() -> None:
    run_qtests("/sparse-ram/(?!postcopy/|precopy/|multifd/|implied/)", minimum=16)
