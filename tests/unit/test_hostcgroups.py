"""The pure parts of systemd cluster hosts' cgroups (thinvm.fleet.hostcgroups)."""

from pathlib import Path

from thinvm.fleet import hostcgroups

# This machine's, abridged: v1 controllers each in a hierarchy of their
# own, name=systemd, the hybrid v2 hierarchy, and other mounts around.
MOUNTINFO = """\
30 24 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
33 30 0:29 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
35 30 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
36 24 0:32 /thinvm /var/lib/x/sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
37 24 0:33 / /proc rw - proc proc rw
"""

PROC_CGROUPS = """\
#subsys_name\thierarchy\tnum_cgroups\tenabled
cpuset\t3\t1\t1
cpu\t1\t16\t1
cpuacct\t2\t8\t1
memory\t4\t202\t1
net_cls\t0\t1\t1
perf_event\t0\t1\t1
net_prio\t0\t1\t1
hugetlb\t0\t22\t1
pids\t8\t41\t0
"""


def test_mounted_hierarchies_are_those_right_under_sys_fs_cgroup() -> None:
    found = hostcgroups.mounted_hierarchies(MOUNTINFO)
    assert found == {
        "cpu": {"cpu"},
        "cpuacct": {"cpuacct"},
        "memory": {"memory"},
        "systemd": {"name=systemd"},
        "unified": set(),
    }


def test_missing_hierarchies_join_as_systemd_mounts_them() -> None:
    mounted = hostcgroups.mounted_hierarchies(MOUNTINFO)
    # hugetlb is bound to the v2 hierarchy; pids is disabled.
    enabled = hostcgroups.enabled_controllers(PROC_CGROUPS, in_v2={"hugetlb"})
    assert enabled == ["cpuset", "cpu", "cpuacct", "memory", "net_cls", "perf_event", "net_prio"]
    missing = hostcgroups.missing_hierarchies(enabled, mounted)
    # cpu and cpuacct are mounted apart already: never joined again.
    assert missing == ["net_cls,net_prio", "cpuset", "perf_event"]
    assert hostcgroups.missing_hierarchies(enabled, {}) == [
        "net_cls,net_prio",
        "cpu,cpuacct",
        "cpuset",
        "memory",
        "perf_event",
    ]


def test_a_host_joins_each_hierarchy_before_it_shows_it() -> None:
    lines = hostcgroups.join_lines(Path("/r"), "ns-h1", ["systemd", "memory"])
    assert lines[0].startswith("mount -t tmpfs") and lines[0].endswith("/r/sys/fs/cgroup")
    assert lines[1:] == [
        "mkdir /r/sys/fs/cgroup/systemd",
        "echo 0 > /sys/fs/cgroup/systemd/thinvm/ns-h1/cgroup.procs",
        "mount --bind /sys/fs/cgroup/systemd/thinvm/ns-h1 /r/sys/fs/cgroup/systemd",
        "mkdir /r/sys/fs/cgroup/memory",
        "echo 0 > /sys/fs/cgroup/memory/thinvm/ns-h1/cgroup.procs",
        "mount --bind /sys/fs/cgroup/memory/thinvm/ns-h1 /r/sys/fs/cgroup/memory",
    ]
