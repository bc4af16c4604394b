"""The balance controller against real guests under QEMU (TCG, 1 GiB each).

The controller runs in the test's thread (QMP monitors are not shared
between threads); guest workloads run through the agent in a helper
thread.  Assertions are on balloon `actual`, host RSS of the QEMU
processes and the guest's own OOM-kill counter.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import VMFactory
from thinvm.balance.backends import GivenVmsBackend, RssBudget, WholeHost
from thinvm.balance.daemon import STATE_VERSION, Controller, CycleReport, load_status
from thinvm.balance.model import VmLimits, VmState
from thinvm.balance.policies import ThinvmPolicy
from thinvm.guest import workload
from thinvm.paths import REPO, run_dir
from thinvm.testing.keptboot import KeptBootVM
from thinvm.units import GiB, MiB, format_size
from thinvm.vm import balloon, resize
from thinvm.vm.machine import VM, BalloonOptions, VMConfig

pytestmark = pytest.mark.guest

FLOOR = 256 * MiB


def guest_config(name: str, kernel: str = "6.1") -> VMConfig:
    # No free page reporting: memory a guest frees stays on the host until
    # the balloon takes it, so RSS shows what the controller did.
    return VMConfig(name=name, memory=1 * GiB, kernel=kernel, balloon=BalloonOptions(enabled=True))


def oom_kills(vm: VM) -> int:
    counters = workload.vmstat(vm.agent)
    assert "oom_kill" in counters, "guest /proc/vmstat has no oom_kill"
    return counters["oom_kill"]


def controller(vms: list[VM], host: object | None = None, **kw: object) -> Controller:
    lines: list[str] = []
    ctl = Controller(
        GivenVmsBackend(vms),
        host or WholeHost(),  # type: ignore[arg-type]
        ThinvmPolicy(),
        interval=1.0,
        default_limits=lambda size: VmLimits(FLOOR, size),
        log=lines.append,
        **kw,  # type: ignore[arg-type]
    )
    ctl.lines = lines  # type: ignore[attr-defined]
    return ctl


def drive(
    ctl: Controller, timeout: float, until: Callable[[CycleReport], bool] | None = None
) -> list[CycleReport]:
    """Run cycles every interval until `until(report)` or the timeout."""
    reports: list[CycleReport] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = time.monotonic()
        reports.append(ctl.step())
        if until is not None and until(reports[-1]):
            return reports
        time.sleep(max(0.0, ctl.interval - (time.monotonic() - started)))
    if until is not None:
        raise AssertionError(f"not reached in {timeout:.0f} s; last: {reports[-1]}")
    return reports


def actual_of(report: CycleReport, name: str) -> int:
    sample = next(s for s in report.samples if s.name == name)
    assert sample.actual is not None
    return sample.actual


def in_background(func: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            func()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, errors


def grow_in_steps(vm: VM, steps: int, step_mib: int, pause: float) -> None:
    """A workload whose working set grows `step_mib` at a time and is held."""
    for i in range(steps):
        vm.agent.check(f"thinvm-mem hold {step_mib} --pidfile /run/grow-{i}.pid", timeout=120)
        time.sleep(pause)


def test_freed_memory_is_ballooned_down_and_given_back_before_the_guest_stalls(
    make_vm: VMFactory,
) -> None:
    vm = make_vm(guest_config("bal-a"))
    balloon.enable_stats(vm, 1)
    # The guest uses 600 MiB, then frees it: the host keeps the pages (no reporting).
    workload.touch(vm.agent, 600 * MiB)
    rss_before = vm.host_memory().rss
    ctl = controller([vm])
    started = time.monotonic()
    reports = drive(ctl, 90, until=lambda r: actual_of(r, "bal-a") <= 450 * MiB)
    shrink_seconds = time.monotonic() - started
    rss_low = vm.host_memory().rss
    assert rss_before - rss_low >= 400 * MiB, (
        f"host RSS {format_size(rss_before)} -> {format_size(rss_low)}"
    )
    # The controller never asks for less than the floor.
    assert min(actual_of(r, "bal-a") for r in reports) >= FLOOR

    # Now the guest's working set grows to 512 MiB, 64 MiB every 2 s.
    low = actual_of(reports[-1], "bal-a")
    thread, errors = in_background(lambda: grow_in_steps(vm, 8, 64, 2.0))
    # Until the workload is done and the controller has caught up with its
    # last step (one cycle behind it under load: 429 -> 824 MiB once, at
    # the moment the workload ended); never at the guest's expense, which
    # the workload's errors and the OOM count below would show.
    grown = low + 400 * MiB
    drive(ctl, 120, until=lambda r: not thread.is_alive() and actual_of(r, "bal-a") >= grown)
    thread.join()
    assert not errors, f"guest workload failed: {errors[0]}"
    final = balloon.query(vm).actual
    assert final >= grown, f"actual {format_size(low)} -> {format_size(final)}"
    assert oom_kills(vm) == 0
    alive = "for f in /run/grow-*.pid; do kill -0 $(cat $f) && echo up; done | wc -l"
    held = int(vm.agent.check(alive).stdout)
    assert held == 8  # every holder is still alive: nothing was killed
    print(f"shrunk to {format_size(low)} in {shrink_seconds:.1f} s; grew to {format_size(final)}")


def test_virtio_mem_guest_is_unplugged_when_it_frees_memory_and_plugged_when_it_grows(
    make_vm: VMFactory,
) -> None:
    """512 MiB base + 1 GiB virtio-mem, all plugged.  The controller shrinks
    the guest through requested-size (the balloon never moves), the host
    gets the unplugged memory back, and the guest gets it again when it
    allocates, without an OOM kill."""
    base, vmem = 512 * MiB, 1 * GiB
    config = VMConfig(
        name="bal-vmem", memory=base, virtio_mem=vmem, virtio_mem_plugged=vmem,
        balloon=BalloonOptions(enabled=True),
    )  # fmt: skip
    vm = make_vm(config)
    resize.wait_plugged(vm, vmem)
    balloon.enable_stats(vm, 1)
    # Back all of it on the host, then free it (no reporting: the host keeps it).
    workload.touch_free_memory(vm.agent)
    rss_before = vm.host_memory().rss
    ctl = controller([vm])
    started = time.monotonic()
    reports = drive(ctl, 60, until=lambda _r: resize.virtio_mem_status(vm).plugged == 0)
    shrink_seconds = time.monotonic() - started
    sample = reports[-1].samples[0]
    assert sample.lever == "virtio-mem" and sample.virtio_mem is not None
    # Never below the base memory, though the floor given is 256 MiB.
    assert min(actual_of(r, "bal-vmem") for r in reports) >= base
    assert balloon.query(vm).actual == base, "the balloon moved"
    dropped = rss_before - vm.host_memory().rss
    assert dropped >= 0.75 * vmem, f"host RSS dropped by only {format_size(dropped)}"

    # The guest's working set grows by 512 MiB, 64 MiB every 2 s.
    thread, errors = in_background(lambda: grow_in_steps(vm, 8, 64, 2.0))
    drive(ctl, 90, until=lambda _r: not thread.is_alive())
    thread.join()
    assert not errors, f"guest workload failed: {errors[0]}"
    plugged = resize.virtio_mem_status(vm).plugged
    assert plugged >= 384 * MiB, f"only {format_size(plugged)} plugged again"
    assert balloon.query(vm).actual == base, "the balloon moved"
    assert oom_kills(vm) == 0
    alive = "for f in /run/grow-*.pid; do kill -0 $(cat $f) && echo up; done | wc -l"
    assert int(vm.agent.check(alive).stdout) == 8  # every holder is still alive
    print(
        f"unplugged {format_size(vmem)} in {shrink_seconds:.1f} s (host RSS -"
        f"{format_size(dropped)}); plugged {format_size(plugged)} again"
    )


def test_host_pressure_reclaims_from_the_idle_guest_not_the_busy_one(
    make_vm: VMFactory,
) -> None:
    idle = make_vm(guest_config("bal-idle"))
    busy = make_vm(guest_config("bal-busy"))
    for vm in (idle, busy):
        balloon.enable_stats(vm, 1)
    # Both have touched 700 MiB, so together they hold more than the budget.
    workload.touch(idle.agent, 700 * MiB)
    workload.touch(busy.agent, 700 * MiB)
    pids = [vm.pid for vm in (idle, busy) if vm.pid is not None]
    budget = RssBudget(1536 * MiB, lambda: pids)
    assert budget.used() > budget.limit - 256 * MiB, "the budget is not tight"
    ctl = controller([idle, busy], host=budget)
    # The busy guest grows 96 MiB every 2 s from the start.
    thread, errors = in_background(lambda: grow_in_steps(busy, 6, 96, 2.0))
    reports = drive(ctl, 150, until=lambda _r: not thread.is_alive())
    thread.join()
    assert not errors, f"busy guest's workload failed: {errors[0]}"
    shrinks = [
        (r.cycle, d)
        for r in reports
        for d in r.decisions
        if d.acts and d.target is not None and d.target < actual_of(r, d.vm)
    ]
    assert not [s for s in shrinks if s[1].vm == "bal-busy"], f"busy guest shrunk: {shrinks}"
    assert [s for s in shrinks if s[1].vm == "bal-idle"]
    assert actual_of(reports[-1], "bal-idle") <= 512 * MiB
    assert balloon.query(busy).actual >= 1 * GiB - 64 * MiB
    assert oom_kills(busy) == 0 and oom_kills(idle) == 0
    used = budget.used()
    assert used <= budget.limit + 64 * MiB, f"guests hold {format_size(used)} over the budget"


def test_under_pressure_a_reporting_guest_trims_its_cold_cache_before_any_balloon(
    make_vm: VMFactory, tmp_path: Path
) -> None:
    """Trim first: the guest read its disk once and holds that cache; the
    host is short (not critical).  The controller switches the guest's
    reclaimer on and asks it to trim; reporting hands the cache back, so
    host RSS falls while the balloon never moves."""
    disk = workload.scratch_disk(tmp_path / "cold.img", 448 * MiB)
    config = VMConfig(
        name="bal-trim",
        memory=768 * MiB,
        balloon=BalloonOptions(free_page_reporting=True),
        extra_args=workload.disk_args(disk),
    )
    vm = make_vm(config)
    balloon.enable_stats(vm, 1)
    workload.hold_disk_open(vm.agent)
    workload.read_disk(vm.agent, 448 * MiB)  # read once: cold
    cache_before = workload.meminfo(vm.agent)["Buffers"]
    assert cache_before >= 400 * MiB, format_size(cache_before)
    pid = vm.pid
    assert pid is not None
    rss_before = vm.host_memory().rss
    # 96 MiB available: under the 128 MiB reserve (pressure), above half
    # of it (not critical), so only trimming may act.
    budget = RssBudget(rss_before + 96 * MiB, lambda: [pid])
    ctl = controller([vm], host=budget)
    reports = drive(ctl, 90, until=lambda _r: vm.host_memory().rss <= rss_before - 256 * MiB)
    ctl.backend.close()  # waits for a trim still in flight
    rss_after = vm.host_memory().rss
    cache_after = workload.meminfo(vm.agent)["Buffers"]
    print("\n".join(ctl.lines))  # type: ignore[attr-defined]
    print(
        f"host RSS {format_size(rss_before)} -> {format_size(rss_after)}, guest cache "
        f"{format_size(cache_before)} -> {format_size(cache_after)} in {len(reports)} cycles"
    )
    assert ctl.trims >= 1
    assert any(d.reclaim for r in reports for d in r.decisions), "reclaimer never switched on"
    assert not [d for r in reports for d in r.decisions if d.acts], "the balloon was used"
    assert balloon.query(vm).actual == 768 * MiB
    assert cache_after <= cache_before - 256 * MiB


# -- (c) kill and restart the real `thinvm balance run` ----------------------


@contextlib.contextmanager
def started_detached(configs: list[VMConfig]) -> Iterator[list[VM]]:
    """Detached VMs (as `thinvm up` makes them), killed and removed after."""
    vms: list[VM] = []
    try:
        for config in configs:
            vm = KeptBootVM(config, rundir=run_dir() / config.name, detached=True)
            vms.append(vm)
            vm.start()
            vm.save_state()
            # As `thinvm up` leaves it: no connection of ours stays open.
            vm.disconnect()
        yield vms
    finally:
        for vm in vms:
            vm.kill()
            shutil.rmtree(vm.rundir, ignore_errors=True)


@pytest.fixture
def detached_vms() -> Iterator[list[VM]]:
    """Two detached VMs with names unique to this run."""
    configs = [guest_config(f"baltest-{os.getpid()}-{suffix}") for suffix in ("x", "y")]
    with started_detached(configs) as vms:
        yield vms


def controller_args(names: list[str], state: Path) -> list[str]:
    args = [sys.executable, "-m", "thinvm.cli", "balance", "run", "--interval", "1"]
    # --verbose: a failure's log tail then says why each cycle held.
    args += ["--state", str(state), "--floor", "256M", "--verbose"]
    for name in names:
        args += ["--vm", name]
    return args


def start_controller(names: list[str], state: Path, log: Path) -> subprocess.Popen[bytes]:
    args = controller_args(names, state)
    out = open(log, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def wait_for_line(log: Path, text: str, timeout: float, after: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.read_text()[after:].count(text):
            return
        time.sleep(0.05)
    tail = log.read_text()[-2000:]
    raise AssertionError(f"no {text!r} in the controller log within {timeout:.0f} s:\n{tail}")


@contextlib.contextmanager
def qmp_of(vm: VM) -> Iterator[VM]:
    """A QMP connection of our own, beside the controller's."""
    attached = VM.attach(vm.rundir)
    try:
        yield attached
    finally:
        attached.disconnect()


def settle(vm: VM, quiet: float = 3.0, timeout: float = 60.0) -> int:
    """`actual` once it has not moved for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    last, since = balloon.query(vm).actual, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = balloon.query(vm).actual
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise AssertionError(f"{vm.config.name}: balloon did not settle")


def targets_sent(log: str, name: str) -> set[str]:
    """The targets the controller's log says it sent to `name` (as printed)."""
    sent = set()
    for line in log.splitlines():
        if f" {name}: set " in line or f" {name}: resume: target " in line:
            if ": set " in line:
                sent.add(line.split(" -> ", 1)[1].split(":", 1)[0])
            else:
                sent.add(line.split("target ", 1)[1].split(" re-sent", 1)[0])
    return sent


def test_killed_controller_leaves_valid_targets_and_a_restart_resumes(
    detached_vms: list[VM], tmp_path: Path
) -> None:
    names = [vm.config.name for vm in detached_vms]
    for vm in detached_vms:
        workload.touch(vm.agent, 600 * MiB)
    state, log = tmp_path / "state.json", tmp_path / "balance.log"
    log.write_text("")
    proc = start_controller(names, state, log)
    try:
        wait_for_line(log, ": set ", 90)  # the first target is on its way
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = load_status(state)
    assert any(saved["vms"][n]["target"] is not None for n in names)
    # Every guest runs on, and its balloon settles at a target the
    # controller sent (or the one it started with): never half of one.
    for machine in detached_vms:
        assert machine.agent.ping()
        with qmp_of(machine) as vm:
            assert vm.qmp("query-status")["status"] == "running"
            settled = settle(vm)
        assert FLOOR <= settled <= 1 * GiB
        sent = targets_sent(log.read_text(), machine.config.name)
        assert format_size(settled) in {*sent, format_size(1 * GiB)}, (settled, sent)
        saved_target = saved["vms"][machine.config.name]["target"]
        if saved_target is not None:
            assert format_size(saved_target) in {*sent, format_size(1 * GiB)} or (
                settled > saved_target  # written, then killed before sending
            )

    before = len(log.read_text())
    proc = start_controller(names, state, log)
    try:
        wait_for_line(log, "resumed at cycle", 30, after=before)
        # The same QEMUs: each remembered target is known to be there, or
        # sent again, or (if the guest cannot afford it now) dropped; the
        # saved state itself is kept.
        for name in names:
            if saved["vms"][name]["target"] is not None:
                wait_for_line(log, f" {name}: resume: ", 30, after=before)
        assert "saved state dropped" not in log.read_text()[before:]
        # ~15 s when the host is quiet; a loaded CI host delays the guests'
        # statistics, and the policy shrinks only on current ones.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            time.sleep(1)
            vms = load_status(state)["vms"]
            if all(vms[name]["actual"] <= 450 * MiB for name in names):
                break
        else:
            actual = {name: format_size(vms[name]["actual"]) for name in names}
            tail = log.read_text()[before:][-3000:]
            raise AssertionError(
                f"the restarted controller did not carry on shrinking: {actual}\n{tail}"
            )
        # Where it stops, an idle guest stays: shrunk to a headroom of free
        # memory, not of available memory, a guest with THP's watermarks
        # counted as tight and was deflated again, round after round.
        time.sleep(10)
        vms = load_status(state)["vms"]
        assert all(vms[name]["actual"] <= 450 * MiB for name in names), vms
        assert "deflate at once" not in log.read_text()[before:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    # SIGTERM ends the loop between cycles, without a traceback.
    stopped = log.read_text()[before:]
    assert "balance: stopped by SIGTERM" in stopped and "Traceback" not in stopped, stopped[-3000:]
    status = load_status(state)
    assert status["cycle"] > saved["cycle"]
    for vm in detached_vms:
        assert vm.agent.ping()
        assert oom_kills(vm) == 0


# -- the controller survives its guests and its own restarts -------------------


def test_a_guest_agent_answering_garbage_does_not_stop_the_controller(tmp_path: Path) -> None:
    """`balance run --cycles 2` over two VMs, one of whose agents answers
    RECLAIM status with a counter that is not a number: that VM's error
    is logged with its name and counted, and both VMs are served."""
    from tests.unit.test_balance_failures import GARBAGE_COUNTERS, FakeAgent, json_reply

    bad = VMConfig(
        name=f"balbad-{os.getpid()}",
        memory=1 * GiB,
        balloon=BalloonOptions(free_page_reporting=True),  # the reclaimer is asked
    )
    good = guest_config(f"balgood-{os.getpid()}")
    with started_detached([bad, good]) as vms:
        # The controller reaches the guest agent through the VM's socket:
        # put a fake agent there, QEMU's own aside.
        sock = vms[0].agent_socket
        sock.rename(sock.with_name("agent.sock.qemu"))
        agent = FakeAgent(sock, json_reply(GARBAGE_COUNTERS))
        try:
            state = tmp_path / "state.json"
            done = subprocess.run(
                [*controller_args([bad.name, good.name], state), "--cycles", "2"],
                cwd=REPO, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        finally:
            agent.close()
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert agent.requests and agent.requests[0] == "RECLAIM status"
    error = f"{bad.name}: guest reclaimer ignored: available 1 is not true or false"
    assert f"cycle 0 {error}" in done.stdout, done.stdout
    status = load_status(state)
    assert status["cycle"] == 1 and status["error_count"] >= 1
    assert set(status["vms"]) == {bad.name, good.name}
    for vm in status["vms"].values():
        assert vm["actual"] == 1 * GiB


def test_a_restart_does_not_squeeze_a_vm_recreated_under_the_same_name(
    tmp_path: Path,
) -> None:
    """A state file remembers `g` at 256 MiB; `g` is now another VM, of
    1 GiB, holding 800 MiB.  `balance run --cycles 1` sends it nothing: no
    OOM kill, and the balloon stays where the guest put it, during the
    cycle and after the controller has exited."""
    name = f"balnew-{os.getpid()}"
    with started_detached([guest_config(name)]) as (vm,):
        vm.agent.check("thinvm-mem hold 800 --pidfile /run/hold.pid", timeout=120)
        with qmp_of(vm) as machine:
            balloon.enable_stats(machine, 1)  # as a controller left it
        time.sleep(2)  # the guest's first statistics report
        old = {"max_memory": 1 * GiB, "identity": "pid 4242 started 77",
               "state": VmState(target=256 * MiB, calm_cycles=10).to_json()}  # fmt: skip
        state = tmp_path / "state.json"
        state.write_text(json.dumps({
            "version": STATE_VERSION, "policy": "thinvm", "cycle": 41, "actions": 7,
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "vms": {name: old},
        }))  # fmt: skip
        with qmp_of(vm) as machine:
            lowest = [balloon.query(machine).actual]
            proc = subprocess.Popen(
                [*controller_args([name], state), "--cycles", "1"],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            # While it runs and 5 s after: long enough for a balloon asked
            # to shrink to get going (under TCG, ~100 MiB a second).
            deadline = None
            while deadline is None or time.monotonic() < deadline:
                lowest.append(balloon.query(machine).actual)
                if deadline is None and proc.poll() is not None:
                    deadline = time.monotonic() + 5
                time.sleep(0.05)
        out = proc.communicate()[0]
        assert min(lowest) == 1 * GiB, f"the balloon went to {format_size(min(lowest))}\n{out}"
        assert oom_kills(vm) == 0
        assert vm.agent.check("kill -0 $(cat /run/hold.pid) && echo up").stdout.strip() == "up"
    assert proc.returncode == 0, out
    assert f"{name}: resume: saved state dropped: another VM under this name" in out, out
