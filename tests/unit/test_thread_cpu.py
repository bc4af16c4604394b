"""CPU time per thread from /proc (thinvm.host.procs) and its split by QEMU thread kind."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from thinvm.bench import cpu
from thinvm.host import procs
from thinvm.host.procs import ThreadCpu, ThreadCpuSampler

TICKS = os.sysconf("SC_CLK_TCK")


def _task_stat(tid: int, comm: str, utime: int, stime: int, ppid: int = 1) -> str:
    # Fields 3.. of proc(5): state, ppid, pgrp, session, tty, tpgid, flags,
    # minflt, cminflt, majflt, cmajflt, utime, stime, then the rest.
    rest = " ".join(["0"] * 30)
    return f"{tid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} {rest}\n"


def _fake_proc(root: Path, pid: int, threads: dict[int, tuple[str, int, int]]) -> None:
    task = root / str(pid) / "task"
    for tid, (comm, utime, stime) in threads.items():
        (task / str(tid)).mkdir(parents=True, exist_ok=True)
        (task / str(tid) / "stat").write_text(_task_stat(tid, comm, utime, stime))


def _drop(root: Path, pid: int, tid: int) -> None:
    path = root / str(pid) / "task" / str(tid)
    (path / "stat").unlink()
    path.rmdir()


def test_parse_task_stat_reads_name_and_user_plus_system_time() -> None:
    thread = procs.parse_task_stat(_task_stat(7, "CPU 0/TCG", 150, 50), 100)
    assert thread == ThreadCpu("CPU 0/TCG", 2.0)
    # A name may hold spaces and parentheses.
    assert procs.parse_task_stat(_task_stat(7, "a) (b", 1, 2), 100).name == "a) (b"


def test_thread_cpu_lists_every_thread(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 42, {42: ("qemu-system-x86", 10, 0), 43: ("mig/src/main", 5, 5)})
    threads = procs.thread_cpu(42, tmp_path)
    assert threads == {
        42: ThreadCpu("qemu-system-x86", 10 / TICKS),
        43: ThreadCpu("mig/src/main", 10 / TICKS),
    }
    assert procs.thread_cpu(99, tmp_path) == {}


def _process_stat(root: Path, pid: int, ticks: int) -> None:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "stat").write_text(_task_stat(pid, "qemu-system-x86", ticks, 0))


def test_sampler_keeps_threads_that_exit_and_counts_new_ones_from_zero(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 1, {1: ("main", 100, 0), 2: ("CPU 0/TCG", 50, 0)})
    _process_stat(tmp_path, 1, 150)
    sampler = ThreadCpuSampler(1, interval=3600, proc=tmp_path, count_exits=False).start()
    # A multifd channel is born, works, is sampled, then exits before the end.
    _fake_proc(tmp_path, 1, {1: ("main", 110, 0), 3: ("mig/src/send_0", 30, 10)})
    sampler._sample()
    _drop(tmp_path, 1, 3)
    _fake_proc(tmp_path, 1, {1: ("main", 120, 0), 2: ("CPU 0/TCG", 60, 5)})
    # The process's own count also holds the channel's 6 ticks after its last sample.
    _process_stat(tmp_path, 1, 150 + 20 + 15 + 46)
    used = sampler.stop()
    assert used == {
        1: ThreadCpu("main", 20 / TICKS),
        2: ThreadCpu("CPU 0/TCG", 15 / TICKS),
        3: ThreadCpu("mig/src/send_0", 40 / TICKS),
    }
    assert sampler.exited == {3}
    assert not sampler.exact
    assert sampler.process_cpu_s == pytest.approx(81 / TICKS)


def test_sampler_samples_in_the_background(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 1, {1: ("main", 0, 0)})
    with ThreadCpuSampler(1, interval=0.01, proc=tmp_path, count_exits=False) as sampler:
        _fake_proc(tmp_path, 1, {5: ("mig/dst/recv_1", 7, 0)})
        deadline = time.monotonic() + 5
        while 5 not in sampler.used() and time.monotonic() < deadline:
            time.sleep(0.01)
        _drop(tmp_path, 1, 5)
    assert sampler.used()[5] == ThreadCpu("mig/dst/recv_1", 7 / TICKS)


def test_sampler_sees_a_busy_thread_of_this_process() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    with ThreadCpuSampler(os.getpid(), interval=0.02) as sampler:
        worker = threading.Thread(target=spin, name="spinner")
        worker.start()
        time.sleep(0.3)
        stop.set()
        worker.join()
    assert worker.native_id in sampler.used()
    assert sum(t.cpu_s for t in sampler.used().values()) > 0.05


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("CPU 0/TCG", "vcpu"),
        ("CPU 12/KVM", "vcpu"),
        ("ALL CPUs/TCG", "vcpu"),
        ("mig/src/main", "migration"),
        ("mig/src/return", "migration"),
        ("mig/dst/listen", "migration"),
        ("live_migration", "migration"),
        ("mig/src/send_0", "multifd"),
        ("mig/dst/recv_1", "multifd"),
        ("mig/src/send_12", "multifd"),  # "mig/src/send_123" in 15 characters
        ("postcopy/listen", "migration"),
        ("multifdsend_3", "multifd"),
        ("multifdrecv_0", "multifd"),
        ("qemu-system-x86", "other"),
        ("worker", "other"),
        ("call_rcu", "other"),
    ],
)
def test_thread_kind(name: str, kind: str) -> None:
    assert cpu.thread_kind(name) == kind


def test_cpu_metrics_sum_by_kind() -> None:
    used = {
        1: ThreadCpu("qemu-system-x86", 0.5),
        2: ThreadCpu("CPU 0/TCG", 1.0),
        3: ThreadCpu("mig/src/main", 0.25),
        4: ThreadCpu("mig/src/send_0", 0.125),
        5: ThreadCpu("mig/src/send_1", 0.125),
    }
    assert cpu.cpu_metrics("src", used) == {
        "src_cpu_s": 2.0,
        "src_migration_cpu_s": 0.25,
        "src_vcpu_cpu_s": 1.0,
        "src_multifd_cpu_s": 0.25,
        "src_other_cpu_s": 0.5,
        "src_cpu_split_exact": 0,
    }
    assert list(cpu.cpu_metrics("dst", {})) == cpu.metric_names("dst")


def test_what_exited_threads_used_after_their_last_sample_goes_to_their_kind() -> None:
    used = {
        1: ThreadCpu("qemu-system-x86", 0.5),
        3: ThreadCpu("mig/src/send_0", 0.25),
        4: ThreadCpu("mig/src/main", 0.75),
    }
    # The process used 2.0 s: 0.5 s more than its threads showed, all in the
    # multifd channel and the migration thread, which exited (1:3 seen).
    metrics = cpu.cpu_metrics("src", used, process_s=2.0, exited={3, 4})
    assert metrics["src_cpu_s"] == 2.0
    assert metrics["src_multifd_cpu_s"] == 0.375
    assert metrics["src_migration_cpu_s"] == 1.125
    assert metrics["src_other_cpu_s"] == 0.5
    # No thread exited: the rest (tick rounding) is other's.
    assert cpu.cpu_metrics("dst", used, process_s=1.6)["dst_other_cpu_s"] == 0.6
    # Less in the process than in its threads (read at another instant): no residue.
    assert cpu.cpu_metrics("dst", used, process_s=1.0)["dst_cpu_s"] == 1.5


def test_with_exact_exits_the_rest_is_rounding_and_goes_to_other() -> None:
    used = {1: ThreadCpu("qemu-system-x86", 0.5), 3: ThreadCpu("mig/src/send_0", 0.25)}
    metrics = cpu.cpu_metrics("src", used, process_s=0.8, exited={3}, exact=True)
    assert metrics["src_multifd_cpu_s"] == 0.25
    assert metrics["src_other_cpu_s"] == 0.55
    assert metrics["src_cpu_split_exact"] == 1


def test_migration_cpu_reports_both_sides_of_this_process() -> None:
    with cpu.MigrationCpu(os.getpid(), os.getpid()) as measured:
        measured.src_done()
    assert set(measured.metrics) == set(cpu.metric_names("src") + cpu.metric_names("dst"))
    with cpu.MigrationCpu(None, os.getpid()) as dst_only:
        pass
    assert set(dst_only.metrics) == set(cpu.metric_names("dst"))


def test_processes_named_and_descends_from(tmp_path: Path) -> None:
    for pid, comm, ppid in ((10, "bash", 1), (11, "qemu-system-x86", 10), (12, "qemu-img", 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_task_stat(pid, comm, 0, 0, ppid))
    # A QEMU that exited and waits to be reaped is no QEMU running.
    (tmp_path / "13").mkdir()
    (tmp_path / "13" / "stat").write_text(
        _task_stat(13, "qemu-system-x86", 0, 0, 1).replace(") S ", ") Z ")
    )
    (tmp_path / "self").mkdir()
    assert procs.processes_named("qemu-system", tmp_path) == {11: 10}
    assert procs.descends_from(11, 10, tmp_path)
    assert not procs.descends_from(12, 10, tmp_path)
    assert procs.descends_from(os.getpid(), os.getppid())


# A process whose thread named like a multifd channel burns `burn_s` of CPU
# and exits when told to; "done" once it has gone.
_SHORT_THREAD_CHILD = """
import os, sys, threading, time

def channel():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write(sys.argv[2])
    end = time.thread_time() + float(sys.argv[1])
    while time.thread_time() < end:
        pass

print("ready", flush=True)
sys.stdin.readline()
thread = threading.Thread(target=channel)
thread.start()
thread.join()
# join() returns before the kernel has reaped the thread: wait until it has.
while os.path.exists(f"/proc/self/task/{thread.native_id}"):
    time.sleep(0.001)
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_thread_that_exits_between_two_samples_counts_under_its_own_kind() -> None:
    # The sampler never samples between start and stop here: whatever the
    # thread used, only its exit tells.  Before exit accounting it landed
    # in "other" (a fast migration's channels did, between two 100 ms samples).
    child = subprocess.Popen(
        [sys.executable, "-c", _SHORT_THREAD_CHILD, "0.05", "mig/src/send_0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        with ThreadCpuSampler(child.pid, interval=3600) as sampler:
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "done\n"
        used = sampler.used()
        metrics = cpu.cpu_metrics("src", used, sampler.process_cpu_s, sampler.exited, sampler.exact)
    finally:
        child.kill()
        child.wait()
    assert sampler.exact, sampler.exit_error
    assert metrics["src_cpu_split_exact"] == 1
    assert metrics["src_multifd_cpu_s"] is not None and metrics["src_multifd_cpu_s"] >= 0.04
    assert metrics["src_other_cpu_s"] is not None and metrics["src_other_cpu_s"] < 0.04
