"""Pure parsers of thinvm.host: PSI, mounts, /proc/PID/stat, cgroup files."""

import os
from pathlib import Path

import pytest

from thinvm.host import cgroups, pressure, procs
from thinvm.host.memory import parse_vmstat
from thinvm.host.mounts import Mount, containing_mount, parse_mounts, unescape
from thinvm.host.pressure import Psi, parse_psi, read_cgroup_psi, read_psi

# -- pressure ------------------------------------------------------------------

HOST_PSI = (
    "some avg10=12.50 avg60=1.00 avg300=0.25 total=987654\n"
    "full avg10=3.00 avg60=0.50 avg300=0.00 total=1234\n"
)


def test_psi_with_full_line() -> None:
    assert parse_psi(HOST_PSI) == Psi(12.5, 1.0, 0.25, 987654, 3.0, 0.5, 0.0, 1234)


def test_psi_without_full_line() -> None:
    psi = parse_psi("some avg10=0.00 avg60=0.10 avg300=0.20 total=5\n")
    assert psi == Psi(0.0, 0.1, 0.2, 5, None, None, None, None)


def test_psi_order_of_lines_and_keys_does_not_matter() -> None:
    text = "full total=1 avg300=0 avg60=0 avg10=2.5\nsome total=7 avg10=1 avg300=3 avg60=2\n"
    assert parse_psi(text) == Psi(1.0, 2.0, 3.0, 7, 2.5, 0.0, 0.0, 1)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "full avg10=1.00 avg60=0 avg300=0 total=1\n",  # no some line
        "some avg10=1.00 avg60=0 total=1\n",  # some lacks avg300
        "some avg10=x avg60=0 avg300=0 total=1\n",
        "some avg10=1 avg60=0 avg300=0 total=1.5\n",  # total is an integer
        "some avg10=1 avg60=0 avg300=0 total=1\nfull avg10=1 avg60=0 total=1\n",  # full incomplete
        "not a pressure file\n",
    ],
)
def test_malformed_psi_is_none(text: str) -> None:
    assert parse_psi(text) is None


def test_read_psi_missing_file_is_none(tmp_path: Path) -> None:
    assert read_psi(str(tmp_path / "nope")) is None
    assert read_cgroup_psi(tmp_path) is None  # cgroup v1: no memory.pressure


def test_read_cgroup_psi(tmp_path: Path) -> None:
    (tmp_path / "memory.pressure").write_text(HOST_PSI)
    psi = read_cgroup_psi(tmp_path)
    assert psi is not None and psi.full_total_us == 1234


def test_host_psi_parses_where_the_kernel_has_it() -> None:
    if not Path(pressure.PSI_MEMORY).exists():
        pytest.skip("no PSI on this kernel")
    psi = read_psi()
    if psi is None:
        pytest.skip("PSI disabled (psi=0)")
    assert 0.0 <= psi.some_avg10 <= 100.0 and psi.full_avg10 is not None


# -- mounts ----------------------------------------------------------------------


def test_unescape_octal_only() -> None:
    assert unescape(r"/mnt/a\040b\011c\012d\134e") == "/mnt/a b\tc\nd\\e"
    assert unescape("/mnt/é") == "/mnt/é"  # raw UTF-8 stays as it is
    assert unescape(r"/mnt/é\040x") == "/mnt/é x"
    assert unescape(r"/mnt/\x41") == r"/mnt/\x41"  # not a kernel escape


def test_parse_mounts() -> None:
    text = (
        "proc /proc proc rw,nosuid 0 0\n"
        "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n"
        r"none /mnt/huge\040pages hugetlbfs rw,pagesize=2M 0 0" + "\n"
        "garbage\n"
    )
    assert parse_mounts(text) == [
        Mount("/proc", "proc", "rw,nosuid"),
        Mount("/dev/shm", "tmpfs", "rw,nosuid,nodev"),
        Mount("/mnt/huge pages", "hugetlbfs", "rw,pagesize=2M"),
    ]


def test_containing_mount_longest_prefix_and_last_on_top() -> None:
    root = Mount("/", "ext4", "rw")
    shm = Mount("/dev/shm", "tmpfs", "rw")
    dev = Mount("/dev", "devtmpfs", "rw")
    over = Mount("/dev/shm", "hugetlbfs", "rw")
    assert containing_mount("/dev/shm/x", [root, dev, shm]) == shm
    assert containing_mount("/dev/shm", [root, shm, dev]) == shm
    assert containing_mount("/dev/shmx", [root, dev, shm]) == dev  # a prefix, not a parent
    assert containing_mount("/home", [root, dev, shm]) == root
    assert containing_mount("/dev/shm/x", [root, shm, over]) == over
    assert containing_mount("/x", []) is None


# -- processes -------------------------------------------------------------------


def _stat(comm: str, state: str, start: int) -> str:
    rest = " ".join(str(n) for n in range(4, 22))  # fields 4..21
    return f"1234 ({comm}) {state} {rest} {start} 99 100\n"


def test_parse_stat_start() -> None:
    assert procs.parse_stat_start(_stat("qemu", "S", 4242)) == 4242
    assert procs.parse_stat_start(_stat("a) R (b", "R", 7)) == 7  # ')' in the name
    assert procs.parse_stat_start(_stat("x", "Z", 7)) is None
    assert procs.parse_stat_start(_stat("x", "X", 7)) is None


def test_this_process_is_alive_and_has_an_age() -> None:
    start = procs.proc_start_time(os.getpid())
    assert start is not None and procs.process_alive(os.getpid(), start)
    assert not procs.process_alive(os.getpid(), start + 1)
    assert procs.process_age(os.getpid()) >= 0.0


def test_users_of_sees_an_open_file(tmp_path: Path) -> None:
    path = tmp_path / "held"
    path.write_bytes(b"x")
    with open(path, "rb"):
        assert os.getpid() in procs.users_of(str(path))
        assert os.getpid() not in procs.users_of(str(path), exclude=os.getpid())
    assert os.getpid() not in procs.users_of(str(path))


# -- cgroup files ----------------------------------------------------------------


def test_parse_keyed() -> None:
    text = "low 0\nhigh 3\nmax 17\noom 1\noom_kill 1\nbogus\nname text\n"
    assert cgroups.parse_keyed(text) == {"low": 0, "high": 3, "max": 17, "oom": 1, "oom_kill": 1}


def test_read_int(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("4096\n")
    (tmp_path / "b").write_text("max\n")
    assert cgroups.read_int(tmp_path / "a") == 4096
    assert cgroups.read_int(tmp_path / "b") is None
    assert cgroups.read_int(tmp_path / "c") is None


def test_cgroup_usage_v2_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake v2 hierarchy: usage, limit, limit hits, CPU and swap come from their files."""
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    group = tmp_path / "g"
    group.mkdir()
    (group / "memory.current").write_text("1048576\n")
    (group / "memory.max").write_text("max\n")
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 0\noom_kill 0\n")
    (group / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 1\n")
    (group / "memory.swap.current").write_text("8192\n")
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    usage = cgroups.cgroup_usage("g")
    assert usage == cgroups.CgroupUsage(str(group), 1048576, None, 5, 2.5, 8192)
    assert cgroups.cgroup_usage("absent") is None


def test_cgroup_usage_v1_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mem, cpu = tmp_path / "memory", tmp_path / "cpuacct"
    (mem / "g").mkdir(parents=True)
    (cpu / "g").mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (cpu / "cpuacct.usage").write_text("0\n")
    (mem / "g" / "memory.usage_in_bytes").write_text("4096\n")
    (mem / "g" / "memory.limit_in_bytes").write_text("65536\n")
    (mem / "g" / "memory.failcnt").write_text("2\n")
    (mem / "g" / "memory.memsw.usage_in_bytes").write_text("12288\n")
    (cpu / "g" / "cpuacct.usage").write_text("1500000000\n")
    monkeypatch.setattr(cgroups, "CGROUP_FS", tmp_path)
    usage = cgroups.cgroup_usage("g")
    assert usage == cgroups.CgroupUsage(str(mem / "g"), 4096, 65536, 2, 1.5, 8192)
    cgroups.set_cgroup_limit("g", 32768)
    assert (mem / "g" / "memory.limit_in_bytes").read_text() == "32768"


def test_parse_vmstat_reads_counters_by_name() -> None:
    text = "nr_free_pages 1234\noom_kill 2\nworkingset_refault_file 99\nbroken\n"
    counters = parse_vmstat(text)
    assert counters == {"nr_free_pages": 1234, "oom_kill": 2, "workingset_refault_file": 99}
