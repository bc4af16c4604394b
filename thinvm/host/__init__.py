"""The host: memory, pressure, cgroups, huge pages and CPUs, as VMs and the pool see them.

Shared by the warm pool (thinvm.pool) and the balance controller; nothing
here knows about either.
"""

from thinvm.errors import ThinvmError


class HostError(ThinvmError):
    """The host refused a change (a sysfs or cgroup write) or lacks a feature."""
