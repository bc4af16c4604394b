"""Fixtures for tests that boot real guests under QEMU."""

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.ci_skip_gate import pytest_configure  # noqa: F401 - the CI skip gate
from thinvm.errors import ThinvmError
from thinvm.fleet import pki
from thinvm.fleet.cluster import ClusterState, Host, cluster_dir, load_state, shared_dir, virsh
from thinvm.guest.image import DiskImage
from thinvm.paths import cache_dir
from thinvm.testing import keptboot, profile
from thinvm.testing.keptboot import KeptBootVM
from thinvm.testing.profile import GuestProfile
from thinvm.vm.machine import VM, VMConfig

# Guests skip zeroing each page they allocate (measured on a 1 GiB 6.1
# guest under TCG: boot 7.6 -> 5.5 s, touching 512 MiB 5.8 -> 3.8 s).
# Tests that are about the allocator set their own init_on_* arguments;
# the benchmarks keep Debian's default.  They also skip the crypto API's
# self-tests at boot, a quarter of what is left: 6.7-6.8 -> 4.1-5.2 s of
# QEMU CPU to the agent of a 1 GiB 6.1 guest booted by PVH (2026-11-27);
# no test is about the guest kernel's ciphers.  Four initcalls that remain
# are self-tests or facilities no test uses (initcall_debug under TCG):
# the SP800-108 KDF's known-answer test (0.17-0.33 s), the jitter entropy
# source's health test (6.12: 0.29 s), kprobe events (6.1: 0.18 s) and
# encrypted keys (0.03-0.10 s).  Skipping them: 3.4 -> 3.0 s (6.1) and
# 4.9 -> 3.7 s (6.12) of QEMU CPU to the agent, medians of 3 interleaved
# boots (2026-11-27).
GUEST_TEST_INITCALLS_SKIPPED = (
    "crypto_kdf108_init",
    "jent_mod_init",
    "init_kprobe_trace",
    "init_encrypted",
)
# How the suite's guests boot (thinvm.testing.profile), in-process
# (the fixtures' KeptBootVM) and in the thinvm commands tests run
# (THINVM_TEST_PROFILE, which `thinvm up` reads through
# thinvm.vm.registry.vm_class).
# - PVH (thinvm.guest.pvh): under TCG that halves a 6.1 guest's boot
#   (11.6 -> 5.9 s of CPU to its init), which the suite pays for some
#   hundred times.  A profile without it tests the bzImage boot users and
#   the benchmarks get.
# - The kernel arguments above, and SysRq on, so that a failing test can
#   have a guest that stopped answering dump its tasks on its console
#   (tests/integration/stuck_guest.py).
# - Kept boots: guests whose whole state is their RAM and devices boot
#   once per configuration; later guests of the same configuration load
#   that boot's state (0.1-0.6 s of QEMU CPU to the agent, against 3-7 s
#   for a boot under TCG).  Kept across runs, keyed by the QEMU, kernel
#   and initrd files and the command line; tests about booting use a
#   profile without them.  The Debian guests under libvirt are kept too,
#   by `virsh save` (start_domain below: ~1-3 s against ~33 s for a boot).
SUITE_PROFILE = GuestProfile(
    pvh=True,
    append="init_on_alloc=0 cryptomgr.notests sysrq_always_enabled initcall_blacklist="
    + ",".join(GUEST_TEST_INITCALLS_SKIPPED),
    kept_boots=cache_dir() / "booted",
)
os.environ.setdefault(profile.ENV, SUITE_PROFILE.to_env())
# What the tests run under: the suite's, or one set outside.
PROFILE = profile.current() or GuestProfile()
# The same guests, booted: for tests about a boot itself.
BOOTED = replace(PROFILE, kept_boots=None)

# Seconds each module's tests took in a `make test` (2026-11-27, 20:03, a
# run with kept boots of busybox and libvirt guests), heaviest first.
# `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder,
# which hands out whole modules in collection order; xdist's own order
# (most tests first) left the heavy modules with few tests for last, and
# one worker ran on ~95 s after the others had finished.  Modules not
# listed (quick unit tests) go last.
MODULE_SECONDS = {
    "tests/integration/test_sparse_migration.py": 174,
    "tests/integration/test_fleet.py": 173,
    "tests/integration/test_balance.py": 164,
    "tests/integration/test_pool.py": 131,
    "tests/integration/test_trim.py": 126,
    "tests/integration/test_bench.py": 115,
    "tests/integration/test_packaged_cluster.py": 105,
    "tests/integration/test_readme.py": 85,
    "tests/integration/test_guest_driver.py": 75,
    "tests/integration/test_resize.py": 74,
    "tests/unit/test_qtests_sparse_discard_files.py": 61,
    "tests/integration/test_packages.py": 59,
    "tests/unit/test_qtests_precopy.py": 35,
    "tests/integration/test_downtime.py": 80,
    "tests/integration/test_sudden_growth.py": 55,  # alone, 2026-11-28
    "tests/integration/test_sparse_postcopy.py": 30,  # alone on a busy host, 2026-11-28
    "tests/integration/test_pool_security.py": 15,
    "tests/unit/test_qtests_postcopy.py": 29,
    "tests/integration/test_guest.py": 25,
    "tests/unit/test_qemu_patches.py": 22,
    "tests/integration/test_cli.py": 21,
    "tests/integration/test_migration.py": 7,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest modules first (MODULE_SECONDS); tests keep their order within one."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.nodeid.split("::")[0], 0))


CONSOLE_TAIL_LINES = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test on a cluster shows its guests' consoles' last lines:
    a guest that stopped answering its agent says there why (an oops, a
    panic, a hang), and the cluster's directory is gone by the end."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and os.environ.get("THINVM_CLUSTER_DIR"):
        for name, tail in guest_console_tails(shared_dir(cluster_dir())):
            report.sections.append((f"console of {name}, last lines", tail))
        report.sections.append(("running domains", running_domains()))


def running_domains() -> str:
    """Each host's running domains, their state and reason, and whether
    their first vCPU moves (its instruction pointer read twice, 2 s apart):
    a guest that stopped answering may be paused, spinning or halted."""
    lines = []
    try:
        state = load_state(cluster_dir())
    except (ThinvmError, OSError, ValueError) as e:
        return f"no cluster state: {e}"
    for h in state.hosts:
        try:
            names = virsh(h, "list", "--name", timeout=20).split()
            for name in names:
                lines.append(f"{h.name} {name}: {domain_liveness(h, name)}")
        except ThinvmError as e:
            lines.append(f"{h.name}: {e}")
    return "\n".join(lines) or "none"


def domain_liveness(h: Host, name: str) -> str:
    """The domain's state and its vCPU's RIP twice, 2 s apart; never raises
    (a failure report calls it, and the domain may be gone)."""
    try:
        state = virsh(h, "domstate", "--reason", name, timeout=20).strip()
        rips = []
        for _ in range(2):
            regs = virsh(h, "qemu-monitor-command", "--hmp", name, "info registers", timeout=20)
            rips.extend(w for w in regs.split() if w.startswith("RIP="))
            time.sleep(2)
    except ThinvmError as exc:
        return f"no state: {exc}"
    return f"{state}; {' then '.join(rips) or 'no RIP'}"


def guest_console_tails(shared: Path) -> list[tuple[str, str]]:
    tails = []
    for log in sorted(shared.glob("*.console.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        name = log.name.removesuffix(".console.log")
        tails.append((name, "\n".join(lines[-CONSOLE_TAIL_LINES:])))
    return tails


def qemu_pids(name: str | None = None) -> set[int]:
    """QEMU processes this test process started, or any thinvm VM called `name`.

    Owned VMs are our children; detached ones (`thinvm up`) are found by
    name.  Other thinvm users on the machine are not counted.
    """
    if name is None:
        cmd = ["pgrep", "-P", str(os.getpid()), "-f", "qemu-system-x86_64"]
    else:
        cmd = ["pgrep", "-f", f"qemu-system-x86_64 -name thinvm-{name} "]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def start_domain(h: Host, name: str, image: DiskImage) -> None:
    """Start a defined Debian domain as the suite does (thinvm.testing.keptboot):
    restored from its kept boot, which libvirt must say it was, so that a
    restore falling back to a boot every time cannot go unnoticed."""
    keptboot.start_domain(h, name, image, PROFILE)
    if PROFILE.kept_boots is not None:
        reason = virsh(h, "domstate", "--reason", name).strip()
        assert reason == "running (restored)", f"{name} on {h.name}: {reason}"


# What a thinvm command must never print: a traceback, or asyncio's
# complaints about a QMP connection that outlived its event loop.
CLI_NOISE = ("Traceback", "Exception ignored", "Task was destroyed", "no running event loop")


def assert_clean_stderr(stderr: str, what: str) -> None:
    for word in CLI_NOISE:
        assert word not in stderr, f"{what} printed {word!r}:\n{stderr}"


def thinvm_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run `thinvm ARGS` as a user would; its stderr must be free of tracebacks."""
    proc = subprocess.run(
        [sys.executable, "-m", "thinvm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert_clean_stderr(proc.stderr, f"thinvm {' '.join(args)}")
    return proc


def thinvm_ok(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """thinvm_cli(); with check, a failure is an assertion error with its stderr."""
    proc = thinvm_cli(*args)
    if check and proc.returncode != 0:
        raise AssertionError(f"thinvm {' '.join(args)} failed: {proc.stderr}")
    return proc


@pytest.fixture(autouse=True)
def no_orphan_qemu() -> Iterator[None]:
    """Every test must leave no QEMU process of its own behind."""
    before = qemu_pids()
    yield
    left = qemu_pids() - before
    for pid in left:
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert not left, f"test left QEMU processes behind: {sorted(left)}"


VMFactory = Callable[..., VM]


@pytest.fixture
def make_vm() -> Iterator[VMFactory]:
    """Start VMs as the suite boots them (PROFILE; `profile`: another),
    shut down at the end of the test, pass or fail."""
    vms: list[VM] = []

    def factory(
        config: VMConfig | None = None,
        *,
        incoming: bool = False,
        profile: GuestProfile = PROFILE,
    ) -> VM:
        vm = KeptBootVM(config or VMConfig(name="test"), incoming=incoming, profile=profile)
        vms.append(vm)
        return vm.start()

    yield factory
    for vm in vms:
        vm.shutdown()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def memstat(h: Host, name: str) -> dict[str, int]:
    """`virsh dommemstat` of a cluster guest (KiB; "actual" is the balloon's target)."""
    out = virsh(h, "dommemstat", name)
    return {k: int(v) for k, v in (line.split() for line in out.splitlines() if line.strip())}


def peer_virsh(frm: Host, to: Host, pkipath: Path | None, transport: str = "tls") -> str:
    """virsh from inside `frm`'s network, as a peer would connect to `to`:
    its error message, or "" if the connection was accepted."""
    uri = f"qemu+{transport}://{to.address}/system"
    if pkipath is not None:
        uri += f"?pkipath={pkipath}"
    proc = subprocess.run(
        ["ip", "netns", "exec", frm.netns, "virsh", "-q", "-c", uri, "hostname"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return "" if proc.returncode == 0 else proc.stderr.strip() or "failed"


def client_pki(d: Path, cacert: Path, cert: Path, key: Path) -> Path:
    """A client's pkipath directory, as virsh expects it."""
    d.mkdir()
    for src, name in ((cacert, "cacert.pem"), (cert, "clientcert.pem"), (key, "clientkey.pem")):
        (d / name).write_bytes(src.read_bytes())
    return d


def assert_only_cluster_clients(state: ClusterState, pki_dir: Path, tmp_path: Path) -> None:
    """Every host lets in a client with a certificate of the cluster CA
    (h1's, from `pki_dir`, its /etc/pki), refuses one whose certificate
    another CA issued, and has no plain TCP listener."""
    h1 = state.host("h1")
    cacert = pki_dir / "CA" / "cacert.pem"
    ours = pki_dir / "libvirt"
    member = client_pki(
        tmp_path / "member", cacert, ours / "clientcert.pem", ours / "private" / "clientkey.pem"
    )
    # Trusts the cluster CA (so it would accept the server), but its own
    # certificate comes from another CA.
    rogue_ca = pki.make_ca(tmp_path / "rogue-ca")
    cert, key = tmp_path / "rogue-cert.pem", tmp_path / "rogue-key.pem"
    pki.issue(rogue_ca, pki.CLIENT_USAGE, h1.address, h1.hostname, cert, key)
    rogue = client_pki(tmp_path / "rogue", cacert, cert, key)
    for to in state.hosts:
        assert peer_virsh(h1, to, member) == "", to.name  # the control: a member gets in
        refused = peer_virsh(h1, to, rogue)
        assert refused and "certificate" in refused.lower(), (to.name, refused)
        assert peer_virsh(h1, to, None, transport="tcp"), to.name  # no plain TCP listener
