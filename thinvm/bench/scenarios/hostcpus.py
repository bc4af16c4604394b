"""The CPUs of a simulated cluster host, for benchmarks that stand its
hosts in for two machines: each host of a migrating pair on a CPU of its
own (its cgroup subtree's cpuset), so a CPU-bound side cannot starve the
other.  libvirt resets a QEMU's affinity to every online CPU when the XML
pins nothing, so the cpuset is the one place the pairing can be set.
"""

import contextlib
from collections.abc import Iterable
from pathlib import Path

from thinvm.fleet import cluster, hostcgroups
from thinvm.fleet.cluster import Host

# The source host's CPU and the destination host's.
SOURCE_CPU, DESTINATION_CPU = "0", "1"


def _cpuset(h: Host) -> Path:
    return hostcgroups.host_cgroups(h.netns, ["cpuset"])["cpuset"]


def _adopt(h: Host, cpuset: Path) -> None:
    """Give a host that runs without cgroups of its own (a cluster host
    that is not packaged: its libvirtd has `cgroup_controllers = [ ]`) a
    cpuset cgroup holding every process of its network namespace.  The
    QEMUs its libvirtd starts later are born in it, so they keep its CPUs
    whatever affinity libvirt gives them."""
    hostcgroups.create(h.netns, ["cpuset"])
    procs = cpuset / "cgroup.procs"
    for pid in cluster.netns_pids(h.netns):
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            procs.write_text(f"{pid}\n")


def set_host_cpus(h: Host, cpus: str) -> None:
    """Give the host's cgroup subtree (its systemd, libvirtd, QEMUs, vCPUs)
    the CPUs `cpus`.  cgroup v1 keeps a child's CPUs within its parent's:
    narrowing goes deepest first, widening top down."""
    top = _cpuset(h)
    if not top.is_dir():
        _adopt(h, top)
    tree = [top, *(d for d in top.rglob("*") if d.is_dir())]
    tree.sort(key=lambda d: len(d.parts))
    current = set(cpu_list((top / "cpuset.cpus").read_text()))
    narrowing = set(cpu_list(cpus)) <= current
    for d in reversed(tree) if narrowing else tree:
        with contextlib.suppress(FileNotFoundError):  # a scope going away
            (d / "cpuset.cpus").write_text(cpus)


def pin_pair(src: Host, dst: Host) -> None:
    set_host_cpus(src, SOURCE_CPU)
    set_host_cpus(dst, DESTINATION_CPU)


def unpin(hosts: Iterable[Host]) -> None:
    """Every CPU back to each host (at the end of a benchmark's session);
    a host never pinned has no cpuset to widen and is given none."""
    for h in hosts:
        if not _cpuset(h).is_dir():
            continue
        with contextlib.suppress(OSError):
            set_host_cpus(h, all_cpus())


def cpu_list(text: str) -> list[int]:
    """ "0-2,4" -> [0, 1, 2, 4]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus += range(int(first), int(last or first) + 1)
    return cpus


def allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def all_cpus() -> str:
    return (hostcgroups.CGROUP_ROOT / "cpuset" / "cpuset.cpus").read_text().strip()
