"""Package-installed cluster hosts (issue 21, docs/fleet.md "Packaged
hosts"): three hosts, each its own Debian 12 root (packaging/host-root.sh)
running Debian's libvirtd and virtlogd as packaged, all on Debian's own
QEMU 10.0.2 at first.  One at a time each host installs thinvm-qemu with
apt from the local repository while a guest moves off it and back, its
data verified at every step; then one host purges the package and runs
stock again.  A guest from operator-style XML (no qemu: namespace) runs
and migrates on the upgraded hosts as libvirt-qemu.  A second rolling
upgrade goes through the host-wide opt-in (thinvm-qemu-default), with
domains naming Debian's QEMU and plain `virsh migrate`, as Nova runs.

One cluster serves the module (up about 20 s: the three libvirtd probe
Debian's QEMU at once).
"""

import contextlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    PROFILE,
    assert_only_cluster_clients,
    domain_liveness,
    memstat,
    start_domain,
    thinvm_cli,
    wait_for,
)
from tests.integration.stuck_guest import stuck_guest_report
from tests.integration.tls_isolation import assert_qemus_files_open_no_peer
from thinvm.errors import ThinvmError
from thinvm.fleet import cluster, emulator, guest, hostcgroups, migrate
from thinvm.fleet.cluster import ClusterState, Host, virsh
from thinvm.fleet.domain import BALLOON_QOM_PATH, DomainSpec, is_portable
from thinvm.guest import image as guest_image
from thinvm.units import MiB

pytestmark = [
    pytest.mark.guest,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, chroot, libvirtd)"),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap not installed"),
]

MEMORY = 512 * MiB
PATTERN = "/dev/shm/thinvm-packaged-pattern"
PATTERN_MIB = 48
POOL_SLOT = 64 * MiB  # the warm pool's slot on a host (tmpfs: no huge pages here)
THINVM = str(emulator.PACKAGED_THINVM)
STOCK = str(emulator.PACKAGED_STOCK)


@pytest.fixture(scope="module")
def image() -> guest_image.DiskImage:
    return guest_image.ensure_disk_image("6.1")


@pytest.fixture(scope="module")
def packaged(image: guest_image.DiskImage) -> Iterator[ClusterState]:
    """Three packaged hosts, all still on Debian's QEMU."""
    root = Path("/var/lib/thinvm") / f"test-packaged-{os.getpid()}"
    os.environ["THINVM_CLUSTER_DIR"] = str(root)
    try:
        with cluster.running(
            3, stock=["h1", "h2", "h3"], root=root, packaged=True, systemd=True
        ) as state:
            yield state
        assert_nothing_left(root)
    finally:
        os.environ.pop("THINVM_CLUSTER_DIR", None)


def processes_rooted_in(path: Path) -> list[str]:
    """Processes whose root is a host's under `path`.  A host's processes
    see its root as / (pivot_root), so their root mount is what names it:
    the overlay's upperdir, which lies under `path`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and rooted_in(proc, str(path)):
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()!r}")
        except OSError:
            continue
    return found


def rooted_in(proc: Path, path: str) -> bool:
    if os.readlink(proc / "root").startswith(path):
        return True
    for line in (proc / "mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return path in line
    return False


def assert_nothing_left(root: Path) -> None:
    """After `down`: no namespace, no process in a host's root, no mount
    (the overlays included), no directory."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.ns_prefix(root) not in netns, netns
    assert not processes_rooted_in(root), processes_rooted_in(root)
    assert str(root) not in Path("/proc/self/mountinfo").read_text()
    assert not root.exists()
    prefix = cluster.ns_prefix(root)
    cgroups = [
        str(d) for n in hostcgroups.hierarchies() for d in (hostcgroups.CGROUP_ROOT / n).glob("*/*")
        if d.name.startswith(prefix)
    ]  # fmt: skip
    assert not cgroups, cgroups


def in_guest(h: Host, name: str, command: str) -> str:
    return guest.run_in_guest(h, name, command).stdout


def verify(h: Host, name: str, seed: int) -> None:
    command = f"thinvm-mem pattern verify {PATTERN} --seed {seed}"
    try:
        res = guest.run_in_guest(h, name, command).json()
    except ThinvmError as exc:
        # The domain is gone by the time the failure hook looks: say now
        # whether the guest hung or only its agent channel did not answer.
        console = shared(h) / f"{name}.console.log"
        state = f"{domain_liveness(h, name)}\n{stuck_guest_report(h, name, console)}"
        raise ThinvmError(f"{exc}; on {h.name}: {state}") from exc
    assert res["pages"] == PATTERN_MIB * 256 and res["bad"] == 0, res


def shared(h: Host) -> Path:
    """The cluster's shared directory (disks, consoles), as `h` sees it."""
    return cluster.shared_dir(Path(h.root).parent.parent)


def qemu_of(h: Host, name: str) -> tuple[str, str]:
    """The domain's QEMU process: (its binary, seen in the host's root;
    the user it runs as)."""
    pid = guest.qemu_pid(h, name)
    exe = os.readlink(f"/proc/{pid}/exe")
    status = Path(f"/proc/{pid}/status").read_text()
    (uids,) = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
    assert len(set(uids)) == 1, uids
    return exe.removeprefix(str(h.rootfs)), pwd.getpwuid(int(uids[0])).pw_name


def boot_id(h: Host, name: str) -> str:
    return in_guest(h, name, "cat /proc/sys/kernel/random/boot_id").strip()


def start(
    state: ClusterState,
    image: guest_image.DiskImage,
    name: str,
    host: str,
    binary: Path | None = None,
) -> Host:
    """A portable guest in operator-style XML: no qemu: namespace at all
    (no page ranges, no hinting override, no sparse-ram argument), on
    `binary` or the emulator the host's libvirt offers."""
    h = state.host(host)
    binary = binary or emulator.packaged_emulator(h.uri)
    spec = guest.spec_for(
        guest.GuestSpec(name, memory=MEMORY, portable=True, hint=False),
        image,
        shared(h),
        binary,
    )
    spec = PROFILE.domain(spec)  # booted as the suite boots guests
    xml = guest.define(h, spec, image)
    assert "qemu:" not in xml and "libvirt.org/schemas/domain/qemu" not in xml, xml
    start_domain(h, name, image)
    return h


def remove(state: ClusterState, name: str) -> None:
    for h in state.hosts:
        if guest.domstate(h, name) == "running":
            virsh(h, "destroy", name)
        if guest.domstate(h, name) != "absent":
            virsh(h, "undefine", name)


def install_thinvm_qemu(state: ClusterState, name: str) -> None:
    cluster.host_apt(state, name, "install", "--no-install-recommends", "thinvm-qemu")
    h = state.host(name)
    # libvirt on that host takes it as an emulator.
    caps = emulator.domcapabilities(emulator.PACKAGED_THINVM, h.uri)
    assert f"<path>{THINVM}</path>" in caps, caps[:1000]
    assert cluster.host_flavour(h) == "patched"


def systemctl(state: ClusterState, host: str, *args: str, check: bool = False) -> str:
    """systemctl ARGS on `host`, its output; `check`: a failure raises with
    systemctl's message, instead of surfacing later as a missing directory."""
    proc = cluster.host_run(state, host, ["systemctl", "--no-pager", *args])
    if check and proc.returncode:
        raise AssertionError(f"systemctl {' '.join(args)}: {proc.stderr}{proc.stdout}")
    return proc.stdout.strip()


def assert_booted(state: ClusterState, host: str, timeout: float = 120.0) -> None:
    """systemd on `host` finished starting its units, none failed."""
    deadline = time.monotonic() + timeout
    running = systemctl(state, host, "is-system-running")
    while running in ("initializing", "starting") and time.monotonic() < deadline:
        time.sleep(0.5)
        running = systemctl(state, host, "is-system-running")
    assert running == "running", (running, systemctl(state, host, "--failed"))


def test_packaged_hosts_run_debians_libvirt_and_qemu(packaged: ClusterState) -> None:
    lower = cluster.host_root_lower()
    for h in packaged.hosts:
        init = packaged.pids[h.name]
        # systemd boots the host, its own root its root (pivot_root: its
        # root mount is the host's overlay), in the host's own cgroup.
        assert rooted_in(Path(f"/proc/{init}"), f"upperdir={h.root}/upper")
        assert os.path.samefile(f"/proc/{init}/exe", h.rootfs / "usr/lib/systemd/systemd")
        assert f":name=systemd:/thinvm/{h.netns}" in Path(f"/proc/{init}/cgroup").read_text()
        assert_booted(packaged, h.name)
        # Debian's libvirtd, started by its socket units as packaged; the
        # TLS listener is the one enabled, on the host's address only.
        version = virsh(h, "version")
        assert int(systemctl(packaged, h.name, "show", "-P", "MainPID", "libvirtd.service")) > 0
        triggers = systemctl(packaged, h.name, "show", "-P", "TriggeredBy", "libvirtd.service")
        assert "libvirtd-tls.socket" in triggers.split(), triggers
        listening = cluster.host_run(packaged, h.name, ["ss", "-Hltn"]).stdout
        assert f"{h.address}:16514" in listening and ":16509" not in listening, listening
        assert systemctl(packaged, h.name, "is-active", "virtlogd.service") == "active"
        assert "libvirt 11.3.0" in version and "QEMU 10.0.2" in version, version
        assert virsh(h, "hostname").strip() == h.hostname
        # Debian's QEMU is the host's default emulator; thinvm-qemu is absent.
        caps = virsh(h, "domcapabilities", "--virttype", "qemu")
        assert f"<path>{STOCK}</path>" in caps, caps[:1000]
        assert emulator.packaged_emulator(h.uri) == emulator.PACKAGED_STOCK
        assert cluster.host_flavour(h) == "stock"
        # The read-write socket as Debian makes it: open to all, polkit
        # deciding (root only, by default); another user is refused.
        assert stat.S_IMODE(h.socket.stat().st_mode) == 0o666
        other = ["runuser", "-u", "nobody", "--", "virsh", "-c", "qemu:///system", "list"]
        refused = cluster.host_run(packaged, h.name, other)
        assert refused.returncode != 0 and "auth" in refused.stderr, refused
        # Debian's configuration, with our settings appended only.
        for conf in ("libvirtd.conf", "qemu.conf"):
            ours = (h.rootfs / "etc/libvirt" / conf).read_text()
            assert ours.startswith((lower / "etc/libvirt" / conf).read_text()), conf
        listed = cluster.host_run(packaged, h.name, ["dpkg-query", "-W", "thinvm-qemu"])
        assert listed.returncode != 0, listed.stdout


def test_packaged_hosts_accept_only_clients_of_the_cluster_ca(
    packaged: ClusterState, tmp_path: Path
) -> None:
    """The TLS listeners the socket units open: a client with a
    certificate of the cluster CA gets in, one of another CA is refused,
    and nothing listens on plain TCP."""
    assert_only_cluster_clients(packaged, packaged.host("h1").rootfs / "etc/pki", tmp_path)


def test_packaged_hosts_qemus_certificates_open_no_other_host(
    packaged: ClusterState, tmp_path: Path
) -> None:
    """Issue 46 item 9 on Debian's libvirt, QEMU as the root's own
    libvirt-qemu (tests/integration/tls_isolation.py)."""
    assert_qemus_files_open_no_peer(packaged, tmp_path)


def purge_thinvm_qemu(packaged: ClusterState, h: Host) -> None:
    """apt purge thinvm-qemu on a host: none of its files, units or
    processes is left, and the host offers Debian's QEMU again."""
    files = cluster.host_run(packaged, h.name, ["dpkg-query", "-L", "thinvm-qemu"]).stdout
    ours = [f for f in files.split() if "thinvm" in f]
    assert ours and all((h.rootfs / f.lstrip("/")).exists() for f in ours)
    cluster.host_apt(packaged, h.name, "purge", "thinvm-qemu")
    assert not [f for f in ours if (h.rootfs / f.lstrip("/")).exists()]
    left = subprocess.run(
        ["find", str(h.rootfs), "-xdev",
         "(", "-path", f"{h.rootfs}/proc", "-o", "-path", f"{h.rootfs}/var/lib/apt/lists",
         "-o", "-path", f"{h.rootfs}{cluster.APT_REPO_DIR}",
         "-o", "-path", f"{h.rootfs}/var/lib/thinvm", ")", "-prune",
         "-o", "-name", "*thinvm*", "-print"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert left == [f"{h.rootfs}{cluster.APT_LIST}"], left
    # No unit of ours in the root (find above), no process of ours on the host.
    for pid in cluster.netns_pids(h.netns):
        with contextlib.suppress(FileNotFoundError):
            exe = os.readlink(f"/proc/{pid}/exe").removeprefix(str(h.rootfs))
            assert "thinvm" not in exe, f"process {pid} runs {exe}"
    assert cluster.host_flavour(h) == "stock"


def test_rolling_upgrade_of_three_hosts_then_purge(
    packaged: ClusterState, image: guest_image.DiskImage
) -> None:
    """Upgrade one host at a time (guests off, apt install thinvm-qemu,
    guests back), the guest verified and running all along; thinvm-qemu
    sources skip what the guest never touched.  Then h3 purges the package
    and takes the guest on Debian's QEMU again."""
    name = "rolling"
    h1, h2, h3 = (packaged.host(n) for n in ("h1", "h2", "h3"))
    start(packaged, image, name, "h1")
    try:
        assert qemu_of(h1, name) == (STOCK, cluster.QEMU_USER)
        # fleet migrate tells a portable guest by its migratable XML.
        assert is_portable(virsh(h1, "dumpxml", "--migratable", name))
        in_guest(h1, name, f"thinvm-mem pattern write {PATTERN} {PATTERN_MIB} --seed 31")
        booted = boot_id(h1, name)

        # h1: the guest leaves (stock -> stock), h1 installs, the guest returns.
        off = migrate.migrate(h1, h2, name, parallel=2)
        assert off.emulator is None and qemu_of(h2, name)[0] == STOCK
        verify(h2, name, 31)
        # As an operator would, through thinvm's CLI.
        out = thinvm_cli(
            "cluster", "exec", "h1", "--", "apt-get", "install", "-y", "-q",
            "--no-install-recommends", "thinvm-qemu",
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        caps = emulator.domcapabilities(emulator.PACKAGED_THINVM, h1.uri)
        assert f"<path>{THINVM}</path>" in caps, caps[:1000]
        back = migrate.migrate(h2, h1, name, parallel=2)
        assert back.emulator == THINVM, back.summary()
        assert qemu_of(h1, name) == (THINVM, cluster.QEMU_USER)
        verify(h1, name, 31)
        assert back.ram.get("sparse-skipped") is None, back.ram  # a stock source sends all

        # h2 and h3 have no guest: install, then the guest comes over from
        # an upgraded host, which leaves out what the guest never touched.
        for frm, to in ((h1, h2), (h2, h3)):
            install_thinvm_qemu(packaged, to.name)
            moved = migrate.migrate(frm, to, name, parallel=2)
            assert moved.emulator is None, moved.summary()  # thinvm-qemu on both ends
            assert qemu_of(to, name) == (THINVM, cluster.QEMU_USER)
            verify(to, name, 31)
            assert moved.ram.get("sparse-skipped", 0) * 4096 > MEMORY // 4, moved.ram
            # The persistent definition names the destination's QEMU too.
            inactive = virsh(to, "dumpxml", "--inactive", name)
            assert f"<emulator>{THINVM}</emulator>" in inactive
        assert boot_id(h3, name) == booted  # the same boot all along

        # h3 is taken out of thinvm: guests off, purge, and it runs stock again.
        migrate.migrate(h3, h1, name, parallel=2)
        verify(h1, name, 31)
        purge_thinvm_qemu(packaged, h3)
        assert emulator.packaged_emulator(h3.uri) == emulator.PACKAGED_STOCK
        # thinvm host -> the stock host: Debian's QEMU takes the guest, and
        # the upgraded source still skips.
        down = migrate.migrate(h1, h3, name, parallel=2)
        assert down.emulator == STOCK, down.summary()
        assert qemu_of(h3, name) == (STOCK, cluster.QEMU_USER)
        verify(h3, name, 31)
        assert down.ram.get("sparse-skipped", 0) * 4096 > MEMORY // 4, down.ram
        assert boot_id(h3, name) == booted
    finally:
        remove(packaged, name)


def test_operator_xml_guest_on_upgraded_hosts(
    packaged: ClusterState, image: guest_image.DiskImage
) -> None:
    """A Debian guest defined from plain domain XML on a host that
    installed thinvm-qemu with apt, written as Nova writes it: libvirt's
    own elements only, a pty console, no freePageReporting attribute, the
    machine type pc-q35-10.0-thinvm (Nova's hw_machine_type).  The machine type alone
    gives it free page reporting and page ranges (setmem by ranges); QEMU
    runs as libvirt-qemu; moved by a plain `virsh migrate` (main channel
    alone) to another upgraded host, its data verified and the untouched
    memory skipped."""
    name = "operator"
    h1, h2 = packaged.host("h1"), packaged.host("h2")
    for h in (h1, h2):
        if cluster.host_flavour(h) != "patched":  # run alone, without the test above
            install_thinvm_qemu(packaged, h.name)
    spec = DomainSpec(
        name=name,
        emulator=emulator.PACKAGED_THINVM,
        kernel=PROFILE.kernel(image.vmlinuz),
        initrd=image.initrd,
        disk=shared(h1) / f"{name}.qcow2",
        # A pty console, as Nova's domains have (console_log None).
        console_log=None,
        cmdline=image.cmdline,
        memory=MEMORY,
        ranges=True,
        free_page_reporting=None,
        sparse_ram=None,
        free_page_hint=False,
    )
    xml = guest.define(h1, spec, image)
    assert "qemu:" not in xml and "freePageReporting" not in xml, xml
    assert 'machine="pc-q35-10.0-thinvm"' in xml, xml
    try:
        start_domain(h1, name, image)
        assert qemu_of(h1, name) == (THINVM, cluster.QEMU_USER)
        assert virsh(h1, "ttyconsole", name).strip().startswith("/dev/pts/")
        guest_cgroups_hold(h1, name)
        # libvirt passed no reporting property: the machine type's default.
        cmdline = Path(f"/proc/{guest.qemu_pid(h1, name)}/cmdline").read_bytes()
        assert b"free-page-reporting" not in cmdline and b"x-ranges" not in cmdline, cmdline
        balloon = {
            prop: migrate.qmp(h1, name, "qom-get", path=BALLOON_QOM_PATH, property=prop)
            for prop in ("free-page-reporting", "x-ranges")
        }
        assert balloon == {"free-page-reporting": True, "x-ranges": True}, balloon
        in_guest(h1, name, f"thinvm-mem pattern write {PATTERN} {PATTERN_MIB} --seed 41")
        # setmem, as Nova's and an operator's tooling drive the balloon:
        # our driver (thinvm-balloon-dkms in the image) uses ranges.
        virsh(h1, "setmem", name, str(384 * MiB // 1024), "--live")
        wait_for(lambda: memstat(h1, name)["actual"] == 384 * 1024, "the balloon at 384 MiB")
        counters = migrate.balloon_counters(h1, name)
        assert counters["range-requests"] >= 1 and counters["range-discards"] >= 1, counters
        assert counters["guest-errors"] == 0, counters
        # Plain `virsh migrate --live --p2p --tls`, as Nova issues it: no
        # --parallel, no capability, the main channel alone.  The machine
        # type has the source leave untouched memory out there too (0023).
        moved = migrate.migrate(h1, h2, name)
        verify(h2, name, 41)
        assert qemu_of(h2, name) == (THINVM, cluster.QEMU_USER)
        caps = moved.capabilities
        assert not caps.get("multifd") and not caps.get("sparse-ram"), caps
        assert moved.ram.get("sparse-skipped", 0) * 4096 > MEMORY // 4, moved.ram
        # The machine type moved with the guest, and with it the ranges.
        assert memstat(h2, name)["actual"] == 384 * 1024
        virsh(h2, "setmem", name, str(MEMORY // 1024), "--live")
        wait_for(lambda: memstat(h2, name)["actual"] == MEMORY // 1024, "the balloon at 512 MiB")
        assert migrate.balloon_counters(h2, name)["range-requests"] >= 1
        verify(h2, name, 41)
        services_as_packaged(packaged, "h2", name)
        verify(h2, name, 41)
    finally:
        remove(packaged, name)


OPT_IN = "thinvm-qemu-default"


def diversions(state: ClusterState, host: str) -> str:
    argv = ["dpkg-divert", "--list", str(emulator.PACKAGED_STOCK)]
    return cluster.host_run(state, host, argv).stdout.strip()


def test_host_wide_opt_in_runs_thinvm_qemu_at_debians_path(
    packaged: ClusterState, image: guest_image.DiskImage
) -> None:
    """For tooling that writes Debian's emulator path into every domain
    (Nova): installed, thinvm-qemu-default diverts Debian's
    /usr/bin/qemu-system-x86_64 and a domain naming that path runs
    thinvm-qemu; purged, the same domain runs Debian's QEMU again and no
    diversion is left."""
    name = "optin"
    h = packaged.host("h3")
    had_thinvm = cluster.host_flavour(h) == "patched"
    debian_path = h.rootfs / str(emulator.PACKAGED_STOCK).lstrip("/")
    diverted = debian_path.with_name(debian_path.name + ".debian")
    try:
        cluster.host_apt(packaged, "h3", "install", "--no-install-recommends", OPT_IN)
        assert os.readlink(debian_path) == "../lib/thinvm-qemu/bin/qemu-system-x86_64"
        assert diverted.is_file() and not diverted.is_symlink()
        assert f"by {OPT_IN}" in diversions(packaged, "h3")
        start(packaged, image, name, "h3", binary=emulator.PACKAGED_STOCK)
        assert f"<emulator>{STOCK}</emulator>" in virsh(h, "dumpxml", name)
        assert qemu_of(h, name) == (THINVM, cluster.QEMU_USER)
        in_guest(h, name, f"thinvm-mem pattern write {PATTERN} {PATTERN_MIB} --seed 51")
        verify(h, name, 51)
        remove(packaged, name)

        packages = [OPT_IN] if had_thinvm else [OPT_IN, "thinvm-qemu"]
        cluster.host_apt(packaged, "h3", "purge", *packages)
        assert debian_path.is_file() and not debian_path.is_symlink()
        assert not diverted.exists() and diversions(packaged, "h3") == ""
        owner = cluster.host_run(packaged, "h3", ["dpkg-query", "-S", str(emulator.PACKAGED_STOCK)])
        assert owner.stdout.startswith("qemu-system-x86:"), owner.stdout
        start(packaged, image, name, "h3", binary=emulator.PACKAGED_STOCK)
        assert qemu_of(h, name) == (STOCK, cluster.QEMU_USER)
    finally:
        remove(packaged, name)
        with contextlib.suppress(ThinvmError):
            cluster.host_apt(packaged, "h3", "purge", OPT_IN)


def plain_virsh_migrate(src: Host, dst: Host, name: str) -> dict[str, str]:
    """`virsh migrate` as Nova issues it (no XML of ours, no <emulator>
    switch, no capability): live, peer-to-peer, multifd; the destination's
    statistics of the job."""
    tls = ["--tls"] if dst.tls else []
    virsh(src, "migrate", "--live", "--p2p", "--persistent", "--undefinesource", *tls,
          "--parallel", "--parallel-connections", "2", name, dst.peer_uri)  # fmt: skip
    return migrate.parse_jobinfo(virsh(dst, "domjobinfo", name, "--completed"))


def zero_pages(job: dict[str, str]) -> int:
    """Pages the source found zero and sent as such ("Constant pages")."""
    return int(job.get("Constant pages", "0"))


def test_rolling_upgrade_through_the_host_wide_opt_in(
    packaged: ClusterState, image: guest_image.DiskImage
) -> None:
    """Issue 47, item 4: a cluster whose tooling writes Debian's emulator
    path into every domain and migrates with plain virsh upgrades one host
    at a time with `apt install thinvm-qemu-default`.  The guest's XML
    names /usr/bin/qemu-system-x86_64 all along; on an upgraded host that
    path runs thinvm-qemu, which leaves out what the guest never touched
    (it sends those pages, zero, from a stock host); taken out again with
    `apt purge`, the host runs Debian's QEMU.  Same boot, data verified at
    every step."""
    name = "optin-rolling"
    h1, h2, h3 = (packaged.host(n) for n in ("h1", "h2", "h3"))
    for h in (h1, h2, h3):  # every host on Debian's QEMU, whatever ran before
        with contextlib.suppress(ThinvmError):
            cluster.host_apt(packaged, h.name, "purge", OPT_IN, "thinvm-qemu")
        assert cluster.host_flavour(h) == "stock"
    start(packaged, image, name, "h1", binary=emulator.PACKAGED_STOCK)
    try:
        in_guest(h1, name, f"thinvm-mem pattern write {PATTERN} {PATTERN_MIB} --seed 61")
        booted = boot_id(h1, name)
        untouched = MEMORY // 4 // 4096
        stock_leg = plain_virsh_migrate(h1, h2, name)  # stock -> stock
        assert qemu_of(h2, name) == (STOCK, cluster.QEMU_USER)
        assert zero_pages(stock_leg) > untouched, stock_leg
        verify(h2, name, 61)

        for upgraded, frm, to in ((h1, h2, h1), (h2, h1, h2), (h3, h2, h3)):
            cluster.host_apt(packaged, upgraded.name, "install", "--no-install-recommends", OPT_IN)
            skips = cluster.host_flavour(frm) == "patched"
            job = plain_virsh_migrate(frm, to, name)
            assert f"<emulator>{STOCK}</emulator>" in virsh(to, "dumpxml", name)
            assert qemu_of(to, name) == (THINVM, cluster.QEMU_USER)
            verify(to, name, 61)
            if skips:
                assert zero_pages(job) < untouched, job

        # h1 is taken out of thinvm: purged while it runs no guest, it takes
        # the guest on Debian's QEMU from an upgraded host.
        cluster.host_apt(packaged, "h1", "purge", OPT_IN, "thinvm-qemu")
        assert diversions(packaged, "h1") == "" and cluster.host_flavour(h1) == "stock"
        plain_virsh_migrate(h3, h1, name)
        assert qemu_of(h1, name) == (STOCK, cluster.QEMU_USER)
        verify(h1, name, 61)
        assert boot_id(h1, name) == booted
    finally:
        remove(packaged, name)


def guest_cgroups_hold(h: Host, name: str) -> None:
    """libvirt put the guest's QEMU in cgroups of its own below the host's
    machine.slice, in every hierarchy (none in the machine's or another
    host's), and <memtune> and <cputune> set there take effect."""
    pid = guest.qemu_pid(h, name)
    below = f"/thinvm/{h.netns}/machine.slice/machine-qemu"
    paths = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        assert path.startswith(below), line
        paths[controllers] = path
    assert {"memory", "cpu", "cpuacct", "blkio", "pids", "devices"} <= set(paths), paths
    # Live, as `virsh memtune` and `virsh schedinfo` are used on a running
    # guest; they move with it.  A soft limit: libvirt makes a hard limit
    # QEMU's RLIMIT_MEMLOCK too, at the start of a QEMU (the destination's
    # in a migration), and this machine does not let root raise that limit
    # (no CAP_SYS_RESOURCE), docs/fleet.md.
    virsh(h, "memtune", name, "--soft-limit", str(2 * MEMORY // 1024), "--live")
    virsh(h, "schedinfo", name, "--live", "--set", "cpu_shares=512")
    memory = Path("/sys/fs/cgroup/memory" + paths["memory"])
    assert int((memory / "memory.soft_limit_in_bytes").read_text()) == 2 * MEMORY
    assert int((memory / "memory.usage_in_bytes").read_text()) > MEMORY // 8
    # Shares weigh the guest's scope against its siblings; QEMU's threads
    # sit in cgroups below it (libvirt/emulator, libvirt/vcpuN).
    cpu = Path("/sys/fs/cgroup/cpu" + paths["cpu"])
    (scope,) = [d for d in (cpu, *cpu.parents) if d.name.startswith("machine-qemu")]
    assert int((scope / "cpu.shares").read_text()) == 512
    assert "cpu_shares     : 512" in virsh(h, "schedinfo", name)


def pool_filled(state: ClusterState, host: str) -> str:
    """Wait until thinvm-pool.service filled its slot; where its files are."""
    command = ["thinvm", "pool", "status", "--root", "/var/lib/thinvm/pool", "--json"]
    status: dict[str, Any] = {}

    def filled() -> bool:
        nonlocal status
        out = cluster.host_run(state, host, ["env", "THINVM_CACHE=/var/lib/thinvm", *command])
        status = json.loads(out.stdout) if out.returncode == 0 else {}
        return [(s["state"], s["held"]) for s in status.get("slots", [])] == [("free", POOL_SLOT)]

    try:
        wait_for(filled, "thinvm-pool.service filling its slot", timeout=120)
    except AssertionError:
        journal = ["journalctl", "--no-pager", "-n", "30", "-u", "thinvm-pool.service"]
        raise AssertionError(f"{status}\n{cluster.host_run(state, host, journal).stdout}") from None
    assert systemctl(state, host, "is-active", "thinvm-pool.service") == "active"
    cgroup = systemctl(state, host, "show", "-P", "ControlGroup", "thinvm-pool.service")
    assert cgroup == "/system.slice/thinvm-pool.service", cgroup
    return str(status["directory"])


def services_as_packaged(state: ClusterState, host: str, name: str) -> None:
    """The controller and the warm pool as an operator runs them: `apt
    install thinvm`, the pool's slot size set in its config file,
    `systemctl enable --now thinvm-balance thinvm-pool` (the controller
    with the packaged configuration: the system libvirtd's domains, whose
    guest reclaimer it reaches through the agent channel), then
    `apt purge`, which stops both, gives the pool's memory back and leaves
    the guest images the host mounts."""
    images = guest_image.IMAGES_DIR
    before = sorted(p.name for p in images.iterdir())
    cluster.host_apt(state, host, "install", "--no-install-recommends", "thinvm")
    h = state.host(host)
    # The warm pool as an operator sizes it, in its packaged config file.
    pool_conf = h.rootfs / "etc/thinvm/pool.conf"
    pool_conf.write_text(pool_conf.read_text() + f'THINVM_POOL_ARGS="--slot {POOL_SLOT // MiB}M"\n')
    units = ("thinvm-balance.service", "thinvm-pool.service")
    systemctl(state, host, "enable", "--now", *units, check=True)
    # The services keep their state to root, and leave /var/lib/thinvm
    # traversable: libvirt-qemu reads guest images below it.
    state_dir = h.rootfs / "var/lib/thinvm"
    assert stat.S_IMODE(state_dir.stat().st_mode) & 0o005 == 0o005, oct(state_dir.stat().st_mode)
    assert stat.S_IMODE((state_dir / "balance").stat().st_mode) == 0o700
    status = ["env", "THINVM_CACHE=/var/lib/thinvm", "thinvm", "balance", "status", "--json"]

    data: dict[str, Any] = {}

    def managing() -> bool:
        # Through the domain's agent channel (libvirt's socket path, as the
        # service sees it), the controller switched the guest's reclaimer
        # to background mode (trim first: the machine type reports).
        nonlocal data
        out = cluster.host_run(state, host, status)
        data = json.loads(out.stdout) if out.returncode == 0 else {}
        vm = data.get("vms", {}).get(name, {})
        reclaimer = vm.get("reclaimer") or {}
        return int(data.get("cycle", 0)) >= 2 and reclaimer.get("background") is True

    try:
        wait_for(managing, f"thinvm-balance.service driving {name}'s reclaimer", timeout=120)
    except AssertionError:
        raise AssertionError(json.dumps(data, indent=1)[-3000:]) from None
    assert systemctl(state, host, "is-active", "thinvm-balance.service") == "active"
    cgroup = systemctl(state, host, "show", "-P", "ControlGroup", "thinvm-balance.service")
    assert cgroup == "/system.slice/thinvm-balance.service", cgroup
    slots = pool_filled(state, host)
    cluster.host_apt(state, host, "purge", "thinvm")
    for service in ("thinvm-balance.service", "thinvm-pool.service"):
        assert systemctl(state, host, "is-active", service) != "active", service
    for pid in cluster.netns_pids(h.netns):
        with contextlib.suppress(FileNotFoundError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            assert b"thinvm balance" not in args, f"process {pid}: {args!r}"
            assert b"thinvm pool" not in args, f"process {pid}: {args!r}"
    # The pool's ExecStop gave the slot's memory back.
    held = cluster.host_run(state, host, ["find", slots, "-type", "f", "-size", "+0"])
    assert held.stdout.strip() == "", held.stdout
    assert not (h.rootfs / "etc/thinvm").exists()
    assert not (h.rootfs / "var/lib/thinvm/balance").exists()
    assert sorted(p.name for p in images.iterdir()) == before


# -- the pure parts (no cluster) ---------------------------------------------


def test_packaged_configuration_adds_only_listener_tls_uuid_migration_storage(
    tmp_path: Path,
) -> None:
    (h,) = cluster.plan_hosts(1, tmp_path, packaged=True)
    keys = {
        line.split("=")[0].strip()
        for conf in (cluster.packaged_libvirtd_conf(h), cluster.packaged_qemu_conf(h, tmp_path))
        for line in conf.splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert keys == {
        "listen_tls", "listen_tcp", "auth_tls", "tls_allowed_dn_list", "listen_addr",
        "auth_unix_rw",
        "unix_sock_rw_perms", "host_uuid",
        "log_outputs", "migration_address", "migration_host", "migrate_tls_force",
        "shared_filesystems", "remember_owner",
    }, keys  # fmt: skip
    # The daemon's own files, sockets and channels are found in its root.
    assert h.socket == h.rootfs / "run/libvirt/libvirt-sock"
    assert (
        h.outside("/var/lib/libvirt/qemu/channel/x") == h.rootfs / "var/lib/libvirt/qemu/channel/x"
    )
    assert h.outside("/var/lib/thinvm/images/a") == Path("/var/lib/thinvm/images/a")
    script = cluster.packaged_host_script(
        h, tmp_path / "shared", "/var/lib/thinvm/images", tmp_path
    )
    assert f"cd {h.rootfs}\npivot_root . run/thinvm-old-root\n" in script
    assert script.rstrip().endswith("exec /usr/sbin/libvirtd --listen")


def test_a_systemd_host_boots_systemd_in_its_own_cgroup(tmp_path: Path) -> None:
    (h,) = cluster.plan_hosts(1, tmp_path, packaged=True, systemd=True)
    hierarchies = ["systemd", "memory", "cpuset", "net_cls,net_prio", "unified"]
    script = cluster.packaged_host_script(
        h, tmp_path / "shared", "/var/lib/thinvm/images", tmp_path, hierarchies
    )
    lines = script.splitlines()
    assert lines[-2:] == ["export container=thinvm", "exec unshare --cgroup /lib/systemd/systemd"]
    # No udev acting on the machine's devices: /sys is read-only.
    assert f"mount -t sysfs -o ro sysfs {h.rootfs}/sys" in lines
    cgroup = hostcgroups.host_cgroups(h.netns, ["systemd"])["systemd"]
    assert cgroup == cluster.CGROUP_V1_SYSTEMD / "thinvm" / h.netns
    # The shell joins the host's cgroup in every hierarchy before it execs
    # systemd, which sees each as that hierarchy's root.
    for name in hierarchies:
        own = Path("/sys/fs/cgroup") / name / "thinvm" / h.netns
        joined = lines.index(f"echo 0 > {own}/cgroup.procs")
        assert joined < lines.index("exec unshare --cgroup /lib/systemd/systemd")
        assert f"mount --bind {own} {h.rootfs}/sys/fs/cgroup/{name}" in lines
    # libvirtd is not started by hand.
    assert "libvirtd" not in script
    dropin = cluster.listen_dropin(h)
    assert dropin.endswith(f"[Socket]\nListenStream=\nListenStream={h.address}:16514\n")
    (plain,) = cluster.plan_hosts(1, tmp_path, packaged=True, systemd=True, tls=False)
    assert cluster.listen_dropin(plain).endswith(f"ListenStream={plain.address}:16509\n")


def test_systemd_needs_packaged_hosts(tmp_path: Path) -> None:
    with pytest.raises(ThinvmError, match="add --packaged"):
        cluster.up(1, root=tmp_path / "c", systemd=True)
    assert not (tmp_path / "c").exists()


def test_the_destination_xml_changes_only_the_emulator() -> None:
    xml = "<domain><devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>"
    new = migrate.with_emulator(xml, THINVM)
    assert new == xml.replace(STOCK, THINVM)
    assert migrate.emulator_of(new) == THINVM
    assert (
        cluster.group_id("root:x:0:\nlibvirt-qemu:x:64055:libvirt-qemu\n", "libvirt-qemu") == 64055
    )
