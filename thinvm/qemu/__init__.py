"""QEMU itself: the stock and patched builds, the accelerator probe, QMP."""
