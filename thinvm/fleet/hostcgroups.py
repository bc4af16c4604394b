"""The cgroups of systemd cluster hosts (`thinvm cluster up --packaged
--systemd`, docs/fleet.md "Hosts booted by systemd").

Each host gets a subtree of its own in every cgroup hierarchy of the
machine, the way a container manager delegates one: the shell that
becomes the host's systemd joins `thinvm/<netns>` in each hierarchy, then
enters a cgroup namespace, so systemd and libvirt see those directories as
their roots.  systemd 254 in legacy or hybrid mode mounts every v1
controller the kernel has, and the v2 hierarchy beside them: a hierarchy
left out would put the host's units and its guests' scopes in the
machine's root of it, shared with every other host.  So hierarchies the
machine lacks are mounted first, as a Debian server mounts them.
"""

import contextlib
import re
import shlex
import subprocess
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "thinvm"  # the hosts' cgroups live in PARENT/<netns> of each hierarchy
# Controllers systemd mounts together, each pair as one hierarchy.
JOINED = (("net_cls", "net_prio"), ("cpu", "cpuacct"))
# cpuset (v1): a new cgroup starts with no CPUs and no memory nodes, so
# nothing could join it; it takes its parent's.
CPUSET_INHERITED = ("cpuset.cpus", "cpuset.mems")


def mounted_hierarchies(mountinfo: str) -> dict[str, set[str]]:
    """The cgroup hierarchies mounted right under /sys/fs/cgroup: mount
    directory name -> the controllers it holds (name=systemd as
    "name=systemd", the v2 hierarchy as an empty set)."""
    found: dict[str, set[str]] = {}
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        fields, after = pre.split(), post.split()
        if len(fields) < 5 or len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        point = Path(fields[4])
        if point.parent != CGROUP_ROOT:
            continue
        options = set(after[2].split(","))
        known = {o for o in options if o.startswith("name=")} | (options & _CONTROLLER_NAMES)
        found[point.name] = known if after[0] == "cgroup" else set()
    return found


# Every v1 controller a kernel may have (/proc/cgroups), to tell them
# apart from mount options such as rw or relatime.
_CONTROLLER_NAMES = {
    "cpuset", "cpu", "cpuacct", "blkio", "memory", "devices", "freezer", "net_cls",
    "perf_event", "net_prio", "hugetlb", "pids", "rdma", "misc", "debug",
}  # fmt: skip


def enabled_controllers(proc_cgroups: str, in_v2: set[str]) -> list[str]:
    """The v1 controllers the kernel has enabled (/proc/cgroups), but for
    those bound to the v2 hierarchy (`in_v2`), which v1 cannot mount."""
    names = []
    for line in proc_cgroups.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 4 or fields[0] in in_v2:
            continue
        if fields[3] == "1" and fields[0] in _CONTROLLER_NAMES - {"debug", "misc", "rdma"}:
            names.append(fields[0])
    return names


def missing_hierarchies(enabled: list[str], mounted: dict[str, set[str]]) -> list[str]:
    """The hierarchies (as comma-joined controller lists) systemd would
    mount for controllers no mounted hierarchy holds."""
    held = set().union(*mounted.values()) if mounted else set()
    missing = [c for c in enabled if c not in held]
    groups = []
    for pair in JOINED:
        if all(c in missing for c in pair):
            groups.append(",".join(pair))
            missing = [c for c in missing if c not in pair]
    return groups + missing


def mount_missing() -> list[str]:
    """Mount, on the machine, the v1 hierarchies it lacks (what a Debian
    server mounts at boot), so that every host gets a subtree of each."""
    mounted = mounted_hierarchies(Path("/proc/self/mountinfo").read_text())
    in_v2: set[str] = set()
    for name, held in mounted.items():
        if not held and (CGROUP_ROOT / name / "cgroup.controllers").is_file():
            in_v2 |= set((CGROUP_ROOT / name / "cgroup.controllers").read_text().split())
    enabled = enabled_controllers(Path("/proc/cgroups").read_text(), in_v2)
    done = []
    for group in missing_hierarchies(enabled, mounted):
        point = CGROUP_ROOT / group
        point.mkdir(exist_ok=True)
        cmd = ["mount", "-t", "cgroup", "-o", f"nosuid,nodev,noexec,{group}", "cgroup", str(point)]
        if subprocess.run(cmd, capture_output=True, check=False).returncode == 0:
            done.append(group)
        else:
            with contextlib.suppress(OSError):
                point.rmdir()
    return done


def hierarchies() -> list[str]:
    """The machine's hierarchies a host gets a subtree of, name=systemd
    first (the one it cannot boot without)."""
    names = list(mounted_hierarchies(Path("/proc/self/mountinfo").read_text()))
    return sorted(names, key=lambda n: n != "systemd")


def host_cgroups(netns: str, names: list[str]) -> dict[str, Path]:
    """A host's cgroup in each hierarchy: what it sees as /sys/fs/cgroup/NAME."""
    return {name: CGROUP_ROOT / name / PARENT / netns for name in names}


def create(netns: str, names: list[str]) -> None:
    """Create a host's cgroups; cpuset ones take their parent's CPUs and
    memory nodes."""
    for path in host_cgroups(netns, names).values():
        for d in (path.parent, path):
            d.mkdir(exist_ok=True)
            for knob in CPUSET_INHERITED:
                own = d / knob
                if own.is_file() and not own.read_text().strip():
                    own.write_text((d.parent / knob).read_text())


def join_lines(rootfs: Path, netns: str, names: list[str]) -> list[str]:
    """Shell lines that move the shell into the host's cgroups and show
    each as /sys/fs/cgroup/NAME in the host's root (a tmpfs there first)."""
    q = shlex.quote  # the cluster directory is the user's: any character
    lines = [
        f"mount -t tmpfs -o mode=0755,nosuid,nodev,noexec tmpfs {q(f'{rootfs}/sys/fs/cgroup')}"
    ]
    for name, cgroup in host_cgroups(netns, names).items():
        inside = q(f"{rootfs}/sys/fs/cgroup/{name}")
        lines += [
            f"mkdir {inside}",
            f"echo 0 > {q(f'{cgroup}/cgroup.procs')}",
            f"mount --bind {q(str(cgroup))} {inside}",
        ]
    return lines


def remove(host_ns: re.Pattern[str]) -> list[str]:
    """Remove the cgroups of hosts whose netns matches `host_ns`, in every
    hierarchy (their processes are gone), deepest first; the parent too
    once no other cluster's host is left in it."""
    removed = []
    for name in hierarchies():
        parent = CGROUP_ROOT / name / PARENT
        with contextlib.suppress(OSError):
            for cgroup in parent.iterdir():
                if host_ns.fullmatch(cgroup.name) and cgroup.is_dir():
                    _remove_tree(cgroup)
                    removed.append(f"cgroup {cgroup}")
            parent.rmdir()
    return removed


def _remove_tree(path: Path) -> None:
    for sub in sorted((d for d in path.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        with contextlib.suppress(OSError):
            sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
