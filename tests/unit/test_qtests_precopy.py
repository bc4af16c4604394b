"""QEMU's own sparse-ram migration qtests: precopy over the main channel
and multifd, and the skipping multifd implies.  The rest of the precopy
ones are in test_qtests_sparse_discard_files.py: one file each, so that two test
workers share them (about 190 s together under TCG)."""

from tests.unit.test_qemu_patches import run_qtests


def test_sparse_ram_precopy_qtests_pass() -> None:
    run_qtests("/sparse-ram/(precopy|multifd|implied)/", minimum=9)
