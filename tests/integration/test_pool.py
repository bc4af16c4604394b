"""The warm pool with real guests (TCG) and a real daemon.

Every test runs a private pool (pool.temporary_pool): its own state
directory, slot files, cgroup and, for hugetlbfs, its own hugetlbfs mount
and huge pages, all removed afterwards.
"""

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import VMFactory, qemu_pids, thinvm_cli
from tests.unit.test_pool import pattern_pages
from thinvm import pool
from thinvm.guest import workload
from thinvm.host.hugepages import nr_hugepages
from thinvm.host.memory import host_meminfo
from thinvm.paths import run_dir
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import balloon
from thinvm.vm.machine import VM, BalloonOptions, VMConfig

MEMORY = 1 * GiB
# The leak tests write and scan all of a guest's RAM under TCG: half a GiB
# shows a leak as well as a whole one, at half the cost.
LEAK_MEMORY = 512 * MiB
SEED = 4242
HUGE = 2 * MiB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the pool needs root")


@pytest.fixture
def hugepages_restored() -> Iterator[None]:
    """The kernel's huge page pool is as it was after the test.

    Ask for it before make_vm: pages a VM still maps stay (as surplus
    pages) until its QEMU exits, after the pool has gone.
    """
    before = nr_hugepages(HUGE)
    yield
    assert nr_hugepages(HUGE) == before


def _tag(name: str) -> str:
    return f"{name}-{os.getpid()}"


def kcore_scan(vm: VM, seed: int) -> dict[str, int]:
    result: dict[str, int] = vm.agent.check(
        f"thinvm-mem kcore-scan --seed {seed}", timeout=900
    ).json()
    return result


def write_pattern_over_most_of_ram(vm: VM, seed: int) -> int:
    """Fill all but 160 MiB of the guest's available memory; returns pages written."""
    size = (workload.meminfo(vm.agent)["MemAvailable"] - 160 * MiB) // MiB * MiB
    workload.pattern_write(vm.agent, size, seed)
    return size // 4096


# -- no data crosses from one guest to the next ------------------------------


@pytest.mark.guest
@pytest.mark.parametrize("kind", ["tmpfs", "hugetlbfs"])
def test_next_guest_on_a_scrubbed_slot_sees_nothing_of_the_last(
    kind: str, hugepages_restored: None, make_vm: VMFactory
) -> None:
    with pool.temporary_pool(kind, LEAK_MEMORY, tag=_tag(f"leak-{kind}")) as p:
        config = VMConfig(name=f"pool-leak1-{kind}", memory=LEAK_MEMORY, pool=str(p.root))
        vm1 = make_vm(config)
        assert vm1.pool_lease is not None, vm1.pool_note
        slot = vm1.pool_lease
        written = write_pattern_over_most_of_ram(vm1, SEED)
        # The control: the data really is in the slot file the next guest
        # would get (that the scan finds it there is the next test's control).
        assert pattern_pages(slot.path, SEED) >= written

        vm1.shutdown()
        pool.wait_free(p.root, LEAK_MEMORY, timeout=300)
        assert pool.allocated(slot.path) == LEAK_MEMORY
        assert pattern_pages(slot.path, SEED) == 0
        assert pool.is_zero(slot.path)

        vm2 = make_vm(VMConfig(name=f"pool-leak2-{kind}", memory=LEAK_MEMORY, pool=str(p.root)))
        assert vm2.pool_lease is not None and vm2.pool_lease.path == slot.path
        scan2 = kcore_scan(vm2, SEED)
        assert scan2["matches"] == 0, scan2
        assert scan2["unreadable"] == 0
        assert scan2["pages_scanned"] >= 0.95 * LEAK_MEMORY // 4096


@pytest.mark.guest
def test_without_scrubbing_the_next_guest_would_see_the_data(
    make_vm: VMFactory, tmp_path: Path
) -> None:
    """The control for the test above: reuse is what the scan catches.

    Two guests share one tmpfs file with no pool in between.  The second
    guest's boot does not wipe its RAM, so kcore-scan finds the first
    guest's pattern; a zero count on a scrubbed slot therefore means
    something.
    """
    path = Path(pool.TMPFS_DIR) / f"thinvm-noscrub-{os.getpid()}.mem"
    try:
        config = VMConfig(name="pool-noscrub1", memory=LEAK_MEMORY, backend=f"file:{path}")
        vm1 = make_vm(config)
        written = write_pattern_over_most_of_ram(vm1, SEED)
        vm1.shutdown()
        vm2 = make_vm(VMConfig(name="pool-noscrub2", memory=LEAK_MEMORY, backend=f"file:{path}"))
        scan = kcore_scan(vm2, SEED)
        assert scan["matches"] >= written // 2, (scan, written)
    finally:
        path.unlink(missing_ok=True)


# -- budget and pressure -----------------------------------------------------


def _held(root: Path) -> int:
    return pool.status(root).held


def test_pool_keeps_to_its_budget() -> None:
    slot = 256 * MiB
    with pool.temporary_pool(
        "tmpfs", slot, count=3, budget=600 * MiB, tag=_tag("budget"), watermark=0
    ) as p:
        pool.configure(p.root, pool.PoolSpec(interval=0.2))
        state = pool.wait_until(p.root, lambda s: "budget" in s.note, 120, "the budget")
        st = pool.status(p.root)
        assert [s.state for s in st.slots] == ["free", "free", "empty"]
        assert st.held == 2 * slot  # a slot is started only if all of it fits
        assert "budget 600.00 MiB reached" in state.note
        cg = st.cgroup
        assert cg is not None and cg.usage is not None
        assert cg.limit == 600 * MiB + pool.CGROUP_HEADROOM
        assert cg.usage <= cg.limit and cg.failcnt == 0
        assert cg.cpu_seconds is not None and cg.cpu_seconds > 0  # the zeroing is charged here

        pool.configure(p.root, pool.PoolSpec(budget=3 * slot))
        pool.wait_free(p.root, timeout=120)
        assert _held(p.root) == 3 * slot

        pool.configure(p.root, pool.PoolSpec(budget=300 * MiB))
        # The blocks go before the slot's state says so: a slot being
        # punched holds less while it is still 'scrubbing'.  Wait for both.
        settled = ["empty", "empty", "free"]
        pool.wait_until(
            p.root,
            lambda s: sorted(x.state for x in s.slots) == settled,
            60,
            "a shrink to one free slot",
        )
        st = pool.status(p.root)
        assert _held(p.root) <= 300 * MiB
        assert sorted(s.state for s in st.slots) == settled
        assert st.cgroup is not None and st.cgroup.failcnt == 0

        def limit_follows(_state: pool.PoolState) -> bool:
            cg = pool.status(p.root).cgroup
            return cg is not None and cg.limit == 300 * MiB + pool.CGROUP_HEADROOM

        pool.wait_until(p.root, limit_follows, 10, "the cgroup limit to follow the budget")


def _psi_file(path: Path, avg10: float) -> None:
    path.write_text(
        f"some avg10={avg10:.2f} avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )


@pytest.mark.parametrize("kind", ["tmpfs", "hugetlbfs"])
def test_pool_gives_memory_back_under_pressure(
    kind: str, tmp_path: Path, hugepages_restored: None
) -> None:
    slot = 256 * MiB
    psi = tmp_path / "memory"
    _psi_file(psi, 0.0)
    baseline = nr_hugepages(HUGE)
    with pool.temporary_pool(kind, slot, count=2, tag=_tag(f"pressure-{kind}")) as p:
        pool.configure(p.root, pool.PoolSpec(psi_path=str(psi), interval=0.2, cooldown=1.0))
        assert _held(p.root) == 2 * slot
        daemon = pool.status(p.root).daemon_pid
        assert daemon is not None
        sched = Path(f"/proc/{daemon}/stat").read_text().rsplit(")", 1)[1].split()
        assert (int(sched[16]), int(sched[38])) == (19, os.SCHED_IDLE)  # nice, policy

        # Simulated PSI: some task stalled 42% of the last 10 s.
        shmem = host_meminfo()["Shmem"]
        _psi_file(psi, 42.0)
        # Every slot empty, not just punched: the worker gives the huge
        # pages back to the kernel before it shows a slot as empty.
        pool.wait_until(
            p.root,
            lambda s: all(x.state == "empty" for x in s.slots) and "PSI" in s.note,
            60,
            "the pool to empty",
        )
        assert _held(p.root) == 0
        if kind == "tmpfs":
            assert shmem - host_meminfo()["Shmem"] >= 0.9 * 2 * slot
        else:  # the huge pages went back to the host, not just to the huge page pool
            assert nr_hugepages(HUGE) == baseline
        _psi_file(psi, 0.0)
        pool.wait_free(p.root, timeout=120)

        # The watermark: MemAvailable must stay above it.
        high = host_meminfo()["MemAvailable"] + 4 * GiB
        pool.configure(p.root, pool.PoolSpec(watermark=high))
        pool.wait_until(
            p.root,
            lambda s: _held(p.root) == 0 and "watermark" in s.note,
            60,
            "the pool to empty",
        )
        pool.configure(p.root, pool.PoolSpec(watermark=0))
        pool.wait_free(p.root, timeout=120)


# -- ballooning and free page reporting on pool memory -----------------------


def _punch_test(vm: VM, inflate: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """Inflate by `inflate`; returns (bytes the slot lost, meminfo before, after)."""
    assert vm.pool_lease is not None
    path = vm.pool_lease.path
    held = pool.allocated(path)
    assert held == MEMORY  # pre-populated: every guest page is backed already
    before = host_meminfo()
    balloon.set_target(vm, MEMORY - inflate)
    balloon.wait_actual(vm, MEMORY - inflate)
    time.sleep(1)
    return held - pool.allocated(path), before, host_meminfo()


@pytest.mark.guest
def test_balloon_inflation_punches_a_tmpfs_slot(make_vm: VMFactory) -> None:
    inflate = 512 * MiB
    with pool.temporary_pool("tmpfs", MEMORY, tag=_tag("balloon-tmpfs")) as p:
        vm = make_vm(VMConfig(name="pool-balloon-tmpfs", memory=MEMORY, pool=str(p.root)))
        dropped, before, after = _punch_test(vm, inflate)
        assert dropped >= 0.9 * inflate, format_size(dropped)
        # Host memory, not just the file: shmem and MemAvailable move too.
        assert before["Shmem"] - after["Shmem"] >= 0.9 * inflate
        lines = "\n".join(pool.format_status(pool.status(p.root)))
        assert "punched: balloon or free page reporting" in lines
        vm.shutdown()
        pool.wait_free(p.root, MEMORY, timeout=300)  # scrubbed and refilled to the full size
        slot = pool.status(p.root).slots[0]
        assert slot.held == MEMORY


@pytest.mark.guest
def test_range_balloon_returns_whole_huge_pages(
    hugepages_restored: None, make_vm: VMFactory
) -> None:
    """hugetlbfs: the range balloon's granule follows the 2 MiB backing."""
    inflate = 512 * MiB
    with pool.temporary_pool("hugetlbfs", MEMORY, tag=_tag("balloon-huge")) as p:
        config = VMConfig(
            name="pool-balloon-huge",
            memory=MEMORY,
            pool=str(p.root),
            build="patched",
            guest_driver="thinvm",
            balloon=BalloonOptions(ranges=True),
        )
        vm = make_vm(config)
        dmesg = vm.agent.check("dmesg").stdout
        assert "device granule 2048 KiB" in dmesg, dmesg[-2000:]
        dropped, before, after = _punch_test(vm, inflate)
        assert dropped == inflate, format_size(dropped)
        assert after["HugePages_Free"] - before["HugePages_Free"] == inflate // HUGE
        # Kept for the guest to fault back on deflate: the pool fills nothing with them.
        balloon.set_target(vm, MEMORY)
        balloon.wait_actual(vm, MEMORY)
        workload.touch_free_memory(vm.agent)
        assert vm.alive()


@pytest.mark.guest
def test_stock_balloon_cannot_return_huge_pages(
    hugepages_restored: None, make_vm: VMFactory
) -> None:
    """The control: 4 KiB frame numbers never add up to a whole huge page.

    QEMU tracks one partly ballooned huge page per request, and the stock
    driver's requests carry 256 frames (1 MiB), so a 2 MiB page is never
    complete and nothing is discarded.
    """
    with pool.temporary_pool("hugetlbfs", MEMORY, tag=_tag("balloon-stock")) as p:
        vm = make_vm(VMConfig(name="pool-balloon-stock", memory=MEMORY, pool=str(p.root)))
        dropped, _, _ = _punch_test(vm, 512 * MiB)
        assert dropped == 0


@pytest.mark.guest
def test_free_page_reporting_returns_whole_huge_pages(
    hugepages_restored: None, make_vm: VMFactory
) -> None:
    with pool.temporary_pool("hugetlbfs", MEMORY, tag=_tag("report-huge")) as p:
        config = VMConfig(
            name="pool-report-huge",
            memory=MEMORY,
            pool=str(p.root),
            balloon=BalloonOptions(free_page_reporting=True),
        )
        vm = make_vm(config)
        assert vm.pool_lease is not None
        path = vm.pool_lease.path
        free = workload.meminfo(vm.agent)["MemFree"]
        deadline = time.monotonic() + 60
        while pool.allocated(path) > MEMORY - free // 2 and time.monotonic() < deadline:
            time.sleep(1)
        dropped = MEMORY - pool.allocated(path)
        assert dropped >= free // 2, format_size(dropped)
        assert dropped % HUGE == 0


# -- the CLI: thinvm up --pool, thinvm down, fallback ------------------------


def _thinvm(*args: str) -> subprocess.CompletedProcess[str]:
    return thinvm_cli(*args)


@pytest.mark.guest
def test_cli_up_takes_a_slot_and_down_returns_it() -> None:
    names = (f"pool-cli1-{os.getpid()}", f"pool-cli2-{os.getpid()}")
    with pool.temporary_pool("tmpfs", MEMORY, tag=_tag("cli")) as p:
        try:
            up = _thinvm("up", "--name", names[0], "--memory", "1G", "--pool", str(p.root))
            assert up.returncode == 0, up.stderr
            assert "RAM from warm pool slot 0 (tmpfs, 1.00 GiB)" in up.stdout
            (qemu,) = qemu_pids(names[0])
            slot = pool.status(p.root).slots[0]
            assert (slot.state, slot.vm, slot.pid) == ("leased", names[0], qemu)

            # The only slot is taken: the next VM preallocates as usual.
            up2 = _thinvm("up", "--name", names[1], "--memory", "1G", "--pool", str(p.root))
            assert up2.returncode == 0, up2.stderr
            assert "preallocating anonymous RAM instead" in up2.stderr
            assert "no free warm pool slot of 1.00 GiB or more (1 leased)" in up2.stderr
            cmdline = Path(f"/proc/{next(iter(qemu_pids(names[1])))}/cmdline").read_bytes()
            assert b"memory-backend-ram,id=mem0,size=1073741824,prealloc=on" in cmdline

            status = _thinvm("pool", "status", "--root", str(p.root))
            assert f"leased    holds 1.00 GiB, VM {names[0]} (pid {qemu})" in status.stdout

            down = _thinvm("down", names[0])
            assert down.returncode == 0, down.stderr
            pool.wait_free(p.root, MEMORY, timeout=300)
        finally:
            for name in names:
                if (run_dir() / name).exists():
                    _thinvm("down", name)
        assert not qemu_pids(names[0]) and not qemu_pids(names[1])


def test_cli_pool_fill_status_start_stop(tmp_path: Path) -> None:
    root = tmp_path / f"pool-cli-{os.getpid()}"
    files = Path(pool.TMPFS_DIR) / f"thinvm-{root.name}"
    cgroup = Path("/sys/fs/cgroup/memory") / f"thinvm-{root.name}"
    fill = _thinvm(
        "pool", "fill", "--root", str(root), "--slot", "64M", "--count", "2",
        "--kind", "tmpfs", "--watermark", "0",
    )  # fmt: skip
    try:
        assert fill.returncode == 0, fill.stderr
        assert "slot 1 (tmpfs, 64.00 MiB): free, filled in" in fill.stderr
        assert "  slot 1:  64.00 MiB  free      holds 64.00 MiB" in fill.stdout
        status = json.loads(_thinvm("pool", "status", "--root", str(root), "--json").stdout)
        assert status["held"] == 128 * MiB and status["kind"] == "tmpfs"
        again = _thinvm("pool", "fill", "--root", str(root), "--slot", "32M")
        assert again.returncode == 1 and "'thinvm pool stop' first" in again.stderr
        start = _thinvm("pool", "start", "--root", str(root), "--detach")
        assert start.returncode == 0 and "pool daemon running" in start.stdout, start.stderr
        assert pool.status(root).daemon_pid is not None
        assert cgroup.is_dir()
    finally:
        stop = _thinvm("pool", "stop", "--root", str(root))
    assert stop.returncode == 0 and "pool stopped: 2 slots removed" in stop.stdout, stop.stderr
    assert not root.exists() and not files.exists() and not cgroup.exists()
