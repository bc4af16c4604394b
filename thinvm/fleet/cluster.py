"""A simulated cluster of libvirt hosts on one machine.

Each host is a network namespace running its own libvirtd in its own
mount and UTS namespaces: /etc/libvirt, /var/lib/libvirt, /run/libvirt,
/var/cache/libvirt, /var/log/libvirt and /etc/pki are bind mounts of a
per-host directory, the host has its own host name, host UUID and a TLS
listener on its own address.  Hosts talk to each other only over TLS:
`up` makes a cluster CA and gives every host libvirt's server and client
certificates and QEMU's own migration pair in libvirt's PKI layout
(thinvm.fleet.pki); libvirtd lets in only a libvirt client certificate
of that CA (tls_allowed_dn_list), so not QEMU's, and QEMU's migration
stream is TLS too (qemu.conf migrate_tls_force).  The hosts are joined by veth
pairs through a bridge in a namespace of its own, optionally shaped with
a token bucket (`--link 10gbit`).  All traffic stays inside these
namespaces; the control plane talks to each libvirtd through its unix
socket, which the bind mount makes visible from outside.

Packaged hosts (`up --packaged`) are real Debian installs instead: each
host's root filesystem is an overlay on the cached root of
packaging/host-root.sh (Debian 12 with libvirt 11.3 and Debian's own
qemu-system-x86 from bookworm-backports), which is the root of the host's
mount namespace (pivot_root) where its packaged libvirtd and virtlogd
run, with its packaged /etc/libvirt where only
the listener, TLS, host UUID, migration address and shared storage
settings are added, QEMU as libvirt-qemu with dynamic ownership.  thinvm's
packages are installed in it with apt from the local repository
(packaging/build-debs.sh), bind-mounted at /srv/thinvm-apt.  The overlay
is mounted on the machine (the control plane reaches the daemon's socket
and QEMU's channels through it); /proc, /sys, /dev, the shared storage,
the guest images and the repository are mounted inside the host's own
mount namespace only.

The state (hosts, addresses, pids) is in <cluster dir>/state.json, so
`down` works after a crash; it also removes any namespace with our
prefix that the state file does not know about.
"""

import contextlib
import grp
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from thinvm.errors import ThinvmError
from thinvm.fleet import emulator, hostcgroups, pki
from thinvm.guest import image as guest_image
from thinvm.paths import REPO, cache_dir, write_json_atomic
from thinvm.progress import ProgressLine

NS_PREFIX = "thinvm-"  # + "h1".."hN" and "fabric"; see ns_prefix()
SUBNET = "10.217.0"  # a private /24, only ever inside our namespaces
BRIDGE = "br0"
HOST_IF = "eth0"
LIBVIRT_DIRS = {
    "etc": "/etc/libvirt",
    "lib": "/var/lib/libvirt",
    "run": "/run/libvirt",
    "cache": "/var/cache/libvirt",
    "log": "/var/log/libvirt",
    "pki": "/etc/pki",
}
START_TIMEOUT = 60.0  # a first connection waits for libvirtd to probe its QEMU binaries
# Whom libvirt runs QEMU as: Debian's defaults (qemu.conf user, group).
QEMU_USER = "libvirt-qemu"
QEMU_GROUP = "libvirt-qemu"
# Packaged hosts: where the local apt repository appears in a host's
# root, and the sources line that names it (docs/install.md).
APT_REPO_DIR = "/srv/thinvm-apt"
APT_SOURCE = f"deb [trusted=yes] file:{APT_REPO_DIR} ./\n"
APT_LIST = "/etc/apt/sources.list.d/thinvm.list"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# systemd hosts need the machine's name=systemd hierarchy (cgroup v1); each
# gets a cgroup of its own there and in every other hierarchy (hostcgroups).
CGROUP_V1_SYSTEMD = hostcgroups.CGROUP_ROOT / "systemd"
SYSTEMD = "/lib/systemd/systemd"  # a systemd host's init, in its root
# libvirtd's listener as Debian's units make it (socket activation); the
# drop-in binds it to the host's own address.
LISTEN_SOCKETS = {True: ("libvirtd-tls.socket", 16514), False: ("libvirtd-tcp.socket", 16509)}


def cluster_dir() -> Path:
    """Cluster state, per-host libvirt trees and the shared storage.  Not
    under /root: QEMU must be able to open the shared images."""
    env = os.environ.get("THINVM_CLUSTER_DIR")
    return Path(env) if env else Path("/var/lib/thinvm/cluster")


def ns_prefix(root: Path) -> str:
    """Namespace names of the cluster in `root`: thinvm-h1.. for the
    default directory, thinvm-<tag>-h1.. for others, so that a test or
    benchmark cluster can run next to an operator's."""
    if root == Path("/var/lib/thinvm/cluster"):
        return NS_PREFIX
    return f"{NS_PREFIX}{hashlib.sha1(str(root).encode()).hexdigest()[:6]}-"


def fabric_ns(root: Path) -> str:
    return f"{ns_prefix(root)}fabric"


def shared_dir(root: Path) -> Path:
    """Storage every host sees at the same path (guest disks)."""
    return root / "shared"


@dataclass(frozen=True)
class Host:
    name: str
    index: int
    address: str
    host_uuid: str
    flavour: str  # the QEMU behind the thinvm emulator path on this host
    root: str  # the host's directory (libvirt trees)
    netns: str
    tls: bool = True  # False: plain TCP without authentication (`up --no-tls`)
    # A real Debian install (`up --packaged`): its own root filesystem with
    # Debian's libvirt and QEMU; thinvm's packages installed with apt.
    packaged: bool = False
    # A packaged host booted by systemd as its PID 1 (`up --systemd`):
    # libvirtd, virtlogd and our services are socket-activated or started
    # as units, as on a Debian server.
    systemd: bool = False

    @property
    def rootfs(self) -> Path:
        """A packaged host's root filesystem, as the machine sees it."""
        return Path(self.root) / "root"

    @property
    def socket(self) -> Path:
        if self.packaged:
            return self.rootfs / "run" / "libvirt" / "libvirt-sock"
        return Path(self.root) / "run" / "libvirt-sock"

    @property
    def uri(self) -> str:
        """How this machine's virsh reaches the host (its unix socket)."""
        return f"qemu:///system?socket={self.socket}"

    @property
    def hostname(self) -> str:
        return f"thinvm-{self.name}"

    @property
    def peer_uri(self) -> str:
        """How other cluster hosts reach it (peer-to-peer migration): TLS,
        each side showing a certificate of the cluster CA."""
        return f"qemu+{'tls' if self.tls else 'tcp'}://{self.address}/system"

    def outside(self, path: str) -> Path:
        """The path, seen from outside the host, of a path in its libvirt
        trees (e.g. an agent socket under /var/lib/libvirt)."""
        for key, inside in LIBVIRT_DIRS.items():
            if path == inside or path.startswith(inside + "/"):
                if self.packaged:
                    return self.rootfs / path.lstrip("/")
                return Path(self.root) / key / path[len(inside) + 1 :]
        return Path(path)


@dataclass
class ClusterState:
    hosts: list[Host]
    link: str | None
    pids: dict[str, int]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        names = ", ".join(h.name for h in self.hosts)
        raise ThinvmError(f"no cluster host {name!r} (hosts: {names})")


# -- configuration files (pure) ---------------------------------------------


def libvirtd_conf(host: Host) -> str:
    return f"""# thinvm cluster host {host.name}: generated by `thinvm cluster up`
{_listener(host.tls)}listen_addr = "{host.address}"
{_UNIX_RW}host_uuid = "{host.host_uuid}"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
"""


# The read-write unix socket: no authentication (Debian's libvirt is built
# with polkit, its default, which needs a D-Bus system bus these hosts do
# not run), so it must be root's alone: with polkit built in, libvirt's
# default mode for it is 0777, which would give every local user root's
# control of the host's libvirt.
_UNIX_RW = (
    "# No polkit (no D-Bus here): the read-write socket is root's alone.\n"
    'auth_unix_rw = "none"\nunix_sock_rw_perms = "0700"\n'
)


def _listener(tls: bool) -> str:
    if not tls:
        return (
            "# `up --no-tls`: plain TCP, no authentication (to measure TLS).\n"
            'listen_tls = 0\nlisten_tcp = 1\nauth_tcp = "none"\n'
        )
    dns = ", ".join(f'"{dn}"' for dn in pki.LIBVIRT_CLIENT_DNS)
    return (
        "# Peers reach this host over TLS only, and must show a client certificate\n"
        "# of the cluster CA (tls_no_verify_certificate stays 0) whose DN is a\n"
        "# libvirt client's: the certificates QEMU reads (/etc/pki/qemu) are of the\n"
        "# same CA, and must not open another host.  The certificate is the\n"
        "# authentication, so no SASL on top.  The unix socket is reached only\n"
        "# by root, from the machine through the host's directory.\n"
        'listen_tls = 1\nlisten_tcp = 0\nauth_tls = "none"\n'
        f"tls_allowed_dn_list = [ {dns} ]\n"
    )


def qemu_conf(host: Host, shared: Path) -> str:
    # QEMU runs as Debian's default user, libvirt-qemu, with dynamic
    # ownership (the default): libvirt chowns a guest's overlay, console
    # log, kernel and initrd to it while the guest runs.  It does not
    # remember the owner (no xattrs on files every host shares): it gives
    # them back to root.  No cgroups (this machine has no systemd to
    # delegate them) and no per-QEMU /dev namespace.  The console goes to
    # files rather than through virtlogd, one daemon less per host.
    # Migration listens on the host's own address only.  The shared
    # directory is one filesystem seen by every host (the same kernel):
    # shared_filesystems tells libvirt that live migration with disks
    # there needs no storage copy, as it would for NFS, and that the
    # source must not give the files back to root when the guest leaves.
    return f"""# thinvm cluster host {host.name}: generated by `thinvm cluster up`
# QEMU runs as libvirt-qemu (Debian's default user and group).
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
stdio_handler = "file"
migration_address = "{host.address}"
migration_host = "{host.address}"
shared_filesystems = [ "{shared}" ]
""" + (_MIGRATE_TLS if host.tls else "")


# Every migration stream is TLS with certificates of the cluster CA
# (/etc/pki/qemu, the default certificate directory): a plain one is
# refused, whatever the caller asks for.
_MIGRATE_TLS = "migrate_tls_force = 1\n"


def host_script(host: Host, patched_dir: Path, stock_dir: Path) -> str:
    """The shell that turns a fresh mount+UTS namespace into the host and
    execs its libvirtd."""
    q = shlex.quote  # THINVM_CLUSTER_DIR is the user's: any character
    lines = ["set -e", "mount --make-rprivate /", f"hostname {q(host.hostname)}"]
    for key, inside in LIBVIRT_DIRS.items():
        lines += [f"mkdir -p {q(inside)}", f"mount --bind {q(f'{host.root}/{key}')} {q(inside)}"]
    if host.flavour == "stock":
        # An older host: its thinvm emulator path holds stock QEMU.
        lines.append(f"mount --bind {q(str(stock_dir))} {q(str(patched_dir))}")
    lines.append("ip link set lo up")
    # The default pid file, /run/libvirtd.pid, would be shared by all hosts.
    conf = q(f"{host.root}/etc/libvirtd.conf")
    lines.append(f"exec libvirtd --listen -f {conf} -p /run/libvirt/libvirtd.pid")
    return "\n".join(lines) + "\n"


# -- packaged hosts (pure parts) ----------------------------------------------


def packaged_libvirtd_conf(host: Host) -> str:
    """What `up --packaged` appends to the host's packaged
    /etc/libvirt/libvirtd.conf (every line of Debian's is a comment)."""
    if host.systemd:
        # The listener is a socket unit (listen_dropin), and the read-write
        # socket stays Debian's: polkit decides who may use it (the
        # D-Bus system bus runs here), root only by default.
        unit, _ = LISTEN_SOCKETS[host.tls]
        origin = "`thinvm cluster up --packaged --systemd`"
        listener = f"# The listener is {unit} (a drop-in binds it to this host's address);\n"
        listener += "# these keys say how it authenticates.\n" + _listener(host.tls)
        unix = ""
    else:
        origin = "`thinvm cluster up --packaged`"
        listener = "# The listener (started with --listen), on this host's address only.\n"
        listener += f'{_listener(host.tls)}listen_addr = "{host.address}"\n'
        unix = _UNIX_RW
    return f"""
# thinvm cluster host {host.name}: added by {origin}.
{listener}{unix}host_uuid = "{host.host_uuid}"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
"""


def packaged_qemu_conf(host: Host, shared: Path) -> str:
    """What `up --packaged` appends to the host's packaged qemu.conf: the
    migration address, TLS on every migration stream, and the cluster's
    shared storage.  Everything else stays Debian's: QEMU as libvirt-qemu,
    dynamic ownership, namespaces, virtlogd for the console, cgroups for
    each guest where the host has them (systemd hosts); no AppArmor, as
    this machine's kernel has none, which libvirt finds out for itself."""
    tls = _MIGRATE_TLS if host.tls else ""
    return f"""
# thinvm cluster host {host.name}: added by `thinvm cluster up --packaged`.
migration_address = "{host.address}"
migration_host = "{host.address}"
{tls}# Guest disks: storage every host mounts at this path, as NFS would
# be; libvirt recognises NFS by itself, a local filesystem it must be
# told (no storage copy in a migration).  No ownership xattrs on those
# shared files (libvirt gives them back to root instead), as on NFS.
shared_filesystems = [ "{shared}" ]
remember_owner = 0
"""


_DEV_NODES = (
    ("null", "1 3"), ("zero", "1 5"), ("full", "1 7"), ("random", "1 8"),
    ("urandom", "1 9"), ("tty", "5 0"), ("ptmx", "5 2"),
)  # fmt: skip


def packaged_host_script(
    host: Host, shared: Path, images: str, repo: Path, hierarchies: Sequence[str] = ("systemd",)
) -> str:
    """The shell that turns a fresh mount+UTS namespace into a packaged
    host and execs its libvirtd (or, on a systemd host, systemd), with the
    host's root as the namespace's."""
    q = shlex.quote  # THINVM_CLUSTER_DIR is the user's: any character
    r = host.rootfs

    def at(path: str | Path) -> str:
        """A path in the host's root, quoted for the shell."""
        return q(f"{r}{path}")

    lines = [
        "set -e",
        "mount --make-rprivate /",
        f"hostname {q(host.hostname)}",
        f"mount -t proc proc {at('/proc')}",
        *(
            _systemd_sysfs(host, hierarchies)
            if host.systemd
            else [f"mount -t sysfs sysfs {at('/sys')}"]
        ),
        # A /dev of its own with the usual nodes and no /dev/kvm: the guests
        # run under TCG (README), and a /dev/kvm whose group is not the
        # host's kvm group made libvirt probe QEMU again at every call.
        f"mount -t tmpfs -o mode=0755,nosuid tmpfs {at('/dev')}",
        *(f"mknod -m 0666 {at(f'/dev/{name}')} c {nums}" for name, nums in _DEV_NODES),
        f"mkdir -p {at('/dev/pts')} {at('/dev/shm')}",
        f"mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts {at('/dev/pts')}",
        f"ln -s /proc/self/fd {at('/dev/fd')}",
        f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {at('/dev/shm')}",
        # Shared storage and images at the same path as on every host.
        f"mkdir -p {at(shared)} {at(images)} {at(APT_REPO_DIR)}",
        f"mount --bind {q(str(shared))} {at(shared)}",
        f"mount --bind {q(images)} {at(images)}",
        f"mount --bind {q(str(repo))} {at(APT_REPO_DIR)}",
        f"mount -o remount,bind,ro {at(APT_REPO_DIR)}",
        "ip link set lo up",
        f"export PATH={HOST_PATH}",
        # The host's root becomes the namespace's root (pivot_root, not
        # chroot): libvirt builds each QEMU's private /dev from a helper
        # that enters the QEMU's mount namespace with setns(), which puts
        # it at that namespace's root; under chroot that was the machine's
        # /, so the nodes (/dev/null, /dev/ptmx...) went there and QEMU's
        # /dev stayed empty ("Failed to create PTY" for a pty console).
        f"mkdir -p {at('/run/thinvm-old-root')}",
        f"cd {q(str(r))}",
        "pivot_root . run/thinvm-old-root",
        "cd /",
        "umount -l /run/thinvm-old-root",
        "rmdir /run/thinvm-old-root",
    ]
    if host.systemd:
        # systemd as this PID namespace's init, told it runs in a container
        # (no udev, no hardware clock, no getty on a console it lacks), in
        # a cgroup namespace rooted at the host's cgroup: it sees its units
        # where a server's are (/system.slice/...).
        lines += ["export container=thinvm", f"exec unshare --cgroup {SYSTEMD}"]
    else:
        # Debian's daemons as packaged, with their packaged configuration
        # files and pid files; virtlogd takes the guests' consoles.
        lines += [
            "/usr/sbin/virtlogd -d || echo 'virtlogd: not started (still running?)'",
            "exec /usr/sbin/libvirtd --listen",
        ]
    return "\n".join(lines) + "\n"


def _systemd_sysfs(host: Host, hierarchies: Sequence[str]) -> list[str]:
    """/sys for systemd as a container's init: read-only, so that no udev
    starts to act on the machine's devices (systemd-udevd wants it
    writable), with the host's own cgroup as the root of its name=systemd
    hierarchy (cgroup v1, legacy mode: systemd 254 still runs there); the
    shell moves itself into that cgroup before it becomes systemd.  Every
    other hierarchy is delegated the same way, a subtree each, so systemd
    and libvirt find the controllers where a server has them and keep out
    of the machine's and the other hosts' cgroups.  /run is made a mount
    point so that systemd leaves it alone (no tmpfs over it): the control
    plane reaches libvirtd's socket through it from outside, as on the
    other packaged hosts."""
    r = host.rootfs
    sysfs, run = shlex.quote(f"{r}/sys"), shlex.quote(f"{r}/run")
    return [
        f"mount -t sysfs -o ro sysfs {sysfs}",
        *hostcgroups.join_lines(r, host.netns, list(hierarchies)),
        f"mount --bind {run} {run}",
    ]


def overlay_options(lower: Path, host_dir: Path) -> str:
    return f"lowerdir={lower},upperdir={host_dir / 'upper'},workdir={host_dir / 'work'}"


def group_id(etc_group: str, name: str) -> int:
    """A group's id in a host's /etc/group (its own, not the machine's)."""
    for line in etc_group.splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[0] == name:
            return int(fields[2])
    raise ThinvmError(f"no group {name!r} in the host's /etc/group")


def plan_hosts(
    count: int,
    root: Path,
    stock: Sequence[str] = (),
    tls: bool = True,
    packaged: bool = False,
    systemd: bool = False,
) -> list[Host]:
    if not 1 <= count <= 16:
        raise ThinvmError(f"--hosts {count}: want 1 to 16")
    names = [f"h{i}" for i in range(1, count + 1)]
    unknown = sorted(set(stock) - set(names))
    if unknown:
        raise ThinvmError(f"--stock {', '.join(unknown)}: not a host of this cluster")
    return [
        Host(
            name=name,
            index=i,
            address=f"{SUBNET}.{i}",
            host_uuid=str(uuid.uuid4()),
            flavour="stock" if name in stock else "patched",
            root=str(root / "hosts" / name),
            netns=f"{ns_prefix(root)}{name}",
            tls=tls,
            packaged=packaged,
            systemd=systemd,
        )
        for i, name in enumerate(names, start=1)
    ]


# -- commands ----------------------------------------------------------------


def _run(cmd: Sequence[str], what: str) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ThinvmError(f"{what} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def virsh(host: Host, *args: str, timeout: float = 120.0) -> str:
    """Run virsh against `host`; libvirt's own message on failure."""
    cmd = ["virsh", "-q", "-c", host.uri, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ThinvmError(
            f"virsh {args[0]} on {host.name} timed out after {timeout:.0f} s"
        ) from exc
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().removeprefix("error: ")
        raise ThinvmError(f"{host.name}: virsh {args[0]}: {' '.join(msg.split())}")
    return proc.stdout


def state_path(root: Path) -> Path:
    return root / "state.json"


def load_state(root: Path | None = None) -> ClusterState:
    root = root or cluster_dir()
    path = state_path(root)
    if not path.is_file():
        raise ThinvmError("no cluster is up: run 'thinvm cluster up --hosts 2'")
    data = json.loads(path.read_text())
    return ClusterState(
        hosts=[Host(**h) for h in data["hosts"]],
        link=data.get("link"),
        pids={k: int(v) for k, v in data.get("pids", {}).items()},
    )


def _save_state(root: Path, state: ClusterState) -> None:
    data = {"hosts": [asdict(h) for h in state.hosts], "link": state.link, "pids": state.pids}
    write_json_atomic(state_path(root), data)


def _make_fabric(hosts: Sequence[Host], link: str | None, fabric: str) -> None:
    _run(["ip", "netns", "add", fabric], "ip netns add")
    _run(["ip", "-n", fabric, "link", "add", BRIDGE, "type", "bridge"], "bridge")
    _run(["ip", "-n", fabric, "link", "set", BRIDGE, "up"], "bridge up")
    for h in hosts:
        _run(["ip", "netns", "add", h.netns], "ip netns add")
        port = f"port{h.index}"
        _run(
            ["ip", "link", "add", HOST_IF, "netns", h.netns, "type", "veth",
             "peer", "name", port, "netns", fabric],
            "veth",
        )  # fmt: skip
        _run(["ip", "-n", fabric, "link", "set", port, "master", BRIDGE, "up"], "port")
        _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", HOST_IF], "addr")
        _run(["ip", "-n", h.netns, "link", "set", HOST_IF, "up"], "link up")
        _run(["ip", "-n", h.netns, "link", "set", "lo", "up"], "lo up")
        if link:
            # A token bucket at line rate on each host's egress; 4 MiB of
            # burst keeps tbf accurate at 10 Gbit/s (as thinvm.bench.probe).
            _run(
                ["tc", "-n", h.netns, "qdisc", "add", "dev", HOST_IF, "root", "tbf",
                 "rate", link, "burst", "4mb", "latency", "20ms"],
                f"tc rate {link}",
            )  # fmt: skip


def _write_host_tree(h: Host, ca: tuple[Path, Path] | None) -> None:
    root = Path(h.root)
    for key in LIBVIRT_DIRS:
        (root / key).mkdir(parents=True, exist_ok=True)
    if ca is not None:
        qemu_gid = grp.getgrnam(QEMU_GROUP).gr_gid
        pki.host_tree(root / "pki", ca, h.address, h.hostname, qemu_gid)
    (root / "etc" / "libvirtd.conf").write_text(libvirtd_conf(h))
    (root / "etc" / "qemu.conf").write_text(qemu_conf(h, shared_dir(root.parent.parent)))


def host_root_lower() -> Path:
    """The cached root filesystem of packaged hosts (packaging/host-root.sh
    builds it once: Debian 12, libvirt, Debian's QEMU)."""
    proc = subprocess.run(
        [str(REPO / "packaging" / "host-root.sh")],
        stdout=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ThinvmError("packaging/host-root.sh failed (see the messages above)")
    return Path(lines[-1])


def apt_repo() -> Path:
    """The local apt repository (packaging/build-debs.sh), brought up to date."""
    proc = subprocess.run(
        [str(REPO / "packaging" / "build-debs.sh")],
        stdout=subprocess.PIPE, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise ThinvmError("packaging/build-debs.sh failed (see the messages above)")
    return cache_dir() / "apt-repo"


def _write_packaged_host(h: Host, ca: tuple[Path, Path] | None, lower: Path) -> None:
    """Mount the host's overlay root and add our settings to its packaged
    configuration, its certificates and the repository's sources line."""
    d = Path(h.root)
    for sub in ("upper", "work", "root"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "overlay", "overlay", "-o", overlay_options(lower, d), str(h.rootfs)],
         f"mounting the root of {h.name}")  # fmt: skip
    r = h.rootfs
    with (r / "etc/libvirt/libvirtd.conf").open("a") as f:
        f.write(packaged_libvirtd_conf(h))
    with (r / "etc/libvirt/qemu.conf").open("a") as f:
        f.write(packaged_qemu_conf(h, shared_dir(d.parent.parent)))
    if ca is not None:
        gid = group_id((r / "etc/group").read_text(), QEMU_GROUP)
        pki.host_tree(r / "etc/pki", ca, h.address, h.hostname, gid)
    (r / APT_LIST.lstrip("/")).write_text(APT_SOURCE)
    if h.systemd:
        _write_systemd_host(h)


def listen_dropin(host: Host) -> str:
    """The drop-in that binds the host's libvirtd listener socket unit to
    its own address (Debian's listens on every address)."""
    _, port = LISTEN_SOCKETS[host.tls]
    return (
        f"# thinvm cluster host {host.name}: added by `thinvm cluster up --systemd`.\n"
        f"[Socket]\nListenStream=\nListenStream={host.address}:{port}\n"
    )


def _write_systemd_host(h: Host) -> None:
    """What a systemd host differs in from the cached root: its identity
    (host name, machine id), the listener socket unit enabled as an
    operator would (`systemctl enable libvirtd-tls.socket`), services
    allowed to start from maintainer scripts (the cached root forbids it,
    as Debian's container images do), and no getty on a console it lacks."""
    r = h.rootfs
    (r / "etc/hostname").write_text(h.hostname + "\n")
    (r / "etc/machine-id").write_text(uuid.UUID(h.host_uuid).hex + "\n")
    (r / "usr/sbin/policy-rc.d").unlink(missing_ok=True)
    units = r / "etc/systemd/system"
    unit, _ = LISTEN_SOCKETS[h.tls]
    (units / f"{unit}.d").mkdir(parents=True, exist_ok=True)
    (units / f"{unit}.d/listen-address.conf").write_text(listen_dropin(h))
    wants = units / "sockets.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / unit).symlink_to(f"/lib/systemd/system/{unit}")
    (units / "console-getty.service").symlink_to("/dev/null")
    hostcgroups.create(h.netns, hostcgroups.hierarchies())


def _start_daemon(h: Host) -> int:
    if h.packaged:
        shared = shared_dir(Path(h.root).parent.parent)
        # Guest images, at the same path in every host's root.
        images = str(guest_image.IMAGES_DIR)
        repo = cache_dir() / "apt-repo"
        script = packaged_host_script(h, shared, images, repo, hostcgroups.hierarchies())
    else:
        patched = emulator.emulator_path("patched").parent
        stock = emulator.emulator_path("stock").parent
        script = host_script(h, patched, stock)
    # A systemd host has PID and IPC namespaces of its own: systemd wants
    # to be PID 1.  unshare forks it and stays its parent.  It enters the
    # network namespace with nsenter: `ip netns exec` mounts a fresh /sys,
    # which would hide the machine's cgroup hierarchies from the script.
    if h.systemd:
        netns = ["nsenter", f"--net=/run/netns/{h.netns}"]
        own = ["--ipc", "--pid", "--fork", "--kill-child"]
    else:
        netns, own = ["ip", "netns", "exec", h.netns], []
    log = (Path(h.root) / "daemon.log").open("ab")
    with log:
        proc = subprocess.Popen(
            [*netns, "unshare", "--mount", "--uts", *own, "--", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    return _init_of(h, proc.pid) if h.systemd else proc.pid


def _init_of(h: Host, unshare: int, timeout: float = 10.0) -> int:
    """The PID 1 (as the machine numbers it) that unshare --fork started."""
    children = Path(f"/proc/{unshare}/task/{unshare}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(unshare):
        with contextlib.suppress(OSError):
            found = children.read_text().split()
            if found:
                return int(found[0])
        time.sleep(0.05)
    log = (Path(h.root) / "daemon.log").read_text(errors="replace").strip().splitlines()
    raise ThinvmError(f"systemd of {h.name} did not start: {' | '.join(log[-3:]) or 'no output'}")


def _wait_ready(h: Host, pid: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise ThinvmError(f"libvirtd of {h.name} exited: {_daemon_errors(h)}")
        if h.socket.exists():
            with contextlib.suppress(ThinvmError):
                virsh(h, "version", timeout=10)
                return
        time.sleep(0.2)
    raise ThinvmError(f"libvirtd of {h.name} did not answer within {START_TIMEOUT:.0f} s")


def _daemon_errors(h: Host) -> str:
    """The last error lines of a host's daemon, for a one-line message."""
    lines: list[str] = []
    for log in (Path(h.root) / "daemon.log", Path(h.root) / "log" / "libvirtd.log"):
        with contextlib.suppress(OSError):
            lines += [ln for ln in log.read_text(errors="replace").splitlines() if "error" in ln]
    return " | ".join(lines[-2:]) or "no error logged"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours is not alive.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    return True


def host_run(
    state: ClusterState, name: str, argv: Sequence[str], timeout: float = 600.0
) -> subprocess.CompletedProcess[str]:
    """Run ARGV on a packaged host as its root would: in its network, mount
    and UTS namespaces, in its root (nsenter into its libvirtd),
    with a clean environment.  apt installs from the local repository."""
    h = state.host(name)
    if not h.packaged:
        raise ThinvmError(f"{name} is not a packaged host (`thinvm cluster up --packaged`)")
    pid = state.pids.get(name, 0)
    if not (pid and _alive(pid) and _is_host_daemon(h, pid)):
        raise ThinvmError(f"{_daemon_name(h)} of {name} is not running")
    env = {"PATH": HOST_PATH, "HOME": "/root", "LANG": "C.UTF-8",
           "DEBIAN_FRONTEND": "noninteractive"}  # fmt: skip
    # On a systemd host, its PID and IPC namespaces too: systemctl and
    # maintainer scripts see its processes.
    own = ["-p", "-i"] if h.systemd else []
    cmd = ["nsenter", "-t", str(pid), "-n", "-m", "-u", *own, "-r", "-w", "--", *argv]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise ThinvmError(f"{name}: {' '.join(argv)} timed out after {timeout:.0f} s") from exc


def host_apt(state: ClusterState, name: str, *args: str) -> str:
    """apt-get -y ARGS on a packaged host; its output, or an error with it."""
    argv = ["apt-get", "-q", "-y", "-o", "Dpkg::Use-Pty=0", *args]
    proc = host_run(state, name, argv)
    if proc.returncode != 0:
        raise ThinvmError(f"{name}: apt-get {' '.join(args)} failed: {proc.stdout[-2000:]}"
                          f"{proc.stderr[-2000:]}")  # fmt: skip
    return proc.stdout


def refresh_repo(state: ClusterState, name: str) -> None:
    """apt-get update of the local repository's list only: Debian's lists
    came with the cached root and match its packages (no network)."""
    host_apt(state, name, "update", "-o", f"Dir::Etc::SourceList={APT_LIST}",
             "-o", "Dir::Etc::SourceParts=-", "-o", "APT::Get::List-Cleanup=0")  # fmt: skip


def host_flavour(h: Host) -> str:
    """Which QEMU a host offers thinvm guests: for a packaged host, whether
    thinvm-qemu is installed in its root now."""
    if not h.packaged:
        return h.flavour
    binary = h.rootfs / str(emulator.PACKAGED_THINVM).lstrip("/")
    return "patched" if binary.is_file() else "stock"


def kill_daemon(name: str, root: Path | None = None) -> int:
    """SIGKILL a host's libvirtd, as if the daemon crashed; its QEMUs go on
    running.  Returns the pid killed."""
    root = root or cluster_dir()
    state = load_state(root)
    h = state.host(name)
    _refuse_on_systemd(h)
    pid = state.pids.get(name, 0)
    if not (pid and _alive(pid) and _is_host_daemon(h, pid)):
        raise ThinvmError(f"libvirtd of {name} is not running")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def _refuse_on_systemd(h: Host) -> None:
    """Fault injection works on the daemon the cluster started itself; on a
    systemd host, systemd owns libvirtd and restarts it when it fails."""
    if h.systemd:
        raise ThinvmError(
            f"{h.name} runs systemd, which restarts a killed libvirtd: use "
            f"'thinvm cluster exec {h.name} -- systemctl kill --signal=KILL libvirtd' "
            "or 'systemctl stop libvirtd.service libvirtd*.socket' there"
        )


def restart_daemon(name: str, root: Path | None = None) -> int:
    """Start a host's libvirtd again after it died; libvirt then reconnects
    to (or cleans up after) the QEMUs it left.  Returns the new pid."""
    root = root or cluster_dir()
    state = load_state(root)
    h = state.host(name)
    _refuse_on_systemd(h)
    old = state.pids.get(name, 0)
    if old and _alive(old) and _is_host_daemon(h, old):
        raise ThinvmError(f"libvirtd of {name} is running (pid {old})")
    state.pids[name] = _start_daemon(h)
    _save_state(root, state)
    _wait_ready(h, state.pids[name])
    return state.pids[name]


def up(
    count: int,
    link: str | None = None,
    stock: Sequence[str] = (),
    root: Path | None = None,
    tls: bool = True,
    packaged: bool = False,
    systemd: bool = False,
) -> ClusterState:
    """Create the cluster: namespaces, bridge, one libvirtd per host; TLS
    between hosts unless `tls` is False.  `packaged`: hosts are Debian
    installs (module docstring); those not in `stock` install thinvm-qemu
    with apt once their libvirtd is up.  `systemd`: packaged hosts boot
    systemd, which starts their daemons."""
    root = root or cluster_dir()
    if os.geteuid() != 0:
        raise ThinvmError("thinvm cluster needs root (namespaces, libvirtd)")
    if systemd and not packaged:
        raise ThinvmError("--systemd boots packaged hosts: add --packaged")
    if systemd and not CGROUP_V1_SYSTEMD.is_dir():
        raise ThinvmError(
            f"--systemd needs the cgroup v1 name=systemd hierarchy at {CGROUP_V1_SYSTEMD} "
            "(systemd 254 in the hosts runs there, in legacy mode)"
        )
    if state_path(root).exists() or our_namespaces(root):
        raise ThinvmError("a cluster is already up: run 'thinvm cluster down' first")
    if systemd:
        hostcgroups.mount_missing()
    lower = None
    if packaged:
        lower = host_root_lower()
        apt_repo()
    else:
        for flavour in ("patched", "stock"):
            if not emulator.emulator_path(flavour).is_file():
                raise ThinvmError(
                    f"emulator {emulator.emulator_path(flavour)} missing: "
                    "run 'thinvm fleet install'"
                )
    hosts = plan_hosts(count, root, stock, tls, packaged, systemd)
    shared_dir(root).mkdir(parents=True, exist_ok=True)
    state = ClusterState(hosts=hosts, link=link, pids={})
    _save_state(root, state)  # before anything exists: down can clean a partial up
    progress = ProgressLine("cluster: ")
    try:
        progress.update(f"network: {count} hosts, bridge, link {link or 'unlimited'}")
        _make_fabric(hosts, link, fabric_ns(root))
        ca = None
        if tls:
            progress.update("certificates: cluster CA")
            ca = pki.make_ca(root)
        for h in hosts:
            what = "Debian's libvirt" if packaged else f"{h.flavour} QEMU"
            progress.update(f"starting libvirtd on {h.name} ({h.address}, {what})")
            if lower is not None:
                _write_packaged_host(h, ca, lower)
            else:
                _write_host_tree(h, ca)
            state.pids[h.name] = _start_daemon(h)
            _save_state(root, state)
        # Each libvirtd probes the QEMU binaries at its first connection
        # (about 8 s under TCG here): all hosts at once, not one by one.
        progress.update(f"waiting for {count} libvirtd to probe their QEMU")
        with ThreadPoolExecutor(len(hosts)) as pool:
            for done in [pool.submit(_wait_ready, h, state.pids[h.name]) for h in hosts]:
                done.result()
        if packaged:
            progress.update("apt: the local repository; thinvm-qemu where not --stock")
            with ThreadPoolExecutor(len(hosts)) as pool:
                for done in [pool.submit(_prepare_packaged, state, h) for h in hosts]:
                    done.result()
    except BaseException:
        progress.done("failed; cleaning up")
        down(root)
        raise
    progress.done(f"up: {', '.join(f'{h.name}={h.address}' for h in hosts)}")
    return state


def _prepare_packaged(state: ClusterState, h: Host) -> None:
    refresh_repo(state, h.name)
    if h.flavour != "stock":
        host_apt(state, h.name, "install", "--no-install-recommends", "thinvm-qemu")


def _mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root` in this mount namespace, deepest first."""
    points: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == str(root) or point.startswith(f"{root}/"):
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def our_namespaces(root: Path) -> list[str]:
    """The namespaces of the cluster in `root` that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    mine = re.compile(re.escape(ns_prefix(root)) + r"(h\d+|fabric)")
    return [n for n in names if mine.fullmatch(n)]


def netns_pids(ns: str) -> list[int]:
    """Every process in the network namespace `ns` (a host's daemons and
    the QEMUs they started)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _kill_all(ns: str, grace: float = 5.0) -> int:
    """SIGTERM every process in the namespace (all ours: libvirtd, QEMU),
    then SIGKILL what is left after `grace` seconds."""
    pids = netns_pids(ns)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            pids = [p for p in netns_pids(ns) if _alive(p)]
            if not pids:
                return 0
            time.sleep(0.1)
    return len(pids)


def _destroy_domains(h: Host) -> None:
    """Ask libvirtd to stop its guests first: it cleans up after them."""
    with contextlib.suppress(ThinvmError):
        for name in virsh(h, "list", "--name", timeout=10).split():
            with contextlib.suppress(ThinvmError):
                virsh(h, "destroy", name, timeout=20)


def down(root: Path | None = None) -> list[str]:
    """Remove everything `up` made; safe to run twice or after a crash.
    Returns what it removed."""
    root = root or cluster_dir()
    removed: list[str] = []
    state: ClusterState | None = None
    with contextlib.suppress(ThinvmError, ValueError, KeyError, TypeError):
        state = load_state(root)
    if state:
        for h in state.hosts:
            if h.socket.exists():
                _destroy_domains(h)
        # By pid, before the namespaces: each systemd host's init (its PID
        # namespace goes with it) and a libvirtd that lost its network
        # namespace (a crash between steps); the sweep below stops the rest.
        namespaces = set(our_namespaces(root))
        for h in state.hosts:
            pid = state.pids.get(h.name, 0)
            stray = h.systemd or h.netns not in namespaces
            if stray and pid and _alive(pid) and _is_host_daemon(h, pid):
                os.kill(pid, signal.SIGKILL)
                removed.append(f"{_daemon_name(h)} of {h.name}")
    for ns in our_namespaces(root):
        left = _kill_all(ns)
        if left:
            raise ThinvmError(f"{left} processes in namespace {ns} survived SIGKILL")
        _run(["ip", "netns", "del", ns], f"ip netns del {ns}")
        removed.append(ns)
    # systemd hosts' cgroups, in every hierarchy (their processes are gone).
    removed += hostcgroups.remove(re.compile(re.escape(ns_prefix(root)) + r"h\d+"))
    # Packaged hosts' root overlays (everything else was mounted in the
    # hosts' own namespaces, gone with their processes).
    for point in _mounts_under(root):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode:
            _run(["umount", "-l", point], f"umount {point}")
        removed.append(f"mount {point}")
    if root.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=True)
        removed.append(str(root))
    return removed


def machine_pid(h: Host, pid: int) -> int:
    """The machine's number of a process a systemd host knows as `pid`
    (its own PID namespace numbers it, e.g. in libvirt's pid files)."""
    for candidate in netns_pids(h.netns):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{candidate}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    ids = line.split()[1:]
                    if len(ids) > 1 and int(ids[-1]) == pid:
                        return candidate
                    break
    raise ThinvmError(f"no process {pid} of {h.name} found on this machine")


def _daemon_name(h: Host) -> str:
    """What the cluster started on a host and keeps the pid of."""
    return "systemd" if h.systemd else "libvirtd"


def _is_host_daemon(h: Host, pid: int) -> bool:
    """Whether `pid` is still what the cluster started on `h` (its libvirtd,
    or a systemd host's init), not a reuse of the number."""
    with contextlib.suppress(OSError):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if h.systemd:
            return cmdline.split(b"\0")[0] == SYSTEMD.encode()
        return b"libvirtd" in cmdline
    return False


@contextlib.contextmanager
def running(
    count: int,
    link: str | None = None,
    stock: Sequence[str] = (),
    root: Path | None = None,
    tls: bool = True,
    packaged: bool = False,
    systemd: bool = False,
) -> Iterator[ClusterState]:
    """A cluster for the length of a with-block (tests, benchmarks)."""
    state = up(count, link, stock, root, tls, packaged, systemd)
    try:
        yield state
    finally:
        down(root)
