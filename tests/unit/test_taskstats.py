"""Exit records from the kernel's taskstats (thinvm.host.taskstats): the wire format
from made-up bytes, the listener against this machine's kernel."""

import os
import struct
import subprocess
import sys
import threading
import time

import pytest

from thinvm.host import taskstats
from thinvm.host.procs import ThreadCpuSampler
from thinvm.host.taskstats import ExitListener, TaskExit, TaskstatsUnavailable

# Offsets from include/uapi/linux/taskstats.h, as offsetof() gives them on x86-64.
_SIZE_V13 = 416


def _stats(
    *,
    version: int = 13,
    comm: bytes = b"mig/src/send_1",
    pid: int = 101,
    tgid: int = 100,
    runtime_ns: int = 52_345_678,
    utime_us: int = 40_000,
    stime_us: int = 8_000,
) -> bytes:
    data = bytearray(_SIZE_V13)
    struct.pack_into("=H", data, 0, version)
    struct.pack_into("=Q", data, 72, runtime_ns)  # cpu_run_virtual_total
    data[80 : 80 + len(comm)] = comm  # ac_comm
    struct.pack_into("=I", data, 128, pid)  # ac_pid
    struct.pack_into("=QQ", data, 152, utime_us, stime_us)  # ac_utime, ac_stime
    struct.pack_into("=I", data, 368, tgid)  # ac_tgid
    return bytes(data)


def test_parse_taskstats_reads_the_thread_its_process_name_and_runtime() -> None:
    record = taskstats.parse_taskstats(_stats())
    assert record == TaskExit(tid=101, tgid=100, name="mig/src/send_1", cpu_s=0.052346)


def test_without_delay_accounting_the_user_and_system_ticks_stand_in() -> None:
    assert taskstats.parse_taskstats(_stats(runtime_ns=0)).cpu_s == 0.048


def test_a_kernel_whose_records_do_not_name_the_process_is_refused() -> None:
    with pytest.raises(TaskstatsUnavailable, match=r"version 11 .* estimated"):
        taskstats.parse_taskstats(_stats(version=11))


def test_exits_in_takes_each_thread_and_leaves_the_process_sum_out() -> None:
    # What the kernel sends as a process's last thread exits: the thread's
    # record (a NULL attribute pads the stats to 8 bytes), then the sum.
    thread = taskstats.attribute(
        taskstats.TASKSTATS_TYPE_AGGR_PID,
        taskstats.attribute(taskstats.TASKSTATS_TYPE_PID, struct.pack("=I", 101))
        + taskstats.attribute(6, b"")
        + taskstats.attribute(taskstats.TASKSTATS_TYPE_STATS, _stats()),
    )
    process = taskstats.attribute(
        5,  # TASKSTATS_TYPE_AGGR_TGID
        taskstats.attribute(2, struct.pack("=I", 100))
        + taskstats.attribute(taskstats.TASKSTATS_TYPE_STATS, _stats(pid=100, comm=b"qemu")),
    )
    message = taskstats.genl_request(0x1C, taskstats.TASKSTATS_CMD_NEW, thread + process, seq=0)
    ((kind, seq, payload),) = taskstats.parse_messages(message)
    assert (kind, seq) == (0x1C, 0)
    assert [r.name for r in taskstats.exits_in(payload)] == ["mig/src/send_1"]
    # Anything but TASKSTATS_CMD_NEW holds no records.
    assert taskstats.exits_in(bytes([taskstats.TASKSTATS_CMD_GET]) + payload[1:]) == []


def _burn(name: str, seconds: float) -> None:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
        comm.write(name)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_listener_hears_a_thread_of_its_process_exit_with_its_name_and_cpu() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import threading; threading.Thread().start()"])
    with ExitListener({os.getpid()}) as listener:
        worker = threading.Thread(target=_burn, args=("mig/dst/recv_3", 0.03))
        worker.start()
        worker.join()
        other.wait()
        while os.path.exists(f"/proc/self/task/{worker.native_id}"):
            time.sleep(0.001)
    records = listener.close()
    assert not listener.lost
    assert worker.native_id is not None
    record = records[worker.native_id]
    assert (record.tgid, record.name) == (os.getpid(), "mig/dst/recv_3")
    assert 0.03 <= record.cpu_s < 1
    # Other processes' threads are not kept.
    assert {r.tgid for r in records.values()} == {os.getpid()}


def test_close_returns_at_once_with_what_exited_before_it() -> None:
    """close() wakes the receiving thread instead of waiting out its receive
    timeout (a migration's CPU figures are timed across it), and what
    exited just before it is still counted, by the drain."""
    listener = ExitListener({os.getpid()}).open()
    time.sleep(0.05)  # the receiving thread waits in select()
    worker = threading.Thread(target=_burn, args=("close-race", 0.01))
    worker.start()
    worker.join()
    while os.path.exists(f"/proc/self/task/{worker.native_id}"):
        time.sleep(0.001)
    start = time.monotonic()
    records = listener.close()
    assert time.monotonic() - start < 0.05
    assert worker.native_id in records


def test_without_root_the_listener_says_why_and_the_sampler_estimates() -> None:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(read)
        os.setgid(65534)
        os.setuid(65534)
        sampler = ThreadCpuSampler(os.getpid()).start()
        sampler.stop()
        os.write(write, f"{int(sampler.exact)} {sampler.exit_error}".encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        exact, _, error = answer.read().partition(" ")
    os.waitpid(child, 0)
    assert exact == "0"
    assert "needs root" in error and "estimated" in error
