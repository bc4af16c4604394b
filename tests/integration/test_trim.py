"""The guest reclaimer and host-driven trim, on real guests (docs/working-set.md).

The initramfs root is tmpfs, whose pages are not reclaimable page cache,
so the guests get a virtio-blk scratch disk and read it raw: /dev/vda's
pages are ordinary file LRU pages ("Buffers"), which is what the
reclaimer takes.  A block device's page cache is dropped when its last
opener closes it, so a sleeping process holds /dev/vda open, as a
mounted filesystem would.  The disk holds non-zero data, or a migration would send
its cached pages as zero pages and not show what trimming saves.

One detached guest serves the whole story, driven through the CLI as a
user would: read once, migrate untrimmed, migrate --trim, then switch
the background reclaimer on for a hot reader and under pressure.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import thinvm_cli
from thinvm.guest import trim, workload
from thinvm.guest.agent import AgentClient
from thinvm.host.memory import rss_bytes
from thinvm.testing.keptboot import KeptBootVM
from thinvm.units import GiB, MiB, format_size
from thinvm.vm.machine import VM, BalloonOptions, VMConfig

pytestmark = pytest.mark.guest

DISK = 640 * MiB  # read once: cold
HOT = 128 * MiB  # read again and again: the working set, above the floor's 64 MiB minimum
# Read for the background reclaimer: past DISK, never read before.  Pages
# a trim evicted and the guest reads again are refaults, which the
# reclaimer learns into its floor: they would not be a fresh cold cache.
COLD_AGAIN = 192 * MiB
PATTERN = 32 * MiB  # anonymous data that must arrive intact
SEED = 2020
PAGE = 4096


def page_cache(agent: AgentClient) -> int:
    """Buffers + Cached: a raw block device's pages count as Buffers."""
    info = workload.meminfo(agent)
    return info["Buffers"] + info["Cached"]


REFAULTS = "grep -E '^workingset_refault(_anon|_file)? ' /proc/vmstat"


def refaults(agent: AgentClient) -> int:
    return vmstat_sum(agent.check(REFAULTS).stdout)


def vmstat_sum(lines: str) -> int:
    return sum(int(line.split()[1]) for line in lines.splitlines())


def refaults_by_cli(env: dict[str, str], name: str) -> int:
    """refaults(), for a guest the CLI reaches (its agent is the CLI's)."""
    return vmstat_sum(cli(env, "exec", name, "--", "sh", "-c", REFAULTS).stdout)


SIZE = r"([\d.]+ (?:B|KiB|MiB|GiB))"


def size_of(text: str) -> int:
    """Undo format_size (to its two decimals)."""
    number, unit = text.split()
    return int(float(number) * {"B": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB}[unit])


def found(pattern: str, text: str) -> list[int]:
    match = re.search(pattern, text)
    assert match, f"no {pattern!r} in:\n{text}"
    return [size_of(group) for group in match.groups()]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = thinvm_cli(*args, env=env)
    assert proc.returncode == 0, f"thinvm {' '.join(args)} failed: {proc.stderr}"
    return proc


@pytest.fixture
def run_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A run directory of our own, for this process and the CLI's.

    Short on purpose: under pytest's tmp_path, a local migration's staging
    directory (.NAME.incoming-XXXXXXXX) puts the QMP socket past the 107
    bytes a UNIX socket path may have.
    """
    run = tempfile.mkdtemp(prefix="tt-", dir="/tmp")
    monkeypatch.setenv("THINVM_RUN", run)
    yield dict(os.environ)
    shutil.rmtree(run, ignore_errors=True)


def start_detached(name: str, config: VMConfig, env: dict[str, str]) -> VM:
    """`thinvm up` with options the CLI does not have (a disk, a cmdline)."""
    vm = KeptBootVM(config, rundir=Path(env["THINVM_RUN"]) / name, detached=True)
    vm.start()
    vm.save_state()
    vm.disconnect()
    return vm


def stop_detached(vm: VM, name: str, env: dict[str, str]) -> None:
    thinvm_cli("down", name, env=env)
    if vm.process is not None:  # our child until its first migration
        vm.process.kill()
        vm.process.wait()


def read_cold_and_hot(agent: AgentClient) -> tuple[int, dict[str, Any]]:
    """The guest writes its pattern, reads the disk once and its hot subset
    five more times; its page cache then, and its reclaimer's status (off:
    the busybox image starts without background reclaim)."""
    try:
        workload.hold_disk_open(agent)
        workload.pattern_write(agent, PATTERN, SEED)
        workload.read_disk(agent, DISK)  # once: all of it is cold
        # The hot subset, read five more times: MGLRU (6.12) protects page
        # cache read through read() from its fifth read on (its tier
        # counter saturates), the classic LRU (6.1) from its second.
        workload.read_disk(agent, HOT, passes=5)
        cache_read = page_cache(agent)
        assert cache_read >= DISK - 16 * MiB, format_size(cache_read)
        status = trim.reclaimer_status(agent)
        assert status is not None and status["available"], status
        assert not status["background"]  # off unless asked for
    finally:
        agent.close()
    return cache_read, status


# Classic LRU with the in-tree driver; MGLRU with ours (both report).
@pytest.mark.parametrize(("kernel", "driver"), [("6.1", "stock"), ("6.12", "thinvm")])
def test_trim_returns_cold_cache_keeps_hot_and_shrinks_migration(
    tmp_path: Path, run_env: dict[str, str], kernel: str, driver: str
) -> None:
    name = "trim"
    disk = workload.scratch_disk(tmp_path / "scratch.img", DISK + COLD_AGAIN)
    config = VMConfig(
        name=name,
        memory=1 * GiB,
        kernel=kernel,
        guest_driver=driver,
        balloon=BalloonOptions(free_page_reporting=True),
        extra_args=workload.disk_args(disk),
    )
    vm = start_detached(name, config, run_env)
    try:
        cache_read, status = read_cold_and_hot(AgentClient(str(vm.agent_socket)))

        # Untrimmed: the cold cache travels.
        out = cli(run_env, "migrate", name).stdout
        [untrimmed] = found(SIZE + " sent", out)
        moved = VM.attach(vm.rundir)
        try:
            assert workload.pattern_verify(moved.agent, SEED).ok
        finally:
            moved.disconnect()  # not `with`: leaving a VM's block shuts it down

        # Trimmed: the guest gives the cold cache back first.
        start = time.monotonic()
        out = cli(run_env, "migrate", "--trim", name).stdout
        seconds = time.monotonic() - start
        print(out)
        [trimmed] = found(SIZE + " sent", out)
        [reclaimed] = found("guest reclaimed " + SIZE, out)
        rss_before, rss_after, returned = found(
            f"host RSS {SIZE} -> {SIZE} \\({SIZE} returned", out
        )
        assert reclaimed >= 0.75 * (DISK - HOT), out
        # The host got most of it back before the migration started (the
        # rest was freed in blocks too fragmented to report)...
        assert returned >= 0.6 * (DISK - HOT), out
        # ...with our driver already when the guest answered (report_now:
        # the RSS read once, no settle wait), else at the kernel's pace.
        how = "reported at once" if driver == "thinvm" else "settled after"
        assert how in out, out
        # ...so the migration had much less to send.
        assert trimmed < 0.5 * untrimmed, f"untrimmed {untrimmed}: {out}"
        trims_back_to_back_keep_the_floor(run_env, name)
        moved = VM.attach(vm.rundir)
        try:
            agent = moved.agent
            assert workload.pattern_verify(agent, SEED).ok
            cache_trimmed = page_cache(agent)
            assert cache_trimmed <= HOT + 192 * MiB, format_size(cache_trimmed)
            # The guest kept its hot subset: reading it again refaults little,
            # with MGLRU (6.12) as with the classic LRU (6.1).
            before = refaults(agent)
            workload.read_disk(agent, HOT)
            hot_refaults = refaults(agent) - before
            print(f"hot refaults after the trim: {hot_refaults}; lru_gen {status['lru_gen']}")
            assert hot_refaults * PAGE < HOT // 4
            print(
                f"untrimmed {format_size(untrimmed)} sent, trimmed {format_size(trimmed)}; "
                f"migrate --trim took {seconds:.1f} s; host RSS {format_size(rss_before)} -> "
                f"{format_size(rss_after)}; page cache {format_size(cache_read)} -> "
                f"{format_size(cache_trimmed)}"
            )
            if status["lru_gen"]:
                # MGLRU hides the hot set from the active list the classic
                # LRU shows it in (and the suite's time is better spent once).
                assert moved.pid is not None
                background_keeps_hot_and_backs_off_under_pressure(agent, moved.pid)
        finally:
            moved.disconnect()

        refaults_between_trims_are_learned(run_env, name)
        # `thinvm trim` on its own, bounded in bytes, for scripts.
        result = trim_json(run_env, name, "16M")
        assert result["trimmed"] and result["guest"]["stop"] in ("max_bytes", "floor"), result
    finally:
        stop_detached(vm, name, run_env)


def trims_back_to_back_keep_the_floor(run_env: dict[str, str], name: str) -> None:
    """A host short of memory asks again every second (the controller
    does, bounded): trims back to back keep to the floor the first one
    held, not to an active list it had just deactivated, so they take
    next to nothing and the hot subset stays (the caller checks)."""
    again = [
        json.loads(cli(run_env, "trim", name, "--max-bytes", "64M", "--json").stdout)
        for _ in range(3)
    ]
    taken = sum(int(r["guest"]["reclaimed_bytes_trim"]) for r in again)
    print(f"three more trims took {format_size(taken)}: {[r['guest']['stop'] for r in again]}")
    assert taken < HOT // 4, again


def trim_json(env: dict[str, str], name: str, max_bytes: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        cli(env, "trim", name, "--max-bytes", max_bytes, "--json").stdout
    )
    return result


def refaults_between_trims_are_learned(run_env: dict[str, str], name: str) -> None:
    """Pages that come back between two trims were in use: the second
    trim adds them to the floor it keeps before it takes anything.  Each
    trim used to count only the refaults during its own steps: what came
    back between the trims a host asks for every few seconds went
    uncounted.  The disk's first 384 MiB (the hot subset and what the
    trims took after it) are evicted here behind the reclaimer's back
    (its floor would keep the hot subset) and read again; the kernel
    keeps the history of part of them only, so what came back is
    measured, not assumed."""
    learned = trim_json(run_env, name, "4M")["guest"]["learned_floor_bytes"]
    before = refaults_by_cli(run_env, name)
    evict_and_read_again = (
        "echo 1G > /sys/fs/cgroup/memory.reclaim 2>/dev/null; "
        f"dd if=/dev/vda of=/dev/null bs=1M count={3 * HOT // MiB} 2>/dev/null"
    )
    cli(run_env, "exec", name, "--", "sh", "-c", evict_and_read_again)
    came_back = (refaults_by_cli(run_env, name) - before) * PAGE
    guest = trim_json(run_env, name, "4M")["guest"]
    print(
        f"{format_size(came_back)} came back; learned floor {format_size(learned)} -> "
        f"{format_size(guest['learned_floor_bytes'])}; the trim took "
        f"{format_size(guest['reclaimed_bytes_trim'])}"
    )
    assert came_back >= 16 * MiB, "the eviction left nothing to come back"
    assert guest["learned_floor_bytes"] - learned >= came_back // 2, guest


def background_keeps_hot_and_backs_off_under_pressure(agent: AgentClient, qemu_pid: int) -> None:
    # Fresh cold cache for the background reclaimer to find.
    workload.read_disk(agent, COLD_AGAIN, skip=DISK)
    on = trim.set_background(agent, True)
    assert on is not None and on["background"]
    # It takes the cold pages while a reader keeps its hot subset.  How
    # fast depends on the machine: it steps at a 5 % duty cycle of a TCG
    # vCPU and waits after a step that met a stall, so the reader goes on
    # (4 s at a time) until 32 MiB came back, for at most a minute.
    before = refaults(agent)
    deadline = time.monotonic() + 60
    while True:
        agent.check(
            "end=$(($(date +%s) + 4)); while [ $(date +%s) -lt $end ]; do "
            f"dd if=/dev/vda of=/dev/null bs=1M count={HOT // MiB} 2>/dev/null; sleep 0.5; done"
        )
        counters = trim.reclaimer_status(agent)
        assert counters is not None
        background = counters["reclaimed_bytes"] - on["reclaimed_bytes"]
        if background >= 32 * MiB or time.monotonic() > deadline:
            break
    hot_refaults = refaults(agent) - before
    print(f"background reclaimed {format_size(background)}, hot refaults {hot_refaults}")
    assert background >= 32 * MiB, counters
    assert hot_refaults * PAGE < HOT // 4, f"{hot_refaults} refaults"

    # Pressure: anonymous memory takes all but ~160 MiB, and the reader
    # cycles through 256 MiB of disk, so its pages keep coming back.
    free = workload.meminfo(agent)["MemAvailable"]
    held = free - 160 * MiB
    hold = agent.check(f"thinvm-mem hold {held // MiB}").json()["pid"]
    try:
        agent.check(
            "end=$(($(date +%s) + 12)); while [ $(date +%s) -lt $end ]; do "
            "dd if=/dev/vda of=/dev/null bs=1M count=256 2>/dev/null; done"
        )
    finally:
        rss_held = rss_bytes(qemu_pid)
        agent.check(f"kill {hold}")
    freed_reaches_the_host_at_once(agent, qemu_pid, rss_held, held)
    after = trim.reclaimer_status(agent)
    assert after is not None
    print(f"reclaimer counters before pressure {counters}, after {after}")
    assert after["backoffs"] > counters["backoffs"], after
    assert after["refault_pages"] > counters["refault_pages"], after
    # Refaults are checked before stalls, and the reader brings back far
    # more than 1 MiB a second: the back-off kept what came back.
    assert after["learned_floor_bytes"] > 0, after
    trim.set_background(agent, False)


def freed_reaches_the_host_at_once(
    agent: AgentClient, qemu_pid: int, rss_held: int, held: int
) -> None:
    """The holder just exited: the background thread saw MemFree jump and
    had it reported now, where the kernel's own pace (a sixteenth of each
    free list every 2 s) takes up to 30 s for this much."""
    start = time.monotonic()
    while time.monotonic() - start < 5 and rss_held - rss_bytes(qemu_pid) < held // 2:
        time.sleep(0.2)
    returned = rss_held - rss_bytes(qemu_pid)
    counters = trim.reclaimer_status(agent)
    assert counters is not None
    print(
        f"freed {format_size(held)}: host RSS fell {format_size(returned)} in "
        f"{time.monotonic() - start:.1f} s; freed_reports {counters['freed_reports']}"
    )
    assert counters["freed_reports"] >= 1, counters
    assert returned >= held // 2, f"{format_size(returned)} of {format_size(held)} back in 5 s"


def test_guest_without_reclaimer_migrates_untrimmed(run_env: dict[str, str]) -> None:
    """A kernel without a memory controller cannot reclaim: trim says so
    in one line, and migrate --trim goes on without it."""
    name = "notrim"
    config = VMConfig(name=name, memory=512 * MiB, append="cgroup_disable=memory")
    vm = start_detached(name, config, run_env)
    try:
        proc = thinvm_cli("trim", name, env=run_env)
        assert proc.returncode == 1
        assert proc.stderr.startswith(f"thinvm: {name}: not trimmed: the guest has no usable ")
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        proc = cli(run_env, "migrate", "--trim", name)
        # One line about the trim; the others are migration progress.
        notes = [line for line in proc.stderr.splitlines() if "trim" in line]
        assert len(notes) == 1 and "not trimmed, migrating anyway" in notes[0], proc.stderr
        assert "migrated in" in proc.stdout
        assert cli(run_env, "exec", name, "echo", "here").stdout == "here\n"
    finally:
        stop_detached(vm, name, run_env)
