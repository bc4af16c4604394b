"""thinvm: guest/host memory cooperation for QEMU virtual machines."""

__version__ = "0.1.0"
