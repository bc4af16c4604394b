"""The host's CPUs, as the two sides of a migration on one machine share them."""

import os


def side_cpus(allowed: set[int] | None = None) -> tuple[list[int], list[int]] | None:
    """The CPUs of the source side (its QEMU, the guest's vCPUs with it)
    and of the destination: the CPUs this process may use, split in two
    halves, so that neither side of a migration can starve the other, as
    on two hosts.  None with a single CPU: nothing to split."""
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]
