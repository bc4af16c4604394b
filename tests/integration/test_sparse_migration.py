"""sparse-ram migration (qemu/patches 0002-0007) with real guests.

Where the guest can be paused, source and destination RAM are compared
byte for byte; where it keeps running, the guest's memory pattern is
verified on the destination.
"""

import contextlib
import filecmp
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import VMFactory
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.host import cgroups
from thinvm.units import GiB, MiB
from thinvm.vm import balloon, migrate
from thinvm.vm.machine import VM, BalloonOptions, VMConfig

pytestmark = pytest.mark.guest

SPARSE = {"sparse-ram": True}
PAGE = 4096


def patched(name: str, **kwargs: object) -> VMConfig:
    kwargs.setdefault("memory", 1 * GiB)
    return VMConfig(name=name, build="patched", **kwargs)  # type: ignore[arg-type]


def paused_destination(config: VMConfig) -> VMConfig:
    return VMConfig.from_json({**config.to_json(), "extra_args": [*config.extra_args, "-S"]})


def assert_identical_memory(src: VM, dst: VM, tmp_path: Path) -> None:
    """Both guests paused: their RAM must match byte for byte."""
    a, b = tmp_path / "src.mem", tmp_path / "dst.mem"
    try:
        migrate.save_guest_memory(src, str(a))
        migrate.save_guest_memory(dst, str(b))
        assert a.stat().st_size == src.config.memory
        assert filecmp.cmp(a, b, shallow=False), f"RAM differs: {first_difference(a, b)}"
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def first_difference(a: Path, b: Path) -> str:
    with a.open("rb") as fa, b.open("rb") as fb:
        offset = 0
        while chunk := fa.read(1 << 20):
            other = fb.read(1 << 20)
            if chunk != other:
                for i in range(0, len(chunk), PAGE):
                    if chunk[i : i + PAGE] != other[i : i + PAGE]:
                        return f"first differing page at guest address {offset + i:#x}"
            offset += len(chunk)
    return "no difference found on re-read"


@pytest.mark.parametrize("pagemap", ["scan", "read"])
def test_idle_and_ballooned_guest_migrates_byte_identical(
    make_vm: VMFactory, tmp_path: Path, pagemap: str
) -> None:
    extra = ["-global", "migration.x-sparse-ram-pagemap-read=on"] if pagemap == "read" else []
    config = patched("sparse-idle", extra_args=extra)
    src = make_vm(config)
    workload.pattern_write(src.agent, 64 * MiB, seed=11)
    workload.touch(src.agent, 256 * MiB)  # populated, then freed: must travel
    inflate = 256 * MiB
    balloon.set_target(src, config.memory - inflate)
    balloon.wait_actual(src, config.memory - inflate)

    dst = make_vm(paused_destination(config), incoming=True)
    result = migrate.migrate(src, dst, caps=SPARSE, resume=False)
    # The ballooned pages alone were discarded on the host: never read.
    assert result.sparse_skipped >= inflate // PAGE
    populated = src.host_memory().anonymous
    assert result.sparse_skipped * PAGE >= config.memory - populated - 64 * MiB
    assert_identical_memory(src, dst, tmp_path)


@pytest.mark.parametrize("detection", ["legacy", "multifd"])
def test_reporting_and_dirtying_guest_keeps_its_data(make_vm: VMFactory, detection: str) -> None:
    """The guest writes, frees and reports memory while it migrates.

    Bandwidth is throttled so the migration takes several passes; memory
    that the guest dirtied and free page reporting then discarded is sent
    as zero pages unread (sparse-zero) over multifd, with zero pages
    detected on the main channel (legacy) or in the multifd threads (the
    default), and a pattern written during the migration must arrive.
    """
    config = patched(
        "sparse-dirty", balloon=BalloonOptions(free_page_reporting=True, free_page_hint=True)
    )
    src = make_vm(config)
    workload.pattern_write(src.agent, 64 * MiB, seed=21)
    src.agent.check(
        "(thinvm-mem pattern write /dev/shm/during 96 --seed 22;"
        " for i in 1 2 3 4 5 6 7 8; do thinvm-mem touch 192; sleep 1; done)"
        " >/dev/null 2>&1 &"
    )
    dst = make_vm(config, incoming=True)
    caps = {**SPARSE, "multifd": True}
    params = {"max_bandwidth": 48 * MiB, "zero_page_detection": detection}
    result = migrate.migrate(src, dst, caps=caps, params=params)
    assert result.dirty_sync_count >= 2
    assert result.sparse_skipped > 0
    dst.agent.check("sleep 10")  # let the background writer finish
    assert workload.pattern_verify(dst.agent, seed=21).ok
    during = workload.pattern_verify(dst.agent, seed=22, path="/dev/shm/during")
    assert during.ok and during.pages == 96 * MiB // PAGE


@contextlib.contextmanager
def swap_file(size: int) -> Iterator[Path]:
    """Swap on a file that only root can reach while it holds guest memory.

    A fresh 0700 directory, the file created in it exclusively: under a
    fixed name in /var/tmp anyone could create the file first and read what
    root swaps.  /var/tmp rather than /tmp, which may be a tmpfs (no swap
    files there).
    """
    folder = Path(tempfile.mkdtemp(prefix="thinvm-test-swap-", dir="/var/tmp"))
    path = folder / "swap"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # swap files must have no holes
        finally:
            os.close(fd)
        subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
        swapon = subprocess.run(["swapon", str(path)], capture_output=True, text=True)
        if swapon.returncode != 0:
            pytest.skip(f"this machine does not allow swap: swapon {path}: {swapon.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["swapoff", str(path)], check=False)
    finally:
        shutil.rmtree(folder)


@contextlib.contextmanager
def memory_cgroup() -> Iterator[tuple[str, str]]:
    """A memory cgroup (v2 where its controller is there, else v1) whose
    processes may swap: its name and directory."""
    name = f"thinvm-test-swap-{os.getpid()}"
    path = cgroups.create_cgroup(name)
    if path is None:
        pytest.skip("no memory cgroup controller (v1 or v2)")
    try:
        # v2 limits swap apart from memory; v1's memsw limit starts unlimited.
        swap_max = Path(path, "memory.swap.max")
        if swap_max.exists():
            swap_max.write_text("max")
        yield name, path
    finally:
        # The test's VMs are stopped later, by make_vm's teardown: they
        # leave the cgroup first, or it stays behind.
        cgroups.release_processes(name)
        cgroups.remove_cgroup(name)


def test_swapped_out_pages_are_always_sent(make_vm: VMFactory, tmp_path: Path) -> None:
    with swap_file(1 * GiB), memory_cgroup() as (cgroup, path):
        config = patched("sparse-swap", memory_cgroup=path)
        src = make_vm(config)
        workload.pattern_write(src.agent, 128 * MiB, seed=31)
        usage = cgroups.cgroup_usage(cgroup)
        assert usage is not None and usage.usage is not None, f"no usage in {path}"
        cgroups.set_cgroup_limit(cgroup, usage.usage - 128 * MiB)
        deadline = time.monotonic() + 60
        while src.host_memory().swap < 64 * MiB and time.monotonic() < deadline:
            time.sleep(0.5)
        assert src.host_memory().swap >= 64 * MiB, "the host did not swap guest memory out"
        cgroups.set_cgroup_limit(cgroup, None)
        dst = make_vm(paused_destination(config), incoming=True)
        migrate.migrate(src, dst, caps=SPARSE, resume=False)
        assert_identical_memory(src, dst, tmp_path)
        dst.qmp("cont")
        dst.wait_agent(60)
        assert workload.pattern_verify(dst.agent, seed=31).ok


def test_unsafe_combinations_are_refused(make_vm: VMFactory, tmp_path: Path) -> None:
    src = make_vm(patched("sparse-refuse", memory=512 * MiB))

    # A shared file backend could hold old data where nothing is sent.
    backing = tmp_path / "old-ram"
    with backing.open("wb") as f:
        f.truncate(src.config.memory)
        f.write(b"\xaa" * 4096)
    file_cfg = VMConfig.from_json(
        {**src.config.to_json(), "name": "sparse-file", "backend": f"file:{backing}"}
    )
    with pytest.raises(ThinvmError, match=r"sparse-ram: RAM block .* file or memfd"):
        migrate.migrate(src, make_vm(file_cfg, incoming=True), caps=SPARSE, timeout=60)
    assert src.qmp("query-status")["status"] == "running"

    # Both sides must agree: a destination without the capability refuses.
    plain = make_vm(src.config, incoming=True)
    uri = migrate.start_incoming(plain, migrate.free_port())
    with pytest.raises(ThinvmError, match="failed"):
        migrate.migrate_to_uri(src, uri, caps=SPARSE, timeout=60)
    assert src.agent.check("echo alive").stdout == "alive\n"

    with pytest.raises(ThinvmError, match="incompatible with background snapshots"):
        migrate.set_capabilities(src, {**SPARSE, "background-snapshot": True})


POSTCOPY = {**SPARSE, "postcopy-ram": True}


def test_postcopy_switched_mid_pass_migrates_byte_identical(
    make_vm: VMFactory, tmp_path: Path
) -> None:
    """Postcopy with sparse-ram (patch 0012), guest paused so RAM can be compared.

    The switch comes early in the first pass: pages still dirty are sent in
    postcopy, the ones left out are mapped as zero by the destination, and
    every page must end up as on the source.
    """
    config = patched("sparse-postcopy", memory=512 * MiB)
    src = make_vm(config)
    workload.pattern_write(src.agent, 64 * MiB, seed=43)
    src.qmp("stop")
    dst = make_vm(paused_destination(config), incoming=True)
    result = migrate.migrate(
        src,
        dst,
        caps=POSTCOPY,
        params={"max-bandwidth": 32 * MiB, "max-postcopy-bandwidth": 32 * MiB},
        resume=False,
        postcopy_after=0.3,
    )
    assert result.postcopy_bytes > 16 * MiB, "did not switch to postcopy early"
    assert result.sparse_skipped > 64 * MiB // PAGE
    assert_identical_memory(src, dst, tmp_path)


def test_postcopy_guest_uses_memory_left_out_without_waiting(make_vm: VMFactory) -> None:
    """In postcopy the destination guest takes fresh memory at once.

    The source never answers a page request for a page sparse-ram left out
    (it counts as sent), so without the destination's zero mapping the
    guest would wait for the end of the migration.  The switch comes
    early, so most of the guest's 192 MiB of data is still to be sent, at
    a trickle that keeps the migration going for about 45 s: the guest's
    128 MiB of fresh memory must be in place long before.
    """
    config = patched("sparse-postcopy-live", memory=512 * MiB)
    src = make_vm(config)
    workload.pattern_write(src.agent, 192 * MiB, seed=47)
    dst = make_vm(config, incoming=True)
    migrate.set_capabilities(dst, POSTCOPY)
    uri = migrate.start_incoming(dst, migrate.free_port())
    migrate.set_capabilities(src, POSTCOPY)
    migrate.set_parameters(src, {"max-bandwidth": 16 * MiB, "max-postcopy-bandwidth": 4 * MiB})
    src.qmp("migrate", uri=uri)
    time.sleep(0.5)
    migrate.start_postcopy(src)
    migrate.wait_destination_status(dst, "running")
    dst.wait_agent(timeout=120)
    workload.touch(dst.agent, 128 * MiB)
    info = src.qmp("query-migrate")
    assert info["status"] == "postcopy-active", f"fresh memory waited for the migration: {info}"
    assert info["ram"]["remaining"] > 16 * MiB, "too close to the end to tell"
    migrate.set_parameters(src, {"max-postcopy-bandwidth": 0})
    info = migrate.wait_migration(src, 300)
    assert info["status"] == "completed", info
    assert workload.pattern_verify(dst.agent, seed=47).ok


PREEMPT = {**POSTCOPY, "postcopy-preempt": True}


@pytest.mark.parametrize("recover", [False, True], ids=["preempt", "preempt-recovery"])
def test_postcopy_preempt_guest_faults_get_their_data(make_vm: VMFactory, recover: bool) -> None:
    """Postcopy-preempt: the guest reads its data back through page faults.

    Right after the switchover the destination guest verifies 192 MiB of
    pattern that is still mostly on the source: every page it reads is
    sent urgently by the source's return path thread, while the migration
    thread sends the rest in the background, both through sparse-ram's
    zero check (each with a pagemap batch of its own, patch 0012).  With
    `recover`, the channel is broken and resumed first, so the source
    sends what the destination's received map says is missing.  The
    pattern must verify while still in postcopy and again at the end.
    """
    config = patched(f"sparse-preempt-{'rec' if recover else 'run'}", memory=512 * MiB)
    src = make_vm(config)
    workload.pattern_write(src.agent, 192 * MiB, seed=53)
    dst = make_vm(config, incoming=True)
    migrate.set_capabilities(dst, PREEMPT)
    uri = migrate.start_incoming(dst, migrate.free_port())
    migrate.set_capabilities(src, PREEMPT)
    migrate.set_parameters(src, {"max-bandwidth": 32 * MiB, "max-postcopy-bandwidth": 2 * MiB})
    src.qmp("migrate", uri=uri)
    time.sleep(0.3)
    migrate.start_postcopy(src)
    if recover:
        migrate.pause_and_recover(src, dst)
    migrate.wait_destination_status(dst, "running")
    dst.wait_agent(timeout=120)
    check = workload.pattern_verify(dst.agent, seed=53)
    assert check.ok, f"destination read wrong data in postcopy: {check}"
    info = src.qmp("query-migrate")
    assert info["status"] == "postcopy-active", f"the background sent it all first: {info}"
    assert info["ram"]["postcopy-requests"] > 1000, "the guest's reads did not fault"
    migrate.set_parameters(src, {"max-postcopy-bandwidth": 0})
    info = migrate.wait_migration(src, 300)
    assert info["status"] == "completed", info
    assert workload.pattern_verify(dst.agent, seed=53).ok


def test_stock_qemu_does_not_know_the_capability(make_vm: VMFactory) -> None:
    src = make_vm(VMConfig(name="sparse-stock", memory=512 * MiB))
    with pytest.raises(ThinvmError, match="sparse-ram"):
        migrate.set_capabilities(src, SPARSE)


def test_stock_destination_loads_a_sparse_multifd_stream(
    make_vm: VMFactory, tmp_path: Path
) -> None:
    """thinvm host -> a host still on stock QEMU, as in a rolling upgrade (patch 0016).

    Over multifd, a stock destination already takes its fresh memory to be
    zero (it never clears a zero page it receives first), so the source
    may leave out what it never populated without the destination taking
    part.  The guest is paused so that RAM can be compared byte for byte;
    the source must have skipped most of it.  (Over the main channel a
    destination must still take part: qtest destination-without-capability.)
    """
    config = patched("sparse-to-stock", memory=1 * GiB)
    src = make_vm(config)
    workload.pattern_write(src.agent, 64 * MiB, seed=59)
    src.qmp("stop")
    stock = VMConfig.from_json({**paused_destination(config).to_json(), "build": "stock"})
    dst = make_vm(stock, incoming=True)
    multifd = {"multifd": True}
    migrate.set_capabilities(dst, multifd)
    uri = migrate.start_incoming(dst, migrate.free_port())
    result = migrate.migrate_to_uri(src, uri, caps={**SPARSE, **multifd}, params=migrate.UNCAPPED)
    migrate.wait_destination_status(dst, "paused")
    assert result.sparse_skipped > 512 * MiB // PAGE, result
    assert_identical_memory(src, dst, tmp_path)


def test_stock_destination_loads_a_main_channel_stream_left_sparse(
    make_vm: VMFactory, tmp_path: Path
) -> None:
    """thinvm host -> stock QEMU on the main channel, no capability (0023).

    With x-sparse-ram-main (on in pc-q35-10.0-thinvm) the source leaves
    out what it holds nothing for, ballooned pages included, on the plain
    main channel that `virsh migrate` without --parallel uses.  A stock
    destination keeps what its RAM holds until a page arrives, so this is
    right only where its fresh RAM reads as zero: RAM compared byte for
    byte, guest paused.  (Pages the destination's machine writes while it
    is built: qtest implied/main/built-pages.)
    """
    main = ["-global", "migration.x-sparse-ram-main=on"]
    config = patched("sparse-main-to-stock", memory=1 * GiB, extra_args=main)
    src = make_vm(config)
    workload.pattern_write(src.agent, 64 * MiB, seed=61)
    workload.touch(src.agent, 256 * MiB)  # populated, then freed: must travel
    inflate = 256 * MiB
    balloon.set_target(src, config.memory - inflate)
    balloon.wait_actual(src, config.memory - inflate)
    src.qmp("stop")
    plain = VMConfig.from_json({**config.to_json(), "extra_args": ["-S"], "build": "stock"})
    dst = make_vm(plain, incoming=True)
    uri = migrate.start_incoming(dst, migrate.free_port())
    result = migrate.migrate_to_uri(src, uri, caps={}, params=migrate.UNCAPPED)
    migrate.wait_destination_status(dst, "paused")
    assert result.sparse_skipped >= inflate // PAGE, result
    assert_identical_memory(src, dst, tmp_path)


def save_to_file(vm: VM, path: Path, caps: dict[str, bool]) -> tuple[float, dict[str, object]]:
    """Save the (paused) guest to `path` with `caps`; return seconds and query-migrate."""
    migrate.set_capabilities(vm, caps)
    start = time.monotonic()
    vm.qmp("migrate", uri=f"file:{path}")
    info = migrate.wait_migration(vm, 600)
    assert info["status"] == "completed", info
    return time.monotonic() - start, info


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_mapped_ram_save_leaves_unpopulated_memory_out(make_vm: VMFactory, tmp_path: Path) -> None:
    """`migrate file:` with mapped-ram (libvirt's sparse save format) and sparse-ram:
    a 2 GiB guest using 256 MiB writes about what it uses, reads nothing else, and
    restores with its data (issue 13, section 2)."""
    caps = {"mapped-ram": True, **SPARSE}
    config = patched("sparse-save", memory=2 * GiB)
    src = make_vm(config)
    workload.pattern_write(src.agent, 256 * MiB, seed=41)
    src.qmp("stop")
    populated = src.host_memory().anonymous

    image = tmp_path / "guest.img"
    seconds, info = save_to_file(src, image, caps)
    ram = info["ram"]
    assert isinstance(ram, dict)
    skipped = ram["sparse-skipped"] * PAGE
    print(
        f"saved {config.memory >> 20} MiB guest with {populated >> 20} MiB populated: "
        f"{allocated(image) >> 20} MiB written in {seconds:.2f} s, {skipped >> 20} MiB skipped"
    )
    assert 256 * MiB <= allocated(image) <= populated + 64 * MiB
    assert skipped >= config.memory - populated - 64 * MiB

    dst = make_vm(paused_destination(config), incoming=True)
    migrate.set_capabilities(dst, caps)
    dst.qmp("migrate-incoming", uri=f"file:{image}")
    migrate.wait_destination_status(dst, "paused", timeout=300)
    dst.qmp("cont")
    dst.wait_agent(60)
    assert workload.pattern_verify(dst.agent, seed=41).ok


def test_savevm_and_loadvm_with_sparse_ram(make_vm: VMFactory, tmp_path: Path) -> None:
    """Internal snapshots go through the same RAM code: with the capability left on,
    savevm skips unpopulated pages and loadvm (which discards RAM first, as a
    destination does) brings back exactly the saved data."""
    disk = tmp_path / "snap.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "64M"], check=True)
    drive = ["-drive", f"if=none,id=snapdisk,file={disk},format=qcow2"]
    vm = make_vm(patched("sparse-snap", memory=1 * GiB, extra_args=drive))
    migrate.set_capabilities(vm, SPARSE)
    workload.pattern_write(vm.agent, 64 * MiB, seed=51)

    assert vm.qmp("human-monitor-command", **{"command-line": "savevm snap1"}) == ""
    skipped = vm.qmp("query-migrate")["ram"]["sparse-skipped"]
    assert skipped > 0
    workload.pattern_write(vm.agent, 64 * MiB, seed=52)  # overwrite the same file
    assert not workload.pattern_verify(vm.agent, seed=51).ok

    assert vm.qmp("human-monitor-command", **{"command-line": "loadvm snap1"}) == ""
    vm.wait_agent(60)
    assert workload.pattern_verify(vm.agent, seed=51).ok
