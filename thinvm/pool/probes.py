"""What the pool measures on the host: memory pressure, and whether a slot's owner lives."""

from thinvm.host.memory import host_meminfo
from thinvm.host.pressure import read_psi
from thinvm.host.procs import proc_start_time, process_alive
from thinvm.pool.model import Owner, Policy, PoolError, Pressure


def owner_of(pid: int) -> Owner:
    start = proc_start_time(pid)
    if start is None:
        raise PoolError(f"process {pid} is gone")
    return Owner(pid, start)


def owner_alive(owner: Owner) -> bool:
    return process_alive(owner.pid, owner.start)


def read_pressure(policy: Policy) -> Pressure:
    """MemAvailable and PSI some avg10 (None where the kernel has no PSI)."""
    psi = read_psi(policy.psi_path)
    return Pressure(host_meminfo()["MemAvailable"], psi.some_avg10 if psi is not None else None)
