"""Warm pool logic: slot choice, state transitions, when to grow and shrink.

Also the host-side checks the pool's guest tests rely on: the pattern
signature (`pattern_pages`) and `thinvm-mem kcore-scan` against a fake
ELF core whose segments and pages are known.
"""

import math
import multiprocessing
import os
import pwd
import re
import shutil
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import thinvm_cli
from thinvm import pool
from thinvm.host import HostError
from thinvm.paths import REPO
from thinvm.pool import Action, Owner, Policy, PoolConfig, PoolState, Pressure, Slot
from thinvm.units import GiB, MiB, parse_size
from thinvm.vm.machine import VM, VMConfig

# -- the guest pattern, recomputed on the host (guest/agent/mem.c) ----------

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MUL1, MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MAX_PATTERN_PAGES = 1 << 28  # MAX_MIB * PAGES_PER_MIB in mem.c
PAGE = 4096


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * MUL1) & MASK
    z = ((z ^ (z >> 27)) * MUL2) & MASK
    return z ^ (z >> 31)


def _unxorshift(y: int, s: int) -> int:
    x = y
    for i in range(s, 64, s):
        x ^= y >> i
    return x


def _unmix(z: int) -> int:
    z = (_unxorshift(z, 31) * pow(MUL2, -1, 1 << 64)) & MASK
    z = (_unxorshift(z, 27) * pow(MUL1, -1, 1 << 64)) & MASK
    return _unxorshift(z, 30)


def pattern_page(seed: int, index: int) -> bytes:
    """Page `index` of `thinvm-mem pattern write ... --seed seed`."""
    base = _mix((_mix((seed + GOLDEN) & MASK) + index * GOLDEN) & MASK)
    return struct.pack("<512Q", *((base ^ ((i * GOLDEN) & MASK)) for i in range(512)))


def is_pattern_head(head: bytes, seed: int) -> bool:
    """kcore-scan's test: the first 64 bytes of a pattern page of any index."""
    w = struct.unpack("<8Q", head[:64])
    if any(w[i] != w[0] ^ ((i * GOLDEN) & MASK) for i in range(1, 8)):
        return False
    index = ((_unmix(w[0]) - _mix((seed + GOLDEN) & MASK)) * pow(GOLDEN, -1, 1 << 64)) & MASK
    return index < MAX_PATTERN_PAGES


def pattern_pages(path: str, seed: int) -> int:
    """Pages of a file (a slot) that hold a page of the guest's pattern."""
    count = 0
    second = struct.Struct("<QQ")
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 * MiB):
            for off in range(0, len(chunk), PAGE):
                w0, w1 = second.unpack_from(chunk, off)
                if w1 == w0 ^ GOLDEN and is_pattern_head(chunk[off : off + 64], seed):
                    count += 1
    return count


def test_signature_matches_pattern_pages_only() -> None:
    assert is_pattern_head(pattern_page(7, 0), 7)
    assert is_pattern_head(pattern_page(7, 123456), 7)
    assert not is_pattern_head(pattern_page(8, 5), 7)
    assert not is_pattern_head(bytes(PAGE), 7)
    broken = bytearray(pattern_page(7, 3))
    broken[24] ^= 1
    assert not is_pattern_head(bytes(broken), 7)
    # An index past any pattern file is some other data that happens to fit.
    assert not is_pattern_head(pattern_page(7, MAX_PATTERN_PAGES + 5), 7)


# -- kcore-scan against a fake core ------------------------------------------


@pytest.fixture(scope="module")
def thinvm_mem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("agent")
    subprocess.run(
        ["make", "-s", "-C", str(REPO / "guest" / "agent"), f"O={out}", f"{out}/thinvm-mem"],
        check=True,
    )
    return out / "thinvm-mem"


def _fake_core(path: Path, segments: list[tuple[int, int, list[bytes]]]) -> None:
    """An ELF64 core like /proc/kcore: (vaddr, paddr, pages) per PT_LOAD."""
    data_off = PAGE
    phdrs, data = b"", b""
    for vaddr, paddr, pages in segments:
        blob = b"".join(pages)
        phdrs += struct.pack(
            "<IIQQQQQQ", 1, 7, data_off + len(data), vaddr, paddr, len(blob), len(blob), PAGE
        )
        data += blob
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    ehdr = ident + struct.pack(
        "<HHIQQQIHHHHHH", 4, 62, 1, 0, 64, 0, 0, 64, 56, len(segments), 0, 0, 0
    )
    head = ehdr + phdrs
    path.write_bytes(head + bytes(data_off - len(head)) + data)


def test_kcore_scan_counts_pattern_pages_in_ram_segments(thinvm_mem: Path, tmp_path: Path) -> None:
    seed = 7
    broken = bytearray(pattern_page(seed, 3))
    broken[40] ^= 0xFF
    ram = [
        pattern_page(seed, 0),
        bytes(PAGE),
        pattern_page(seed, 1_000_000),
        pattern_page(8, 5),  # another seed
        bytes(broken),  # changed within the first 64 bytes
        pattern_page(seed, 9),
    ]
    core = tmp_path / "core"
    _fake_core(
        core,
        [
            (0xFFFF888000000000, 0, ram),
            # The kernel image's alias of RAM and a vmalloc area: not scanned.
            (0xFFFFFFFF81000000, 0x1000000, [pattern_page(seed, 10)]),
            (0xFFFFC90000000000, MASK, [pattern_page(seed, 11)]),
        ],
    )
    result = subprocess.run(
        [str(thinvm_mem), "kcore-scan", str(core), "--seed", str(seed)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"pages_scanned":6,"matches":3,"unreadable":0,"segments":1' in result.stdout
    other = subprocess.run(
        [str(thinvm_mem), "kcore-scan", str(core), "--seed", "8"], capture_output=True, text=True
    )
    assert '"matches":1,' in other.stdout
    assert pattern_pages(str(core), seed) == 3 + 2  # the file, unlike the scan, has all


def test_kcore_scan_rejects_a_non_core(thinvm_mem: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(bytes(PAGE))
    result = subprocess.run(
        [str(thinvm_mem), "kcore-scan", str(junk), "--seed", "1"], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "not a 64-bit ELF core" in result.stderr
    usage = subprocess.run([str(thinvm_mem), "kcore-scan"], capture_output=True, text=True)
    assert usage.returncode == 2


# -- slot choice and leases --------------------------------------------------


def _slots(*specs: tuple[int, str]) -> list[Slot]:
    return [Slot(i, size, f"/x/slot-{i}.mem", state) for i, (size, state) in enumerate(specs)]


def _state(slots: list[Slot], page_size: int = PAGE) -> PoolState:
    config = PoolConfig("tmpfs", "/x", page_size, Policy(budget=sum(s.size for s in slots)))
    return PoolState(config, slots)


def test_choose_slot_takes_the_smallest_free_slot_that_fits() -> None:
    slots = _slots((8 * GiB, "free"), (4 * GiB, "leased"), (4 * GiB, "free"), (4 * GiB, "free"))
    assert pool.choose_slot(slots, 4 * GiB) == slots[2]
    assert pool.choose_slot(slots, 2 * GiB) == slots[2]
    assert pool.choose_slot(slots, 6 * GiB) == slots[0]
    assert pool.choose_slot(slots, 16 * GiB) is None


def test_slots_larger_than_the_host_are_refused(tmp_path: Path) -> None:
    pool.store.check_fits_host([4 * GiB, 4 * GiB], 8 * GiB)
    with pytest.raises(pool.PoolError, match="exceed this host's memory"):
        pool.store.check_fits_host([4 * GiB, 4 * GiB], 8 * GiB - 1)
    # A bare number is MiB: 67108864 (meant as bytes) asks for 64 TiB.
    spec = pool.PoolSpec(slots=[parse_size("67108864")])
    with pytest.raises(pool.PoolError, match=r"64\.00 TiB .* without a unit are MiB"):
        pool.configure(tmp_path / "pool", spec)
    assert not pool.Pool(tmp_path / "pool").exists()


def test_only_free_slots_are_leased() -> None:
    for state in ("empty", "filling", "leased", "dirty", "scrubbing"):
        assert pool.choose_slot(_slots((GiB, state)), GiB) is None


def test_shortage_says_why() -> None:
    assert "has no slots" in pool.shortage([], GiB)
    assert "largest is 2.00 GiB" in pool.shortage(_slots((2 * GiB, "free")), 4 * GiB)
    text = pool.shortage(_slots((4 * GiB, "leased"), (4 * GiB, "dirty")), 4 * GiB)
    assert "1 dirty, 1 leased" in text


def test_lease_bind_release_cycle() -> None:
    st = _state(_slots((GiB, "free"), (GiB, "free")))
    me, qemu = Owner(100, 1), Owner(200, 2)
    slot = pool.take(st, GiB, me, "vm1", "tok1")
    assert (slot.index, slot.state, slot.owner, slot.vm, slot.leases) == (0, "leased", me, "vm1", 1)
    assert not pool.bind(st, 0, "wrong", qemu)
    assert pool.bind(st, 0, "tok1", qemu)
    assert st.slots[0].owner == qemu
    second = pool.take(st, GiB, me, "vm2", "tok2")
    assert second.index == 1
    with pytest.raises(pool.PoolEmpty, match="2 leased"):
        pool.take(st, GiB, me, "vm3", "tok3")
    released = pool.release(st, pid=200)  # detached VM: found by its QEMU pid
    assert released is not None and released.index == 0 and released.state == "dirty"
    assert released.owner is None and released.token == ""
    assert pool.release(st, pid=200) is None  # idempotent
    assert pool.release(st, token="tok2") is st.slots[1]
    assert [s.state for s in st.slots] == ["dirty", "dirty"]


def test_take_refuses_memory_that_is_not_whole_huge_pages() -> None:
    st = _state(_slots((GiB, "free")), page_size=2 * MiB)
    with pytest.raises(pool.PoolEmpty, match="not a multiple"):
        pool.take(st, GiB - 4096, Owner(1, 1), "vm", "t")


def test_reap_makes_slots_of_dead_owners_dirty() -> None:
    slots = _slots((GiB, "leased"), (GiB, "filling"), (GiB, "scrubbing"), (GiB, "leased"))
    dead, live = Owner(1, 1), Owner(2, 2)
    for slot, owner in zip(slots, (dead, dead, dead, live), strict=True):
        slot.owner = owner
    st = _state(slots)
    st.daemon = dead
    reaped = pool.reap(st, lambda o: o == live)
    assert [s.index for s in reaped] == [0, 1, 2]
    assert [s.state for s in slots] == ["dirty", "dirty", "dirty", "leased"]
    assert st.daemon is None


def test_state_round_trips_through_json() -> None:
    st = _state(_slots((GiB, "leased"), (GiB, "free")))
    st.slots[0].owner = Owner(5, 6)
    st.daemon = Owner(7, 8)
    st.hugepages_added = 3
    again = PoolState.from_json(st.to_json())
    assert again == st


# -- when to grow and shrink -------------------------------------------------

CALM = Pressure(mem_available=20 * GiB, psi_some_avg10=0.0)


def _policy(budget: int = 8 * GiB, watermark: int = 2 * GiB) -> Policy:
    return Policy(budget=budget, watermark=watermark, psi_threshold=10.0)


def test_pressure_reads_psi_some_avg10(tmp_path: Path) -> None:
    psi = tmp_path / "memory"
    psi.write_text("some avg10=12.50 avg60=1.00 avg300=0.00 total=9\n")
    policy = Policy(budget=GiB, psi_path=str(psi))
    assert pool.read_pressure(policy).psi_some_avg10 == 12.5
    assert pool.read_pressure(policy).mem_available > 0
    psi.write_text("garbage\n")
    assert pool.read_pressure(policy).psi_some_avg10 is None  # the watermark decides alone
    policy.psi_path = str(tmp_path / "absent")  # a kernel without PSI
    assert pool.read_pressure(policy).psi_some_avg10 is None


def test_pressure_from_psi_or_watermark() -> None:
    policy = _policy()
    assert pool.pressure_reason(CALM, policy) is None
    assert "PSI" in (pool.pressure_reason(Pressure(20 * GiB, 10.5), policy) or "")
    assert pool.pressure_reason(Pressure(20 * GiB, 10.0), policy) is None  # above, not at
    assert "watermark" in (pool.pressure_reason(Pressure(GiB, None), policy) or "")
    assert pool.pressure_reason(Pressure(3 * GiB, None), policy) is None  # no PSI: watermark


def test_growth_needs_budget_and_room_above_the_watermark() -> None:
    policy = _policy(budget=6 * GiB, watermark=2 * GiB)
    assert pool.growth_block(CALM, policy, held=2 * GiB, cost=4 * GiB) is None
    assert "budget" in (pool.growth_block(CALM, policy, held=3 * GiB, cost=4 * GiB) or "")
    tight = Pressure(mem_available=5 * GiB, psi_some_avg10=0.0)
    assert "MemAvailable" in (pool.growth_block(tight, policy, held=0, cost=4 * GiB) or "")
    # Huge pages the kernel holds already cost the host nothing more.
    assert pool.growth_block(tight, policy, held=0, cost=4 * GiB, spare=2 * GiB) is None


def test_decide_scrubs_dirty_slots_before_filling() -> None:
    slots = _slots((GiB, "empty"), (GiB, "dirty"), (GiB, "free"))
    held = {0: 0, 1: GiB, 2: GiB}
    assert pool.decide(slots, held, CALM, _policy()) == Action("scrub", 1, "released by its VM")


def test_decide_fills_empty_slots_in_order_within_budget() -> None:
    slots = _slots((GiB, "free"), (GiB, "empty"), (GiB, "empty"))
    held = {0: GiB, 1: 0, 2: 0}
    assert pool.decide(slots, held, CALM, _policy()).index == 1
    over = pool.decide(slots, held, CALM, _policy(budget=int(1.5 * GiB)))
    assert over.kind == "idle" and "budget" in over.reason
    cooling = pool.decide(slots, held, CALM, _policy(), cooling=True)
    assert cooling.kind == "idle" and "cooling" in cooling.reason


def test_decide_under_pressure_gives_back_the_least_useful_slot() -> None:
    slots = _slots((GiB, "free"), (GiB, "free"), (GiB, "empty"), (GiB, "dirty"), (GiB, "leased"))
    held = {0: GiB, 1: GiB, 2: 64 * MiB, 3: GiB, 4: GiB}
    hot = Pressure(mem_available=20 * GiB, psi_some_avg10=50.0)
    order = []
    for _ in range(4):
        action = pool.decide(slots, held, hot, _policy())
        assert action.kind == "shrink" and action.index is not None
        order.append(action.index)
        slots[action.index].state, held[action.index] = "empty", 0
    assert order == [3, 2, 1, 0]  # dirty, partly filled, then free from the top
    last = pool.decide(slots, held, hot, _policy())
    assert last.kind == "idle" and "nothing left" in last.reason  # leased slots stay


def test_decide_shrinks_when_over_budget() -> None:
    slots = _slots((GiB, "free"), (GiB, "free"))
    action = pool.decide(slots, {0: GiB, 1: GiB}, CALM, _policy(budget=GiB))
    assert action == Action("shrink", 1, action.reason) and "over the budget" in action.reason


def test_decide_is_idle_when_all_slots_are_free() -> None:
    slots = _slots((GiB, "free"))
    assert pool.decide(slots, {0: GiB}, CALM, _policy()).reason == "all slots filled"


# -- the VM command line -----------------------------------------------------


def _lease(path: str) -> pool.Lease:
    return pool.Lease(Path("/x"), 0, path, 4 * GiB, "hugetlbfs", 2 * MiB, "t")


def test_pool_backed_vm_maps_its_slot_shared_and_preallocated() -> None:
    vm = VM(VMConfig(memory=4 * GiB, pool="/x"))
    vm.pool_lease = _lease("/dev/hugepages/thinvm-pool/slot-0.mem")
    args = vm._memory_backend_args()
    assert args == [
        "-object",
        "memory-backend-file,id=mem0,size=4294967296,"
        "mem-path=/dev/hugepages/thinvm-pool/slot-0.mem,share=on,"
        "prealloc=on,prealloc-threads=1",
    ]
    shutil.rmtree(vm.rundir)


def test_pool_backed_vm_without_a_slot_preallocates_anonymous_ram() -> None:
    vm = VM(VMConfig(memory=4 * GiB, pool="/x", prealloc_threads=2))
    args = vm._memory_backend_args()
    assert args[1] == "memory-backend-ram,id=mem0,size=4294967296,prealloc=on,prealloc-threads=2"
    shutil.rmtree(vm.rundir)


# -- a real (small, tmpfs) pool on disk --------------------------------------


@pytest.fixture
def small_pool(tmp_path: Path) -> Iterator[Path]:
    """Three 4 MiB tmpfs slots, filled in this process, no cgroup."""
    if not os.path.isdir(pool.TMPFS_DIR):
        pytest.skip(f"no {pool.TMPFS_DIR}")
    root = tmp_path / f"pool-unit-{os.getpid()}"
    files = Path(pool.TMPFS_DIR) / f"thinvm-unit-{os.getpid()}"
    files.mkdir()
    spec = pool.PoolSpec(
        slots=[4 * MiB] * 3, kind="tmpfs", directory=str(files), watermark=0, cgroup=False
    )
    pool.configure(root, spec)
    worker = pool.Worker(pool.Pool(root), threading.Event())
    while worker.step().kind != "idle":
        pass
    yield root
    if pool.Pool(root).exists():
        pool.stop(root, force=True)
    shutil.rmtree(files, ignore_errors=True)


def test_filled_slots_are_zero_and_fully_allocated(small_pool: Path) -> None:
    st = pool.status(small_pool)
    assert [s.state for s in st.slots] == ["free"] * 3
    for slot in pool.Pool(small_pool).read().slots:
        assert pool.allocated(slot.path) == slot.size
        assert pool.is_zero(slot.path)


def _lease_in_child(root: str, queue: "multiprocessing.Queue[object]") -> None:
    try:
        lease = pool.acquire(root, 4 * MiB, f"vm{os.getpid()}")
        queue.put(lease.index)
    except pool.PoolEmpty:
        queue.put(None)


def test_concurrent_leases_never_share_a_slot(small_pool: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[object] = ctx.Queue()
    procs = [ctx.Process(target=_lease_in_child, args=(str(small_pool), queue)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join()
    taken = sorted(r for r in results if isinstance(r, int))
    assert taken == [0, 1, 2]
    assert results.count(None) == 5


def test_released_slot_is_scrubbed_before_it_is_free_again(small_pool: Path) -> None:
    lease = pool.acquire(small_pool, 4 * MiB, "vm")
    with open(lease.path, "r+b") as f:
        f.write(pattern_page(3, 0) * 16)
    assert pattern_pages(lease.path, 3) == 16
    with pool.Pool(small_pool).locked() as state:  # released without kicking a worker
        assert pool.release(state, token=lease.token) is not None
    assert pool.acquire(small_pool, 4 * MiB, "vm2").index != lease.index  # dirty: not leased
    worker = pool.Worker(pool.Pool(small_pool), threading.Event())
    assert worker.step().kind == "scrub"
    assert pool.allocated(lease.path) == 0
    assert worker.step().kind == "fill"
    assert pool.is_zero(lease.path) and pattern_pages(lease.path, 3) == 0
    assert pool.Pool(small_pool).read().slots[lease.index].state == "free"


def _shrink_with_hugepages_managed(
    root: Path, monkeypatch: pytest.MonkeyPatch, give_back: Callable[[PoolConfig], None]
) -> pool.Action:
    """One worker step that shrinks a slot (the budget cut to two slots)
    of a pool that manages huge pages, `give_back` standing in for the
    vm.nr_hugepages write."""
    with pool.Pool(root).locked() as state:
        state.config.manage_hugepages = True
        state.config.policy.budget = 8 * MiB
    worker = pool.Worker(pool.Pool(root), threading.Event())
    monkeypatch.setattr(worker, "_give_back_hugepages", give_back)
    return worker.step()


def _not_free(root: Path) -> list[Slot]:
    return [s for s in pool.Pool(root).read().slots if s.state != "free"]


def test_shrink_gives_huge_pages_back_before_the_slot_shows_empty(
    small_pool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Slot] = []
    action = _shrink_with_hugepages_managed(
        small_pool, monkeypatch, lambda cfg: seen.extend(_not_free(small_pool))
    )
    assert action.kind == "shrink", action
    # While the kernel's pool shrinks, the slot is still the worker's...
    assert [(s.index, s.state) for s in seen] == [(action.index, "scrubbing")]
    assert seen[0].owner is not None
    # ...and only then shows as empty.
    (slot,) = _not_free(small_pool)
    assert (slot.index, slot.state, slot.owner, slot.error) == (action.index, "empty", None, "")


def test_a_failed_huge_page_give_back_leaves_no_slot_owned(
    small_pool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def give_back(cfg: PoolConfig) -> None:
        raise pool.PoolError("the pool's own bug")

    with pytest.raises(pool.PoolError):
        _shrink_with_hugepages_managed(small_pool, monkeypatch, give_back)
    assert [(s.state, s.owner) for s in _not_free(small_pool)] == [("empty", None)]


def test_a_refused_nr_hugepages_write_does_not_stop_the_pool(
    small_pool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel refusing the write (HostError) is logged; the shrink
    still happened, and the pages stay counted for the next give-back."""

    def give_back(cfg: PoolConfig) -> None:
        raise HostError("cannot set nr_hugepages: Permission denied (run as root)")

    action = _shrink_with_hugepages_managed(small_pool, monkeypatch, give_back)
    assert action.kind == "shrink", action
    assert [(s.state, s.owner) for s in _not_free(small_pool)] == [("empty", None)]


def test_scrub_refuses_a_file_someone_still_has_open(small_pool: Path) -> None:
    lease = pool.acquire(small_pool, 4 * MiB, "vm")
    with pool.Pool(small_pool).locked() as state:
        pool.release(state, token=lease.token)
    with open(lease.path, "rb") as f:
        holder = subprocess.Popen(["sleep", "60"], stdin=f)
    try:
        worker = pool.Worker(pool.Pool(small_pool), threading.Event())
        action = worker.step()
        assert action.kind == "idle" and "still open" in action.reason
        assert pool.Pool(small_pool).read().slots[lease.index].state == "dirty"
    finally:
        holder.kill()
        holder.wait()
    assert pool.Worker(pool.Pool(small_pool), threading.Event()).step().kind == "scrub"


def test_worker_entry_point_runs_as_a_module(tmp_path: Path) -> None:
    """`python -m thinvm.pool serve ROOT` is how the pool spawns its worker."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "thinvm.pool", "serve", str(tmp_path / "none"), "--once"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    assert proc.returncode == 1
    assert proc.stderr.startswith("thinvm pool: error: no warm pool at ")
    assert "Traceback" not in proc.stderr


# -- the pool touches only its own directory and files -----------------------

NOBODY = pwd.getpwnam("nobody").pw_uid
SECRET = b"root's own data, not a guest's\n" * 4096


def _stat(mode: int, uid: int = 0, nlink: int = 1, dev: int = 7) -> os.stat_result:
    # (mode, ino, dev, nlink, uid, gid, size, atime, mtime, ctime)
    return os.stat_result((mode, 1, dev, nlink, uid, 0, 0, 0, 0, 0))


def test_a_slot_directory_must_be_ours_alone() -> None:
    ok = pool.directory_problem
    assert ok(_stat(stat.S_IFDIR | 0o700), 0) is None
    assert ok(_stat(stat.S_IFDIR | 0o755), 0) is None  # others may look, not write
    assert ok(_stat(stat.S_IFLNK | 0o777), 0) == "is a symbolic link"
    assert ok(_stat(stat.S_IFREG | 0o600), 0) == "is not a directory"
    assert ok(_stat(stat.S_IFDIR | 0o700, uid=NOBODY), 0) == (
        f"belongs to uid {NOBODY} (nobody), not to uid 0 (root), which runs the pool"
    )
    assert ok(_stat(stat.S_IFDIR | 0o1777), 0) == "is writable by others (mode 1777)"
    assert ok(_stat(stat.S_IFDIR | 0o770), 0) == "is writable by others (mode 0770)"


def test_a_slot_file_must_be_ours_alone() -> None:
    ok = pool.slot_problem
    assert ok(_stat(stat.S_IFREG | 0o600), 0, 7) is None
    assert ok(_stat(stat.S_IFIFO | 0o600), 0, 7) == "is not a regular file"
    assert ok(_stat(stat.S_IFCHR | 0o600), 0, 7) == "is not a regular file"
    assert ok(_stat(stat.S_IFREG | 0o600, uid=NOBODY), 0, 7) is not None
    assert ok(_stat(stat.S_IFREG | 0o600, nlink=2), 0, 7) == "has 2 links, not 1"
    assert ok(_stat(stat.S_IFREG | 0o600), 0, 8) == "is on another filesystem than its directory"
    assert ok(_stat(stat.S_IFREG | 0o644), 0, 7) == "is open to others (mode 0644)"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of ours, outside any pool, holding SECRET."""
    path = tmp_path / "victim"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def test_claim_directory_makes_it_0700_and_takes_it_again(tmp_path: Path) -> None:
    files = tmp_path / "slots"
    pool.claim_directory(str(files))
    st = os.lstat(files)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    pool.claim_directory(str(files))  # a pool started again


@pytest.mark.parametrize("kind", ["symlink", "foreign", "writable"])
def test_claim_directory_refuses_one_that_is_not_ours_alone(tmp_path: Path, kind: str) -> None:
    files, target = tmp_path / "slots", tmp_path / "elsewhere"
    if kind == "symlink":
        target.mkdir(mode=0o700)
        files.symlink_to(target)
    else:
        files.mkdir(mode=0o700)
        if kind == "foreign":
            os.chown(files, NOBODY, -1)
        else:
            files.chmod(0o777)
    with pytest.raises(pool.UnsafePath, match=re.escape(f"rm -r {files}")):
        pool.claim_directory(str(files))
    assert os.listdir(files) == []  # nothing made in it (nor, for a symlink, in its target)


def test_configure_puts_no_slot_in_a_files_directory_of_another_user() -> None:
    files = Path(pool.TMPFS_DIR) / f"thinvm-unit-foreign-{os.getpid()}"
    files.mkdir(mode=0o700)
    os.chown(files, NOBODY, -1)
    root = files.with_name(files.name + "-state")
    try:
        spec = pool.PoolSpec(slots=[4 * MiB], kind="tmpfs", directory=str(files), cgroup=False)
        with pytest.raises(pool.PoolError, match=re.escape(f"belongs to uid {NOBODY} ")):
            pool.configure(root, spec)
        assert os.listdir(files) == [] and not pool.Pool(root).exists()
    finally:
        shutil.rmtree(files)
        shutil.rmtree(root, ignore_errors=True)


def test_open_slot_creates_a_new_slot_0600(tmp_path: Path) -> None:
    path = tmp_path / "slot-0.mem"
    fd = pool.open_slot(str(path), create=True)
    os.close(fd)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    with pytest.raises(FileNotFoundError):
        pool.open_slot(str(tmp_path / "slot-1.mem"))


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "foreign", "open"])
def test_open_slot_refuses_what_is_not_a_slot_of_ours(
    tmp_path: Path, victim: Path, kind: str
) -> None:
    path = tmp_path / "slot-0.mem"
    problem = {
        "symlink": "is a symbolic link",
        "hardlink": "has 2 links, not 1",
        "fifo": "is not a regular file",
        "foreign": f"belongs to uid {NOBODY} (nobody)",
        "open": "is open to others (mode 0644)",
    }[kind]
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, path)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.write_bytes(SECRET)
        if kind == "foreign":
            os.chown(path, NOBODY, -1)
        else:
            path.chmod(0o644)
    for create in (False, True):
        with pytest.raises(pool.UnsafePath, match=re.escape(f"slot file {path} {problem}")):
            pool.open_slot(str(path), create=create)
    assert victim.read_bytes() == SECRET


def _plant_symlink(root: Path, index: int, target: Path, state: str) -> str:
    """Slot `index` of the pool replaced by a symlink to `target`, in `state`."""
    with pool.Pool(root).locked() as st:
        slot = st.slots[index]
        slot.state = state
    os.unlink(slot.path)
    os.symlink(target, slot.path)
    return slot.path


@pytest.mark.parametrize("state", ["dirty", "empty"])
def test_scrub_and_fill_never_go_through_a_symlink(
    small_pool: Path, victim: Path, state: str
) -> None:
    path = _plant_symlink(small_pool, 1, victim, state)
    action = pool.Worker(pool.Pool(small_pool), threading.Event()).step()
    assert action.kind == "idle" and action.index == 1, action
    assert f"slot file {path} is a symbolic link: not touched" in action.reason
    assert victim.read_bytes() == SECRET
    assert os.path.islink(path)
    assert pool.Pool(small_pool).read().slots[1].state == state


def test_a_slot_is_not_leased_through_a_symlink(small_pool: Path, victim: Path) -> None:
    path = _plant_symlink(small_pool, 0, victim, "free")
    with pytest.raises(pool.PoolError, match=re.escape("is a symbolic link")):
        pool.acquire(small_pool, 4 * MiB, "vm")
    assert pool.Pool(small_pool).read().slots[0].state == "free"  # not taken either
    assert os.path.islink(path) and victim.read_bytes() == SECRET


def test_stop_removes_a_planted_symlink_and_leaves_its_target(
    small_pool: Path, victim: Path
) -> None:
    path = _plant_symlink(small_pool, 2, victim, "free")
    files = os.path.dirname(path)
    report = pool.stop(small_pool)
    assert victim.read_bytes() == SECRET
    assert report.removed == 3
    assert report.warnings == [
        f"slot file {path} is a symbolic link: not touched; its name is removed"
    ]
    assert not os.path.lexists(files)


def test_check_interval_refuses_what_the_daemon_cannot_sleep_for() -> None:
    pool.check_interval(0.1)
    pool.check_interval(2)
    for bad in (0.0, -1.0, math.nan, math.inf, 0.01):
        with pytest.raises(pool.PoolError, match=re.escape("give a number of at least 0.1")):
            pool.check_interval(bad)
    with pytest.raises(pool.PoolError, match=re.escape("--interval 0:")):
        pool.configure("/nonexistent/pool", pool.PoolSpec(interval=0))


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_pool_start_refuses_an_interval_that_would_spin(tmp_path: Path, interval: str) -> None:
    """Today's `wake.wait(0)` loop: the idle daemon would keep a CPU busy."""
    root = tmp_path / f"pool-interval-{os.getpid()}"
    try:
        start = thinvm_cli(
            "pool", "start", "--root", str(root), "--slot", "4M", "--kind", "tmpfs",
            "--watermark", "0", "--no-cgroup", f"--interval={interval}", "--detach",
        )  # fmt: skip
        assert start.returncode == 1, start.stdout
        assert start.stderr.startswith(f"thinvm: error: --interval {interval}: the daemon")
        assert not pool.Pool(root).exists()
    finally:
        if pool.Pool(root).exists():
            pool.stop(root, force=True)
