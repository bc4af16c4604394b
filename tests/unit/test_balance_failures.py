"""The balance controller survives its guests, libvirt and its own restarts.

A guest is not trusted: its agent and its balloon statistics may send
anything.  One VM's failure is that VM's error (logged with its name,
counted), never the end of the loop; a restart re-sends a remembered target
only to the same VM and only if it can afford it; one controller per state
file; RAM on huge pages or pinned is never ballooned.
"""

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# What these tests are about is reached through its module (model.BadGuestData),
# so that on a tree without it each test fails, not the whole file.
from tests.unit.test_balance_daemon import DATA, FakeBackend, FakeVirsh, FixedHost, controller
from thinvm.balance import backends, daemon, model
from thinvm.balance.backends import GivenVmsBackend, LibvirtBackend, ThinvmBackend
from thinvm.balance.daemon import Controller, load_status
from thinvm.balance.model import Backing, GuestStats, Reclaimer, VmState, parse_guest_stats
from thinvm.balance.policies import POLICIES, ThinvmParams, ThinvmPolicy, make_policy
from thinvm.errors import GuestError, ThinvmError
from thinvm.guest import agent as agent_protocol
from thinvm.guest.agent import AgentClient
from thinvm.paths import REPO
from thinvm.units import GiB, KiB, MiB
from thinvm.vm.machine import BalloonOptions, VMConfig

# -- a fake guest agent on a unix socket ----------------------------------------


class FakeAgent:
    """A guest agent on a unix socket, as QEMU's chardev presents it: PING
    is answered, every other request line gets `answer(line)` as is."""

    def __init__(self, path: Path, answer: Callable[[str], bytes]) -> None:
        self.path, self.answer = path, answer
        self.requests: list[str] = []
        self._conns: list[socket.socket] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(4)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            self._conns.append(conn)
            with conn:
                self._talk(conn)

    def _talk(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            for raw in reader:
                line = raw.decode().strip()
                if line.startswith("PING "):
                    conn.sendall(f"PONG {line.split()[1]}\n".encode())
                    continue
                self.requests.append(line)
                conn.sendall(self.answer(line))
        except OSError:
            pass  # the client hung up on us

    def close(self) -> None:
        self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        assert not self._thread.is_alive()


def json_reply(body: bytes) -> Callable[[str], bytes]:
    return lambda _line: b"JSON %d\n" % len(body) + body


GOOD_COUNTERS = b'{"available":true,"background":false,"reclaimed_bytes":0}'
GARBAGE_COUNTERS = b'{"available":1,"reclaimed_bytes":"x"}'


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[[str, Callable[[str], bytes]], FakeAgent]]:
    made: list[FakeAgent] = []

    def make(name: str, answer: Callable[[str], bytes]) -> FakeAgent:
        made.append(FakeAgent(tmp_path / f"{name}.sock", answer))
        return made[-1]

    yield make
    for agent in made:
        agent.close()


class ReportingVm:
    """Just enough of a thinvm VM with free page reporting for GivenVmsBackend:
    QMP answered here, the guest agent a real client of a FakeAgent."""

    def __init__(self, name: str, agent: FakeAgent) -> None:
        self.config = VMConfig(
            name=name,
            memory=1 * GiB,
            balloon=BalloonOptions(enabled=True, free_page_reporting=True),
        )
        self.agent = AgentClient(str(agent.path))
        self.pid = os.getpid()
        self.operator_target: int | None = None
        self.actual = 1 * GiB

    def alive(self) -> bool:
        return True

    def host_memory(self) -> Any:
        return type("HostMemory", (), {"rss": 900 * MiB, "anon_huge": 0})()

    def qmp(self, command: str, **args: Any) -> Any:
        if command == "balloon":
            self.actual = args["value"]
            return {}
        if command == "qom-get" and args["property"] == "guest-stats":
            stats = {"stat-total-memory": self.actual, "stat-free-memory": 700 * MiB,
                     "stat-available-memory": 800 * MiB}  # fmt: skip
            return {"last-update": int(time.time()), "stats": stats}
        replies = {
            "query-balloon": {"actual": self.actual},
            "query-migrate": {},
            "query-status": {"status": "running"},
            "qom-get": 1,  # the statistics polling interval
        }
        return replies[command]


def quiet_controller(backend: Any, state: Path) -> tuple[Controller, list[str]]:
    lines: list[str] = []
    policy = ThinvmPolicy(ThinvmParams(calm_seconds=0.01))
    ctl = Controller(
        backend, FixedHost(), policy, interval=0.01, state_path=state, log=lines.append
    )
    return ctl, lines


# -- M1: one guest's garbage is that guest's error -------------------------------


def test_an_agent_answering_garbage_costs_its_vm_a_logged_error_not_the_loop(
    agents: Callable[[str, Callable[[str], bytes]], FakeAgent], tmp_path: Path
) -> None:
    good = ReportingVm("good", agents("good", json_reply(GOOD_COUNTERS)))
    bad = ReportingVm("bad", agents("bad", json_reply(GARBAGE_COUNTERS)))
    backend = GivenVmsBackend([bad, good])
    ctl, lines = quiet_controller(backend, tmp_path / "state.json")
    reports = [ctl.step(), ctl.step()]
    for report in reports:
        assert {s.name for s in report.samples} == {"bad", "good"}
    first = {s.name: s for s in reports[0].samples}
    assert first["good"].reclaimer is not None and first["good"].reclaimer.available
    assert first["bad"].reclaimer is None  # garbage counts as no reclaimer
    (error,) = reports[0].errors
    assert error == "bad: guest reclaimer ignored: available 1 is not true or false"
    assert any(line.endswith(error) and " cycle 0 " in line for line in lines), lines
    status = load_status(tmp_path / "state.json")
    assert status["error_count"] == 1 and status["cycle"] == 1


@pytest.mark.parametrize(
    "counters",
    [
        {"available": 1, "reclaimed_bytes": "x"},
        {"available": True, "reclaimed_bytes": -5},
        {"available": True, "reclaimed_bytes": 1 << 64},
        {"available": True, "backoffs": 1.5},
        {"available": "yes"},
        ["available"],
        "garbage",
    ],
)
def test_reclaimer_counters_of_the_wrong_type_or_range_are_refused(counters: Any) -> None:
    with pytest.raises(model.BadGuestData):
        Reclaimer.from_counters(counters)


def test_good_reclaimer_counters_still_parse() -> None:
    rec = Reclaimer.from_counters(
        {"available": True, "background": True, "cpu_ms": model.COUNT_MAX}
    )
    assert rec.available and rec.background and rec.cpu_ms == model.COUNT_MAX


@pytest.mark.parametrize(
    "stats",
    [
        {"stat-total-memory": "1G", "stat-free-memory": 1},
        {"stat-total-memory": GiB, "stat-free-memory": 2 * GiB},  # more free than it has
        {"stat-total-memory": GiB, "stat-free-memory": MiB, "stat-available-memory": 4 * GiB},
        {"stat-total-memory": 1 << 63, "stat-free-memory": 0},
        {"stat-total-memory": GiB, "stat-free-memory": MiB, "stat-oom-kills": -3},
    ],
)
def test_balloon_statistics_that_cannot_be_right_are_refused(stats: dict[str, Any]) -> None:
    with pytest.raises(model.BadGuestData):
        parse_guest_stats({"last-update": 100, "stats": stats}, now=101)


def test_a_vm_whose_statistics_are_garbage_is_sampled_without_them(
    agents: Callable[[str, Callable[[str], bytes]], FakeAgent],
) -> None:
    """Without statistics the policy never shrinks it; the others go on."""

    class Lying(ReportingVm):
        def qmp(self, command: str, **args: Any) -> Any:
            if command == "qom-get" and args["property"] == "guest-stats":
                stats = {"stat-total-memory": 1 * GiB, "stat-free-memory": 5 * GiB}
                return {"last-update": int(time.time()), "stats": stats}
            return super().qmp(command, **args)

    def old_agent(name: str) -> FakeAgent:
        return agents(name, lambda _line: b"ERR unknown\n")

    liar, honest = Lying("liar", old_agent("liar")), ReportingVm("honest", old_agent("honest"))
    backend = GivenVmsBackend([liar, honest])
    samples = {s.name: s for s in backend.sample()}
    assert samples["liar"].stats is None and samples["honest"].stats is not None
    (error,) = backend.sample_errors()
    assert error.startswith("liar: balloon statistics ignored: ")


def test_a_detached_vm_with_a_state_file_of_another_version_is_an_error_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("THINVM_RUN", str(tmp_path / "run"))
    rundir = tmp_path / "run" / "old"
    rundir.mkdir(parents=True)
    config = {"name": "old", "memory": GiB, "a_field_of_another_version": 1}
    (rundir / "state.json").write_text(json.dumps({"config": config, "pid": os.getpid()}))
    backend = ThinvmBackend()
    assert backend.sample() == []
    (error,) = backend.sample_errors()
    assert error.startswith("old: not sampled: VM 'old' has an unreadable state file ")


# -- the agent client reads a bounded amount ------------------------------------


def test_an_agent_line_without_end_is_a_protocol_error(
    agents: Callable[[str, Callable[[str], bytes]], FakeAgent],
) -> None:
    # 64 MiB without a newline (then it stalls): the client stops at the limit.
    agent = agents("endless", lambda _line: b"x" * (64 * MiB))
    client = AgentClient(str(agent.path))
    started = time.monotonic()
    with pytest.raises(GuestError, match=f"longer than {agent_protocol.MAX_LINE} bytes"):
        client.request_json("RECLAIM status", timeout=10)
    assert time.monotonic() - started < 5
    assert len(client._buf) <= agent_protocol.MAX_LINE + (1 << 16)


def test_an_agent_announcing_a_huge_reply_is_a_protocol_error(
    agents: Callable[[str, Callable[[str], bytes]], FakeAgent],
) -> None:
    agent = agents("huge", lambda _line: b"JSON 1099511627776\n{")
    client = AgentClient(str(agent.path))
    started = time.monotonic()
    with pytest.raises(GuestError, match="announced 1099511627776 bytes"):
        client.request_json("RECLAIM status", timeout=10)
    assert time.monotonic() - started < 5


def test_a_bad_exec_header_is_a_guest_error_not_a_value_error(
    agents: Callable[[str, Callable[[str], bytes]], FakeAgent],
) -> None:
    agent = agents("exec", lambda _line: b"DONE zero -1 2\n")
    with pytest.raises(GuestError, match="bad reply header"):
        AgentClient(str(agent.path)).run("true", timeout=10)


# -- M1: virsh that hangs --------------------------------------------------------

FAKE_VIRSH = """#!/bin/sh
# virsh -c URI COMMAND ARGS...: answers from {data}
shift 2
case "$1" in
domstats) [ -e {data}/hang-domstats ] && exec sleep 30; cat {data}/domstats ;;
dumpxml) [ "$2" = slow ] && exec sleep 30; sed "s/<name>vmem</<name>$2</" {data}/domain.xml ;;
domjobinfo) echo "Job type:         None" ;;
*) ;;
esac
"""


@pytest.fixture
def fake_virsh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `virsh` first on PATH that answers from files, or hangs when told."""
    data = tmp_path / "virsh"
    data.mkdir()
    script = data / "virsh"
    script.write_text(FAKE_VIRSH.format(data=data))
    script.chmod(0o755)
    (data / "domain.xml").write_text((DATA / "domain-virtio-mem.xml").read_text())
    monkeypatch.setenv("PATH", f"{data}:{os.environ['PATH']}")
    monkeypatch.setattr(backends, "VIRSH_TIMEOUT", 0.5)
    return data


def domstats(*names: str) -> str:
    block = (
        "Domain: '{}'\n  balloon.current=659456\n  balloon.maximum=1048576\n  balloon.rss=600000\n"
    )
    return "\n".join(block.format(name) for name in names)


def test_a_virsh_call_that_hangs_fails_one_domain_or_one_cycle(
    fake_virsh: Path, tmp_path: Path
) -> None:
    (fake_virsh / "domstats").write_text(domstats("slow", "quick"))
    backend = LibvirtBackend("qemu:///fake")
    ctl, lines = quiet_controller(backend, tmp_path / "state.json")
    ctl.run(cycles=1)
    # The domain whose dumpxml hangs is left out; the other is sampled.
    status = load_status(tmp_path / "state.json")
    assert set(status["vms"]) == {"quick"}
    (error,) = status["errors"]
    assert error.startswith("slow: not sampled: virsh dumpxml slow: no answer from qemu:///fake")
    # libvirtd hangs altogether: each cycle fails, is logged, and the loop goes on.
    (fake_virsh / "hang-domstats").touch()
    ctl.run(cycles=2)
    failed = [line for line in lines if "FAILED: virsh domstats --balloon" in line]
    assert len(failed) == 2 and ctl.cycle == 3 and ctl.error_count == 3


def test_budget_counts_the_domains_rss(fake_virsh: Path) -> None:
    (fake_virsh / "domstats").write_text(domstats("a", "b"))
    budget = backends.DomainRssBudget(48 * GiB, LibvirtBackend("qemu:///fake", names=["a"]))
    assert budget.used() == 600000 * KiB
    assert budget.sample().total == 48 * GiB


# -- M3: hugepage-backed and locked domains -------------------------------------

LIVE_XML = DATA / "domain-live.xml"


def backed(xml: str, backing: str) -> str:
    return xml.replace("<vcpu ", f"<memoryBacking>{backing}</memoryBacking>\n  <vcpu ", 1)


def test_parse_backing_and_identity_of_a_live_domain_xml() -> None:
    xml = LIVE_XML.read_text()
    assert backends.parse_backing(xml) is Backing.ANONYMOUS
    assert backends.parse_backing(backed(xml, "<hugepages/>")) is Backing.HUGETLBFS
    huge_2m = "<hugepages><page size='2048' unit='KiB'/></hugepages>"
    assert backends.parse_backing(backed(xml, huge_2m)) is Backing.HUGETLBFS
    assert backends.parse_backing(backed(xml, "<locked/>")) is Backing.PINNED
    assert backends.parse_backing(backed(xml, "<nosharepages/>")) is Backing.ANONYMOUS
    assert backends.domain_identity(xml) == "uuid 7c3c5b8e-8a5f-4b7e-9d0e-3f1f0a6b2c41 id 7"


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("backing", ["<hugepages/>", "<locked/>"])
def test_a_domain_on_huge_pages_or_locked_is_never_ballooned(
    backing: str, policy: str, tmp_path: Path
) -> None:
    xml = LIVE_XML.read_text()
    # An idle 1 GiB guest with 900 MiB free, a host short of memory: every
    # policy would shrink it, and does when its RAM is plain.
    stats = (
        "Domain: 'web'\n  balloon.current=1048576\n  balloon.maximum=1048576\n"
        "  balloon.unused=921600\n  balloon.usable=950000\n  balloon.available=1000000\n"
        f"  balloon.last-update={int(time.time())}\n  balloon.rss=1040000\n"
    )
    short = FixedHost()
    short.sample = lambda: backends.HostSample(total=24 * GiB, available=1 * GiB)  # type: ignore[method-assign]

    def setmems(domain_xml: str) -> list[tuple[str, ...]]:
        backend = FakeVirsh({"web": domain_xml}, stats)
        state = tmp_path / f"{len(domain_xml)}.json"
        ctl = Controller(backend, short, make_policy(policy), state_path=state, log=print)
        for _ in range(8):  # one every 5 s, as far as the policies know
            ctl.step()
        return [call for call in backend.calls if call[0] in ("setmem", "update-memory-device")]

    assert setmems(xml), "the plain domain was not shrunk: the test proves nothing"
    assert setmems(backed(xml, backing)) == []


ROLLUP = """55cd7216b000-7fff07128000 ---p 00000000 00:00 0                          [rollup]
Rss:             1075200 kB
AnonHugePages:         0 kB
Shared_Hugetlb:  1048576 kB
Private_Hugetlb:    2048 kB
Locked:                0 kB
"""


def test_a_thinvm_vm_with_ram_on_hugetlbfs_counts_as_such_whatever_its_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm pool slot on hugetlbfs, or a file: backend there: its QEMU maps
    huge pages (smaps_rollup), which says more than a path could."""
    assert backends.hugetlb_of_rollup(ROLLUP) == 1 * GiB + 2 * MiB
    assert backends.hugetlb_of_rollup(ROLLUP.replace("1048576", "0").replace("2048", "0")) == 0
    pooled = VMConfig(name="p", memory=GiB, pool="/var/lib/thinvm/pool")
    filed = VMConfig(name="f", memory=GiB, backend="file:/srv/slots/f")
    assert backends._backing_of(pooled, 0, os.getpid()) is Backing.POOL  # pytest has none
    monkeypatch.setattr(backends, "_maps_hugetlb", lambda pid: pid == 42)
    assert backends._backing_of(pooled, 0, 42) is Backing.HUGETLBFS
    assert backends._backing_of(filed, 0, 42) is Backing.HUGETLBFS
    assert backends._backing_of(filed, 0, 43) is Backing.ANONYMOUS


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("backing", [Backing.HUGETLBFS, Backing.PINNED])
def test_every_policy_leaves_hugetlbfs_and_pinned_vms_alone(
    backing: Backing, policy: str, tmp_path: Path
) -> None:
    class Backed(FakeBackend):
        def sample(self) -> list[Any]:
            return [dataclasses.replace(s, backing=backing) for s in super().sample()]

    short = FixedHost()
    short.sample = lambda: backends.HostSample(total=24 * GiB, available=1 * GiB)  # type: ignore[method-assign]
    backend = Backed()
    lines: list[str] = []
    ctl = Controller(backend, short, make_policy(policy), state_path=tmp_path / "s.json",
                     log=lines.append, verbose=True)  # fmt: skip
    for _ in range(8):
        ctl.step()
    assert backend.sent == []
    assert "left alone" in load_status(tmp_path / "s.json")["vms"]["g"]["reason"]


# -- M2: a restart checks whose state it is -------------------------------------


def saved_run(tmp_path: Path, **backend_attrs: Any) -> tuple[Path, int]:
    """Three cycles of a controller that shrank g; the state file and g's target."""
    state = tmp_path / "state.json"
    backend = FakeBackend()
    ctl = controller(backend, state)
    ctl.run(cycles=3)
    return state, backend.sent[-1][1]


def restart(state: Path, backend: FakeBackend) -> tuple[Controller, list[str]]:
    ctl, lines = quiet_controller(backend, state)
    ctl.resume()
    assert backend.sent == [], "something was sent before the first sample"
    ctl.step()
    return ctl, lines


def test_a_vm_recreated_under_the_same_name_gets_no_remembered_target(tmp_path: Path) -> None:
    state, _ = saved_run(tmp_path)
    again = FakeBackend()
    again.identity = "fake 2"  # another QEMU, same name
    ctl, lines = restart(state, again)
    assert again.sent == []
    assert ctl.states["g"].target is None
    assert any("g: resume: saved state dropped: another VM under this name" in x for x in lines)


def test_a_state_file_that_does_not_say_whose_it_is_gets_no_target_resent(
    tmp_path: Path,
) -> None:
    """As written before identities were kept (or by another host boot)."""
    state, _ = saved_run(tmp_path)
    data = json.loads(state.read_text())
    del data["vms"]["g"]["identity"]
    state.write_text(json.dumps(data))
    again = FakeBackend()
    _, lines = restart(state, again)
    assert again.sent == []
    assert any("cannot tell whether this is the VM" in line for line in lines)
    data["vms"]["g"]["identity"] = "fake 1"
    data["boot_id"] = "another boot"
    state.write_text(json.dumps(data))
    after_reboot = FakeBackend()
    restart(state, after_reboot)
    assert after_reboot.sent == []


def test_a_vm_that_grew_gets_no_remembered_target(tmp_path: Path) -> None:
    state, _ = saved_run(tmp_path)
    data = json.loads(state.read_text())
    data["vms"]["g"]["max_memory"] = 512 * MiB
    state.write_text(json.dumps(data))
    again = FakeBackend()
    _, lines = restart(state, again)
    assert again.sent == []
    assert any("its RAM changed (512.00 MiB then, 1.00 GiB now)" in line for line in lines)


def test_a_remembered_target_the_guest_cannot_afford_is_not_resent(tmp_path: Path) -> None:
    state, target = saved_run(tmp_path)

    class Busy(FakeBackend):
        """The same VM, which has since filled its memory: 40 MiB free."""

        def sample(self) -> list[Any]:
            full = GuestStats(age=0.0, total=GiB, free=40 * MiB, available=60 * MiB)
            return [dataclasses.replace(s, stats=full) for s in super().sample()]

    again = Busy()
    ctl, lines = restart(state, again)
    assert all(t >= 1 * GiB - 16 * MiB for _, t in again.sent), again.sent
    assert ctl.states["g"].target != target
    assert any("not re-sent: the guest has 40.00 MiB free" in line for line in lines)


def test_a_dry_run_state_file_has_no_target_to_resend(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    dry = FakeBackend()
    controller(dry, state, dry_run=True).run(cycles=4)
    assert json.loads(state.read_text())["vms"]["g"]["state"]["target"] is not None
    again = FakeBackend()
    ctl, lines = quiet_controller(again, state)
    ctl.resume()
    assert ctl.states["g"].target is None
    ctl.step()
    assert not [line for line in lines if "re-sent" in line], lines


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(cycle="twelve"),
        lambda d: d.update(vms=["g"]),
        lambda d: d["vms"]["g"]["state"].update(target="256M"),
        lambda d: d["vms"]["g"]["state"].update(counters={"oom_kills": None}),
        lambda d: d["vms"]["g"].pop("state"),
    ],
)
def test_a_balance_state_file_of_another_shape_starts_fresh(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    state, _ = saved_run(tmp_path)
    data = json.loads(state.read_text())
    edit(data)
    state.write_text(json.dumps(data))
    ctl, lines = quiet_controller(FakeBackend(), state)
    ctl.resume()
    assert any("unreadable" in line and "starting fresh" in line for line in lines), lines
    assert ctl.cycle == 0 and ctl.states == {}
    ctl.run(cycles=2)  # and it runs


def test_vm_state_round_trips() -> None:
    state = VmState(target=GiB, counters={"oom_kills": 2}, history=((GiB, MiB),), reason="x")
    assert VmState.from_json(json.loads(json.dumps(state.to_json()))) == state


# -- M8: one controller per state file -------------------------------------------


def test_a_second_claim_on_a_state_file_names_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    lock = daemon.claim_state(state)
    try:
        with pytest.raises(
            ThinvmError, match=f"another 'thinvm balance run' \\(pid {os.getpid()}\\)"
        ):
            daemon.claim_state(state)
    finally:
        lock.release()
    daemon.claim_state(state).release()  # free again


def balance_run(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "thinvm.cli", "balance", "run",
            "--state", str(tmp_path / "state.json"), *args]  # fmt: skip


def test_a_second_balance_run_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    env = {**os.environ, "THINVM_CACHE": str(tmp_path / "cache")}
    # Manages no VM (none is called so): the loop runs on, empty.
    first = subprocess.Popen(
        balance_run(tmp_path, "--vm", "no-such-vm", "--interval", "0.2"),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "state.json").exists():
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first controller never ran a cycle"
            time.sleep(0.05)
        second = subprocess.run(
            balance_run(tmp_path, "--vm", "no-such-vm", "--cycles", "1"),
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1, second
        assert f"another 'thinvm balance run' (pid {first.pid}) holds" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None, "the first controller stopped"
    finally:
        first.send_signal(signal.SIGTERM)
        out = first.communicate(timeout=30)[0]
    assert first.returncode == 0 and "stopped by SIGTERM" in out, out
    # Once it is gone, a new one may run.
    again = subprocess.run(
        balance_run(tmp_path, "--vm", "no-such-vm", "--cycles", "1"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again
