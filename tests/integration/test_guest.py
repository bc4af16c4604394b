"""A real Debian guest under QEMU (TCG): agent, balloon, statistics, reporting."""

import time

import pytest

from tests.conftest import BOOTED, VMFactory
from thinvm.guest import workload
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import balloon
from thinvm.vm.machine import BalloonOptions, VMConfig

pytestmark = pytest.mark.guest


def test_boot_and_agent_round_trip(make_vm: VMFactory) -> None:
    vm = make_vm(VMConfig(name="boot", memory=1 * GiB), profile=BOOTED)  # not a kept boot
    assert vm.accel == "tcg"  # /dev/kvm here is far slower than TCG
    # Without ERMS/FSRM the guest's kernel copies and zeroes memory by
    # words: TCG runs byte-wise "rep movsb/stosb" one byte at a time.
    flags = vm.agent.check("grep -m1 '^flags' /proc/cpuinfo").stdout.split()
    assert "erms" not in flags and "fsrm" not in flags, flags
    result = vm.agent.run("echo hello; echo oops >&2; exit 7")
    assert (result.status, result.stdout, result.stderr) == (7, "hello\n", "oops\n")
    big = vm.agent.check("head -c 300000 /dev/zero | tr '\\0' x").stdout
    assert big == "x" * 300000
    assert "virtio_balloon" in vm.agent.check("cat /proc/modules").stdout


def test_a_kept_boot_is_the_guest_a_boot_gives(make_vm: VMFactory) -> None:
    """A guest loaded from a kept boot (thinvm.testing.keptboot) is the guest a boot
    gives: the same kernel, command line, modules and memory, its clock
    set from the host's, our balloon driver answering, and the host
    holding no more for it."""
    config = VMConfig(
        name="kept", memory=1 * GiB, build="patched", guest_driver="thinvm",
        balloon=BalloonOptions(free_page_reporting=True, ranges=True),
    )  # fmt: skip
    booted = make_vm(config, profile=BOOTED)
    kept = make_vm(config)
    assert not (booted.rundir / "serial-boot.log").exists()
    assert (kept.rundir / "serial-boot.log").is_file()  # loaded, not booted
    assert kept.qmp("query-migrate").get("status") == "completed"  # the load
    probe = "uname -r; cat /proc/cmdline; cut -d' ' -f1 /proc/modules; grep Tot /proc/meminfo"
    assert kept.agent.check(probe).stdout == booted.agent.check(probe).stdout
    assert abs(int(kept.agent.check("date +%s").stdout) - time.time()) < 30
    assert kept.host_memory().rss <= booted.host_memory().rss + 16 * MiB
    balloon.set_target(kept, 768 * MiB)
    balloon.wait_actual(kept, 768 * MiB)


def test_inflate_returns_memory_to_host_and_deflate_restores(make_vm: VMFactory) -> None:
    memory = 1 * GiB
    vm = make_vm(VMConfig(name="inflate", memory=memory))
    # Back every free guest page on the host first, so whatever pages the
    # balloon takes really are resident and must be given back.
    workload.touch_free_memory(vm.agent)
    rss_before = vm.host_memory().rss
    inflate = 384 * MiB
    balloon.set_target(vm, memory - inflate)
    balloon.wait_actual(vm, memory - inflate)
    assert balloon.query(vm).actual == memory - inflate
    dropped = rss_before - vm.host_memory().rss
    assert dropped >= 0.9 * inflate, f"RSS dropped by only {format_size(dropped)}"
    guest_total = workload.meminfo(vm.agent)["MemTotal"]

    balloon.set_target(vm, memory)
    balloon.wait_actual(vm, memory)
    assert balloon.query(vm).actual == memory
    # The stock driver adjusts MemTotal as it inflates and deflates.
    assert workload.meminfo(vm.agent)["MemTotal"] >= guest_total + inflate - 4 * MiB


def test_statistics_arrive_and_match_the_guest(make_vm: VMFactory) -> None:
    vm = make_vm(VMConfig(name="stats", memory=1 * GiB))
    balloon.enable_stats(vm, 1)
    stats = balloon.wait_stats(vm)["stats"]
    meminfo = workload.meminfo(vm.agent)
    assert stats["stat-total-memory"] == meminfo["MemTotal"]
    # Free memory moves a little between the two reads; a few MiB at most.
    assert abs(stats["stat-free-memory"] - meminfo["MemFree"]) < 32 * MiB
    assert stats["stat-available-memory"] > 0


def test_free_page_reporting_lowers_host_rss(make_vm: VMFactory) -> None:
    config = VMConfig(
        name="report", memory=1 * GiB, balloon=BalloonOptions(free_page_reporting=True)
    )
    vm = make_vm(config)
    touched = 512 * MiB
    # Hold the memory, measure, then free it: reporting must hand it back.
    pid = vm.agent.check(f"thinvm-mem hold {touched // MiB}").json()["pid"]
    held = vm.host_memory().rss
    vm.agent.check(f"kill {pid}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if held - vm.host_memory().rss >= 0.75 * touched:
            break
        time.sleep(0.5)
    dropped = held - vm.host_memory().rss
    assert dropped >= 0.75 * touched, f"RSS dropped by only {format_size(dropped)}"


def test_without_reporting_freed_memory_stays_on_host(make_vm: VMFactory) -> None:
    """The control for the reporting test: the drop is reporting's doing."""
    vm = make_vm(VMConfig(name="noreport", memory=1 * GiB))
    pid = vm.agent.check(f"thinvm-mem hold {512 * MiB // MiB}").json()["pid"]
    held = vm.host_memory().rss
    vm.agent.check(f"kill {pid}")
    time.sleep(5)
    assert held - vm.host_memory().rss < 64 * MiB
