"""thinvm's Debian packages on a fresh Debian 12 (docs/install.md).

packaging/build-debs.sh builds the packages and the local apt repository;
packaging/debian-root.sh a bookworm root filesystem with nothing but the
essential packages and apt (cached). In a copy of that root, apt installs
thinvm-qemu, thinvm and thinvm-guest-agent from the repository, with
Debian's own packages (firmware, libraries, python3) from the mirror;
thinvm-qemu starts, boots a q35 machine into its firmware and a Linux
guest by direct kernel boot, thinvm runs on Debian's python3 and the
agent answers its protocol. `apt purge` then leaves no file of ours.

Cold (no packages, root filesystem or downloads cached) the module took
65 s and 2.5 min in two runs: about a minute of mmdebstrap, 20 s of
package building, up to 30 s of downloads (kept for the next run); warm
10-50 s.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import PROFILE
from thinvm.paths import REPO, cache_dir

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mmdebstrap, chroot, mount)"),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap not installed"),
]

# Where the repository is copied inside the root, and the line that names it.
REPO_DIR = "/srv/thinvm-apt"
SOURCE = f"deb [trusted=yes] file:{REPO_DIR} ./\n"
PACKAGES = ("thinvm-qemu", "thinvm", "thinvm-guest-agent")
QEMU = "thinvm-qemu-system-x86_64"


@dataclass
class DebianRoot:
    path: Path

    def run(
        self, *argv: str, timeout: float = 600, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ARGV in the root, with a clean environment."""
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "DEBIAN_FRONTEND": "noninteractive",
        }
        proc = subprocess.run(
            ["chroot", str(self.path), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def apt(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("apt-get", "-q", "-y", "-o", "Dpkg::Use-Pty=0", *args)


def script(name: str) -> str:
    """Run one of packaging/'s scripts; its last line on stdout."""
    proc = subprocess.run(
        [str(REPO / "packaging" / name)], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, f"packaging/{name} failed:\n{proc.stderr}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def apt_repo() -> Path:
    return Path(script("build-debs.sh")).parent


@pytest.fixture(scope="module")
def debian_root(apt_repo: Path) -> Iterator[DebianRoot]:
    """A fresh copy of the cached root with the repository in its sources;
    /proc mounted while it is in use, everything removed afterwards."""
    tarball = Path(script("debian-root.sh"))
    archives = tarball.parent / "archives"
    path = cache_dir() / "debian-root" / f"run-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    mounted: list[Path] = []
    try:
        subprocess.run(["tar", "-xpf", str(tarball), "-C", str(path)], check=True)
        repo = path / REPO_DIR.lstrip("/")
        repo.mkdir(parents=True)
        for f in apt_repo.iterdir():
            if f.is_file() and not f.name.startswith("."):
                shutil.copy2(f, repo / f.name)
        (path / "etc/apt/sources.list.d/thinvm.list").write_text(SOURCE)
        # Debian's packages come from the cache when it has them, and
        # from the mirror (name resolution as on this machine) when not.
        for deb in archives.glob("*.deb"):
            shutil.copy2(deb, path / "var/cache/apt/archives" / deb.name)
        shutil.copy2("/etc/resolv.conf", path / "etc/resolv.conf")
        subprocess.run(["mount", "-t", "proc", "proc", str(path / "proc")], check=True)
        mounted.append(path / "proc")
        # The warm pool's tmpfs slots live in /dev/shm.
        shm = path / "dev/shm"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(shm)], check=True)
        mounted.append(shm)
        yield DebianRoot(path)
    finally:
        for deb in (path / "var/cache/apt/archives").glob("*.deb"):
            if not (archives / deb.name).exists():
                shutil.copy2(deb, archives / deb.name)
        for mount in reversed(mounted):
            subprocess.run(["umount", str(mount)], check=False)
            if os.path.ismount(mount):
                subprocess.run(["umount", "-l", str(mount)], check=False)
        if not any(os.path.ismount(m) for m in mounted):
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(debian_root: DebianRoot) -> DebianRoot:
    """`apt install` of our packages from the local repository."""
    root = debian_root
    # Only our repository's list is refreshed: Debian's came with the
    # cached root and match the cached packages.
    root.apt(
        "update",
        "-o",
        "Dir::Etc::SourceList=/etc/apt/sources.list.d/thinvm.list",
        "-o",
        "Dir::Etc::SourceParts=-",
        "-o",
        "APT::Get::List-Cleanup=0",
    )
    start = time.monotonic()
    root.apt("install", "--no-install-recommends", *PACKAGES)
    print(f"apt install took {time.monotonic() - start:.1f} s")
    return root


def test_the_packages_come_from_the_local_repository(installed: DebianRoot) -> None:
    for pkg in PACKAGES:
        status = installed.run("dpkg-query", "-W", "-f=${Status} ${Version}", pkg).stdout
        assert status.startswith("install ok installed"), f"{pkg}: {status}"
        policy = installed.run("apt-cache", "policy", pkg).stdout
        assert f"file:{REPO_DIR} ./ Packages" in policy, policy
    # Beside Debian's QEMU, not instead of it.
    assert not (installed.path / "usr/bin/qemu-system-x86_64").exists()
    debian_python = installed.run("python3", "--version").stdout
    assert debian_python.startswith("Python 3.11."), debian_python


def test_qemu_runs_from_its_own_prefix(installed: DebianRoot) -> None:
    version = installed.run(QEMU, "-version").stdout
    assert "QEMU emulator version 10.0" in version and "thinvm-patched" in version, version
    # Relocated: the data directory follows the binary; firmware is Debian's.
    dirs = installed.run(QEMU, "-L", "help").stdout.split()
    assert "/usr/share/seabios" in dirs and "/usr/lib/ipxe/qemu" in dirs, dirs
    assert any(d.startswith("/usr/lib/thinvm-qemu/") for d in dirs), dirs
    meta = json.loads((installed.path / "usr/lib/thinvm-qemu/build.json").read_text())
    assert meta["binary"] == "/usr/lib/thinvm-qemu/bin/qemu-system-x86_64"
    assert (installed.path / "usr/share/man/man1/thinvm-qemu-system-x86_64.1.gz").is_file()


def qmp_session(*commands: str) -> str:
    lines = ['{"execute": "qmp_capabilities"}']
    lines += [json.dumps({"execute": c}) for c in commands]
    return "\n".join([*lines, '{"execute": "quit"}']) + "\n"


def test_qemu_answers_qmp_with_the_sparse_ram_capability(installed: DebianRoot) -> None:
    out = installed.run(
        QEMU,
        "-machine",
        "none",
        "-nodefaults",
        "-display",
        "none",
        "-qmp",
        "stdio",
        input=qmp_session("query-version", "query-migrate-capabilities"),
        timeout=60,
    ).stdout
    replies = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    version = next(r["return"] for r in replies if "qemu" in r.get("return", {}))
    assert version["qemu"]["major"] == 10, version
    caps = next(r["return"] for r in replies if isinstance(r.get("return"), list))
    assert "sparse-ram" in {c["capability"] for c in caps}, caps


def boot_until(root: DebianRoot, argv: list[str], output: str, marker: str) -> str:
    """Run QEMU in the root until the file it writes (`output`, a path in
    the root) holds `marker`, or 120 s; kill it; return what it wrote."""
    path = root.path / output.lstrip("/")
    path.unlink(missing_ok=True)
    qemu = subprocess.Popen(
        ["chroot", str(root.path), QEMU, "-accel", "tcg", "-display", "none", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline and qemu.poll() is None:
            text = path.read_text(errors="replace") if path.exists() else ""
            if marker in text:
                break
            time.sleep(0.5)
        assert qemu.poll() is None, f"QEMU exited {qemu.returncode}: {qemu.communicate()[0]}"
        return text
    finally:
        qemu.kill()
        qemu.wait(timeout=30)
        if qemu.stdout is not None:
            qemu.stdout.close()
        path.unlink(missing_ok=True)


def test_qemu_boots_a_q35_machine_into_its_firmware(installed: DebianRoot) -> None:
    """SeaBIOS (seabios), its VGA BIOS and q35's default NIC's iPXE ROM
    (ipxe-qemu) load from Debian's packages; SeaBIOS's debug port says
    how far it got. No disks: bookworm's SeaBIOS waits ~30 s for an empty
    CD-ROM."""
    argv = ["-M", "q35", "-m", "128", "-no-reboot", "-nodefaults"]
    argv += ["-device", "VGA", "-device", "e1000e"]
    argv += ["-chardev", "file,id=dbg,path=/tmp/seabios.log"]
    argv += ["-device", "isa-debugcon,iobase=0x402,chardev=dbg"]
    text = boot_until(installed, argv, "/tmp/seabios.log", "Booting from ROM")
    assert "SeaBIOS" in text, text[-2000:]
    # The NIC's option ROM is the one boot entry left.
    assert "Booting from ROM" in text, text[-2000:]


def test_qemu_boots_a_linux_guest_directly(installed: DebianRoot) -> None:
    """Direct kernel boot (thinvm's way) with bookworm's qemu-system-data,
    whose linuxboot_dma.bin is older than this QEMU: the test guest's
    kernel and initramfs, when the set-up built them."""
    images = sorted((cache_dir() / "image").glob("6.1.*-stock"))
    if not images:
        pytest.skip("no test guest image (guest/image/build.sh) in the cache")
    for name in ("vmlinuz", "initramfs.cpio.gz"):
        shutil.copy2(images[-1] / name, installed.path / "tmp" / name)
    argv = ["-M", "q35", "-m", "256", "-nodefaults", "-no-reboot"]
    argv += ["-serial", "file:/tmp/console.log"]
    argv += ["-kernel", "/tmp/vmlinuz", "-initrd", "/tmp/initramfs.cpio.gz"]
    # The suite's guest arguments (tests/conftest.py): a shorter boot.
    argv += ["-append", f"console=ttyS0 panic=-1 {PROFILE.append}"]
    try:
        text = boot_until(installed, argv, "/tmp/console.log", "thinvm: modules loaded")
    finally:
        for name in ("vmlinuz", "initramfs.cpio.gz"):
            (installed.path / "tmp" / name).unlink(missing_ok=True)
    assert "thinvm: modules loaded" in text, text[-3000:]


LIBVIRT_PROBE = """
set -e
for d in /run/libvirt /var/lib/libvirt /var/cache/libvirt /var/log/libvirt; do
    mkdir -p $d && mount -t tmpfs tmpfs $d
done
libvirtd -f "$1/libvirtd.conf" -p /run/libvirt/libvirtd.pid --timeout 60 &
daemon=$!
trap 'kill $daemon; wait $daemon || true' EXIT
for i in $(seq 1 60); do [ -S /run/libvirt/libvirt-sock ] && break; sleep 0.5; done
virsh -c qemu:///system domcapabilities --emulatorbin "$2" --virttype qemu --machine q35
virsh -c qemu:///system domcapabilities --emulatorbin "$2" --virttype qemu \
    --machine pc-q35-10.0-thinvm
"""


@pytest.mark.skipif(
    not all(shutil.which(c) for c in ("libvirtd", "virsh", "unshare")), reason="no libvirt"
)
def test_libvirt_takes_the_packaged_qemu_as_an_emulator(apt_repo: Path) -> None:
    """This machine's libvirt (a private libvirtd in its own mount
    namespace, state on tmpfs) probes the binary of the .deb as
    `<emulator>`: `virsh domcapabilities --emulatorbin`, with q35 and
    with thinvm's machine type."""
    deb = next(apt_repo.glob("thinvm-qemu_*.deb"))
    # Somewhere libvirt-qemu, which libvirt probes as, can reach.
    with tempfile.TemporaryDirectory(prefix="thinvm-probe-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work)], check=True)
        (work / "libvirtd.conf").write_text(
            f'listen_tls = 0\nlisten_tcp = 0\nauth_unix_rw = "none"\n'
            f'log_outputs = "3:file:{work}/libvirtd.log"\n'
        )
        binary = work / "usr/lib/thinvm-qemu/bin/qemu-system-x86_64"
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", LIBVIRT_PROBE]
        proc = subprocess.run(
            [*argv, "probe", str(work), str(binary)],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 0, f"{proc.stderr}\n{proc.stdout[-2000:]}"
    assert f"<path>{binary}</path>" in proc.stdout, proc.stdout[:2000]
    assert "<machine>pc-q35-10.0</machine>" in proc.stdout, proc.stdout[:2000]
    # The machine type with page ranges on (QEMU 0019), as Nova would name it.
    assert "<machine>pc-q35-10.0-thinvm</machine>" in proc.stdout, proc.stdout[-2000:]


def test_thinvm_runs_on_debians_python(installed: DebianRoot) -> None:
    help_text = installed.run("thinvm", "--help").stdout
    assert "balance" in help_text and "pool" in help_text, help_text
    installed.run("thinvm", "balance", "run", "--help")
    # The patched build is the package's; there is no stock build here.
    out = installed.run("thinvm", "version", "--json").stdout.splitlines()
    patched = json.loads(out[1])
    assert patched["binary"] == "/usr/lib/thinvm-qemu/bin/qemu-system-x86_64", patched
    assert "thinvm-patched" in patched["version"], patched


def test_the_services_commands_run_from_the_packages(installed: DebianRoot) -> None:
    """What thinvm-pool.service and thinvm-balance.service run, with their
    state directory, without the source repository (no systemd here)."""
    service = ("env", "THINVM_CACHE=/var/lib/thinvm", "thinvm")
    pool = ("--root", "/var/lib/thinvm/pool")
    filled = installed.run(
        *service, "pool", "fill", *pool, "--slot", "16M", "--kind", "tmpfs", "--no-cgroup"
    ).stdout
    assert "all slots filled" in filled, filled
    assert "slots removed" in installed.run(*service, "pool", "stop", *pool).stdout
    installed.run(*service, "balance", "run", "--dry-run", "--cycles", "2", "--interval", "1")
    status = installed.run(*service, "balance", "status").stdout
    assert "dry run" in status, status
    assert (installed.path / "var/lib/thinvm/balance/state.json").is_file()


def processes_in(root: Path) -> list[str]:
    """Processes whose root directory is `root`: pid and command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "root")) == root:
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()!r}")
        except OSError:
            continue
    return found


def test_the_packaged_agent_speaks_its_protocol(installed: DebianRoot) -> None:
    """guest/agent/check-agent.py against /usr/sbin/thinvm-agent, on
    Debian's python3: the package's build (dynamic, hardened) works."""
    shutil.copy2(REPO / "guest/agent/check-agent.py", installed.path / "tmp/check-agent.py")
    out = installed.run("python3", "/tmp/check-agent.py", "/usr/sbin/thinvm-agent", timeout=120)
    assert "check-agent: ok" in out.stdout + out.stderr, out
    (installed.path / "tmp/check-agent.py").unlink()
    # Its "background" check leaves a `sleep 3` behind on purpose.
    deadline = time.monotonic() + 15
    while processes_in(installed.path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_in(installed.path), processes_in(installed.path)


def test_units_and_configuration_are_in_place(installed: DebianRoot) -> None:
    root = installed.path
    for unit in ("thinvm-balance.service", "thinvm-pool.service", "thinvm-agent.service"):
        assert (root / "lib/systemd/system" / unit).is_file(), unit
    for conf in ("etc/thinvm/balance.conf", "etc/thinvm/pool.conf", "etc/default/thinvm-agent"):
        assert (root / conf).is_file(), conf
    wants = root / "etc/systemd/system/multi-user.target.wants"
    # The guest agent is enabled on installation; the host's services wait
    # for the operator.
    assert (wants / "thinvm-agent.service").is_symlink()
    assert not (wants / "thinvm-balance.service").exists()
    assert not (wants / "thinvm-pool.service").exists()


def test_purge_leaves_no_file_of_ours(installed: DebianRoot) -> None:
    root = installed.path
    # The services' state (the test above left it) and a unit the
    # operator enabled (`systemctl enable thinvm-balance` makes this
    # link): purge removes them too.
    (root / "var/lib/thinvm/balance").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/thinvm/balance/state.json").touch()
    # Guest images an operator installed next to it are not the package's.
    (root / "var/lib/thinvm/images").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/thinvm/images/guest.qcow2").write_bytes(b"not ours to remove")
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "thinvm-balance.service").symlink_to("/lib/systemd/system/thinvm-balance.service")
    installed.apt("purge", *PACKAGES)
    left = installed.run(
        "find",
        "/",
        "-xdev",
        "(",
        "-path",
        "/proc",
        "-o",
        "-path",
        REPO_DIR,
        "-o",
        "-path",
        "/var/lib/apt/lists",
        "-o",
        "-path",
        "/root",
        ")",
        "-prune",
        "-o",
        "-name",
        "*thinvm*",
        "-print",
    ).stdout.split()
    assert sorted(left) == [
        "/etc/apt/sources.list.d/thinvm.list", "/var/lib/thinvm"], left  # fmt: skip
    assert os.listdir(root / "var/lib/thinvm") == ["images"]
    assert (root / "var/lib/thinvm/images/guest.qcow2").read_bytes() == b"not ours to remove"
    shutil.rmtree(root / "var/lib/thinvm")
    # Nor a process: nothing runs with this root any more.
    assert not processes_in(root), f"processes left in the root: {processes_in(root)}"
    # Debian's packages stay: the host runs stock again once it installs
    # Debian's QEMU.
    assert (root / "usr/share/seabios/bios-256k.bin").is_file()
