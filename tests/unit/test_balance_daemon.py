"""The balance loop with a fake backend; the libvirt backend's parsing."""

import json
import time
from pathlib import Path
from typing import Any

import pytest

from thinvm.balance.backends import (
    GivenVmsBackend,
    LibvirtBackend,
    domain_sample,
    migrating_from_jobinfo,
    parse_domstats,
    parse_reporting,
    parse_virtio_mem,
)
from thinvm.balance.daemon import Controller, format_status, load_status
from thinvm.balance.model import GuestStats, HostSample, Reclaimer, VmSample, stress_from_vmstat
from thinvm.balance.policies import ThinvmParams, ThinvmPolicy
from thinvm.balance.reclaimers import (
    RECLAIMER_WAIT,
    TRIM_FLOOR_SECONDS,
    GuestReclaimers,
    cache_floor_of,
)
from thinvm.errors import AgentBusy, ThinvmError
from thinvm.guest.agent import AGENT_PORT
from thinvm.host.memory import parse_vmstat
from thinvm.units import GiB, KiB, MiB, format_size
from thinvm.vm.machine import VIRTIO_MEM_ID, BalloonOptions, VMConfig
from thinvm.vm.resize import Lever, VirtioMem

DATA = Path(__file__).parent / "data" / "balance"


class FakeBackend:
    """A guest that follows every target at once and reports lots of free memory."""

    name = "fake"

    def __init__(self, fail_on: int | None = None) -> None:
        self.actual = {"g": 1 * GiB}
        self.held: dict[str, int] = {}
        self.sent: list[tuple[str, int]] = []
        self.fail_on = fail_on
        self.reclaimer: Reclaimer | None = None
        self.reporting = False
        self.switched: list[tuple[str, bool]] = []
        self.identity = "fake 1"

    def sample(self) -> list[VmSample]:
        return [
            VmSample(
                name,
                1 * GiB,
                actual,
                GuestStats(age=0.0, total=1 * GiB, free=actual - 200 * MiB, available=actual),
                held=self.held.get(name),
                reporting=self.reporting,
                reclaimer=self.reclaimer,
                identity=self.identity,
            )
            for name, actual in self.actual.items()
        ]

    def sample_errors(self) -> list[str]:
        return []

    def set_reclaim(self, vm: str, on: bool) -> None:
        self.switched.append((vm, on))
        assert self.reclaimer is not None
        self.reclaimer = Reclaimer(available=True, background=on, reclaimed_bytes=5 * MiB)

    def set_target(self, vm: str, target: int) -> None:
        if self.fail_on is not None and len(self.sent) == self.fail_on:
            self.fail_on = None
            raise ThinvmError("QMP went away")
        self.sent.append((vm, target))
        self.actual[vm] = target

    def close(self) -> None:
        pass


class FixedHost:
    def sample(self) -> HostSample:
        return HostSample(total=24 * GiB, available=20 * GiB)


def controller(backend: FakeBackend, state: Path, **kw: object) -> Controller:
    policy = ThinvmPolicy(ThinvmParams(calm_seconds=0.01))
    return Controller(
        backend, FixedHost(), policy, interval=0.01, state_path=state, log=lambda _l: None, **kw
    )  # type: ignore[arg-type]


def logged_controller(
    backend: FakeBackend, state: Path, **kw: object
) -> tuple[Controller, list[str]]:
    """controller(), with the lines it logs."""
    lines: list[str] = []
    ctl = controller(backend, state, **kw)
    ctl.log = lines.append
    return ctl, lines


def test_loop_shrinks_an_idle_guest_step_by_step_and_records_why(tmp_path: Path) -> None:
    backend = FakeBackend()
    ctl = controller(backend, tmp_path / "s.json")
    ctl.run(cycles=6)
    targets = [t for _, t in backend.sent]
    assert targets == sorted(targets, reverse=True) and len(targets) >= 3
    assert all(a - b <= 128 * MiB for a, b in zip([1 * GiB, *targets], targets, strict=False))
    status = load_status(tmp_path / "s.json")
    assert status["vms"]["g"]["target"] == targets[-1]
    text = "\n".join(format_status(status))
    assert "g: actual" in text and "shrink" in text


def test_a_vm_an_operator_ballooned_is_left_there_until_handed_back(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.actual["h"] = 1 * GiB
    backend.held["h"] = backend.actual["h"] = 900 * MiB  # thinvm balloon h 900M
    ctl = controller(backend, tmp_path / "s.json", verbose=True)
    lines: list[str] = []
    ctl.log = lines.append
    ctl.run(cycles=6)
    assert {vm for vm, _ in backend.sent} == {"g"}, "the held VM was touched"
    assert sum(" h: held at 900.00 MiB by an operator" in line for line in lines) == 6
    status = load_status(tmp_path / "s.json")["vms"]["h"]
    assert status["target"] == 900 * MiB and "held at 900.00 MiB by an operator" in status["reason"]
    del backend.held["h"]  # thinvm balloon h auto
    ctl.run(cycles=6)
    shrinks = [t for vm, t in backend.sent if vm == "h"]
    # The policy carries on from the operator's target, a step at a time.
    assert shrinks and 900 * MiB - shrinks[0] <= 128 * MiB


def test_dry_run_sets_nothing(tmp_path: Path) -> None:
    backend = FakeBackend()
    ctl, lines = logged_controller(backend, tmp_path / "s.json", dry_run=True)
    ctl.run(cycles=4)
    assert backend.sent == []
    assert any("would set" in line for line in lines)


def test_state_is_written_before_acting_and_a_restart_resends_it(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    backend = FakeBackend()
    ctl = controller(backend, state)
    ctl.run(cycles=3)
    saved = json.loads(state.read_text())
    last = backend.sent[-1][1]
    assert saved["vms"]["g"]["state"]["target"] == last
    assert saved["vms"]["g"]["identity"] == "fake 1"
    # "kill" between writing the state and sending: QEMU still has the old target.
    backend.actual["g"] = 1 * GiB
    restarted = FakeBackend()
    restarted.actual = dict(backend.actual)
    ctl2, lines = logged_controller(restarted, state)
    ctl2.resume()
    assert ctl2.cycle == saved["cycle"] + 1
    assert restarted.sent == [], "re-sent before any sample"
    ctl2.step()
    # The same VM, with the free memory for it: the target goes again.
    assert restarted.sent[0] == ("g", last)
    assert any(f"g: resume: target {format_size(last)} re-sent" in line for line in lines)


def test_a_failed_target_is_not_remembered_as_set(tmp_path: Path) -> None:
    backend = FakeBackend(fail_on=0)
    ctl = controller(backend, tmp_path / "s.json")
    ctl.run(cycles=2)  # the second cycle is the first to shrink, and its send fails
    saved = json.loads((tmp_path / "s.json").read_text())
    assert backend.sent == []
    assert saved["errors"] == ["g: QMP went away"]
    assert ctl.states["g"].target is None
    assert saved["vms"]["g"]["state"]["target"] is None


def test_parse_domstats() -> None:
    domains = parse_domstats((DATA / "domstats-balloon.txt").read_text())
    assert [d.name for d in domains] == ["web1", "nostats"]
    web = domain_sample(domains[0], now=1795360780.0)
    assert web.actual == 1048576 * KiB and web.max_memory == 2 * GiB
    assert web.stats is not None and web.stats.age == 2.0
    assert web.stats.free == 612440 * KiB
    assert web.stats.available == 700212 * KiB
    assert web.stats.total == 1001344 * KiB
    assert web.stats.alloc_stalls is None  # libvirt does not pass 6.12's counters on
    assert web.host_rss == 950312 * KiB
    bare = domain_sample(domains[1], now=0)
    assert bare.stats is None and bare.actual == 2 * GiB


def test_virtio_mem_domain_sample() -> None:
    xml = (DATA / "domain-virtio-mem.xml").read_text()
    vmem = parse_virtio_mem(xml)
    assert vmem is not None and vmem.alias == "ua-vmem0"
    device = vmem.device
    assert device.base == 512 * MiB and device.max_size == 512 * MiB
    assert device.plugged == 132 * MiB and device.requested == 128 * MiB
    assert device.block_size == 2 * MiB
    # libvirt counts plugged memory in the balloon's current size.
    assert vmem.balloon == 512 * MiB
    ballooned = parse_virtio_mem(xml.replace(">659456<", ">540672<"))
    assert ballooned is not None and ballooned.balloon == 396 * MiB
    (dom,) = parse_domstats("Domain: 'vmem'\n  balloon.current=659456\n  balloon.maximum=1048576\n")
    sample = domain_sample(dom, now=0, virtio_mem=device)
    assert sample.actual == 644 * MiB and sample.max_memory == GiB
    assert sample.lever == Lever.VIRTIO_MEM and Lever.VIRTIO_MEM in sample.levers
    # Without <numa> cells, the base is <memory> less the devices' sizes.
    no_cells = xml.replace("<cell id='0' cpus='0' memory='524288' unit='KiB'/>", "")
    assert (vmem_again := parse_virtio_mem(no_cells)) and vmem_again.device.base == 512 * MiB
    plain = xml.split("<memory model=")[0] + "</devices></domain>"
    assert parse_virtio_mem(plain) is None
    with pytest.raises(ThinvmError, match="without an alias"):
        parse_virtio_mem(xml.replace("<alias name='ua-vmem0'/>", ""))


class FakeVirsh(LibvirtBackend):
    """LibvirtBackend with virsh answered from canned output."""

    def __init__(self, xml: dict[str, str], domstats: str) -> None:
        self.lines: list[str] = []
        super().__init__("qemu:///fake", log=self.lines.append)
        self.xml, self.domstats, self.calls = xml, domstats, []

    def _virsh(self, *args: str) -> str:
        self.calls.append(args)
        if args[0] == "domstats":
            return self.domstats
        if args[0] == "dumpxml":
            if args[1] not in self.xml:
                raise ThinvmError(f"virsh dumpxml: failed to get domain '{args[1]}'")
            return self.xml[args[1]]
        return "Job type:         None\n" if args[0] == "domjobinfo" else ""


def test_libvirt_backend_resizes_virtio_mem_and_skips_a_vanished_domain() -> None:
    xml = (DATA / "domain-virtio-mem.xml").read_text()
    stats = (
        "Domain: 'vmem'\n  balloon.current=659456\n  balloon.maximum=1048576\n\n"
        "Domain: 'gone'\n  balloon.current=524288\n  balloon.maximum=524288\n"
    )
    backend = FakeVirsh({"vmem": xml}, stats)
    (sample,) = backend.sample()
    assert sample.name == "vmem" and sample.actual == 644 * MiB
    assert backend.sample_errors() == [
        "gone: not sampled: virsh dumpxml: failed to get domain 'gone'"
    ]
    backend.set_target("vmem", 512 * MiB + 64 * MiB)
    assert backend.calls[-1] == (
        "update-memory-device", "vmem", "--alias", "ua-vmem0",
        "--requested-size", str(64 * MiB // KiB), "--live",
    )  # fmt: skip
    # A balloon left inside the base memory is given back with setmem.
    backend.xml["vmem"] = xml.replace(">659456<", ">540672<")
    backend.sample()
    backend.set_target("vmem", 512 * MiB)
    assert backend.calls[-1] == ("setmem", "vmem", str(512 * MiB // KiB), "--live")
    assert backend.calls[-2][:2] == ("update-memory-device", "vmem")


def live_xml_with_agent() -> str:
    xml = (DATA / "domain-live.xml").read_text()
    return xml.replace("org.thinvm.agent.0", AGENT_PORT)


def test_libvirt_backend_reaches_the_reclaimer_through_the_domains_agent_channel(
    tmp_path: Path,
) -> None:
    """The channel libvirt placed (its path from the live XML, under the
    host's root as this controller sees it), taken in turns under a lock
    beside the socket; a domain started anew gets a new client."""
    xml = live_xml_with_agent()
    stats = "Domain: 'web'\n  balloon.current=524288\n  balloon.maximum=524288\n"
    backend = FakeVirsh({"web": xml}, stats)
    backend.outside = lambda path: tmp_path / path.lstrip("/")
    asked: list[str] = []

    def reclaimer(name: str, agent: Any) -> Reclaimer:
        asked.append(agent.path)
        return Reclaimer(available=True, background=False)

    backend.reclaimers.reclaimer = reclaimer  # type: ignore[method-assign]
    (sample,) = backend.sample()
    assert sample.reclaimer is None and asked == []  # no socket there: the balloon only
    for run in ("7-web", "8-web"):
        (tmp_path / "run/libvirt/qemu/channel" / run).mkdir(parents=True)
        (tmp_path / "run/libvirt/qemu/channel" / run / AGENT_PORT).touch()
    (sample,) = backend.sample()
    socket = str(tmp_path / "run/libvirt/qemu/channel/7-web" / AGENT_PORT)
    assert sample.reporting and sample.reclaimer is not None and asked == [socket]
    assert backend._agent_of("web")._lock.path == Path(socket + ".lock")  # type: ignore[union-attr]
    first = backend._agent_of("web")
    backend.sample()
    assert backend._agent_of("web") is first
    backend.xml["web"] = xml.replace("7-web", "8-web")
    backend.sample()
    assert backend._agent_of("web") is not first and asked[-1].endswith("8-web/" + AGENT_PORT)

    # Without reporting what the reclaimer frees stays in the guest: not asked.
    backend.xml["web"] = xml.replace("freePageReporting='on'", "freePageReporting='off'")
    (sample,) = backend.sample()
    assert not sample.reporting and sample.reclaimer is None and len(asked) == 3

    # A domain without the channel: a clear error, not a stack trace.
    backend.xml["web"] = xml.replace(AGENT_PORT, "org.qemu.guest_agent.0")
    (sample,) = backend.sample()
    assert sample.reclaimer is None
    with pytest.raises(ThinvmError, match=r"no org\.thinvm\.agent channel"):
        backend.set_reclaim("web", True)
    with pytest.raises(ThinvmError, match=r"no org\.thinvm\.agent channel"):
        backend.trim("web", 64 * MiB)


def test_reporting_is_the_xmls_setting_or_the_machine_types_default() -> None:
    xml = live_xml_with_agent()
    assert parse_reporting(xml)
    assert not parse_reporting(xml.replace("freePageReporting='on'", "freePageReporting='off'"))
    unset = xml.replace(" freePageReporting='on'", "")
    assert not parse_reporting(unset)  # pc-q35-10.0: QEMU's default, off
    assert parse_reporting(unset.replace("machine='pc-q35-10.0'", "machine='pc-q35-10.0-thinvm'"))
    assert not parse_reporting(
        xml.replace("model='virtio' autodeflate", "model='none' autodeflate")
    )


def test_migrating_from_jobinfo() -> None:
    idle = "Job type:         None\n\n"
    out = "Job type:         Unbounded\nOperation:        Outgoing migration\nTime elapsed: 1 ms\n"
    save = "Job type:         Unbounded\nOperation:        Save\n"
    assert not migrating_from_jobinfo(idle)
    assert migrating_from_jobinfo(out)
    assert not migrating_from_jobinfo(save)


def test_host_sources_read_this_host() -> None:
    import os

    from thinvm.balance.backends import CgroupBudget, RssBudget, WholeHost

    host = WholeHost().sample()
    assert 0 < host.available <= host.total
    budget = RssBudget(64 * GiB, lambda: [os.getpid()])
    assert 0 < budget.used() < 4 * GiB
    sample = budget.sample()
    assert sample.total == 64 * GiB and sample.available <= host.total
    try:
        CgroupBudget("thinvm-no-such-cgroup-here").sample()
    except ThinvmError as exc:
        assert "does not exist" in str(exc)
    else:
        raise AssertionError("a missing cgroup must be an error")


def test_trim_first_switches_the_reclaimer_on_once_and_status_shows_the_working_set(
    tmp_path: Path,
) -> None:
    backend = FakeBackend()
    backend.reporting = True
    backend.reclaimer = Reclaimer(available=True, background=False)
    ctl = controller(backend, tmp_path / "s.json")
    ctl.run(cycles=4)
    assert backend.switched == [("g", True)]
    # Free page reporting returns the guest's free memory: no balloon.
    assert backend.sent == []
    text = "\n".join(format_status(load_status(tmp_path / "s.json")))
    assert "working set ~" in text and "guest reclaimer on: 5.00 MiB reclaimed" in text


def test_a_busy_agent_delays_the_switch_without_an_error(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.reporting = True
    backend.reclaimer = Reclaimer(available=True, background=False)
    busy = [True, True]
    switch = backend.set_reclaim

    def set_reclaim(vm: str, on: bool) -> None:
        if busy:
            busy.pop()
            raise AgentBusy("the workload's command holds the agent")
        switch(vm, on)

    backend.set_reclaim = set_reclaim  # type: ignore[method-assign]
    ctl, lines = logged_controller(backend, tmp_path / "s.json")
    ctl.run(cycles=4)
    assert backend.switched == [("g", True)]  # on the third cycle
    assert not [line for line in lines if "FAILED" in line], lines
    assert not load_status(tmp_path / "s.json")["errors"]


class BusyAgent:
    """An agent another client's command holds until `free` is set."""

    def __init__(self) -> None:
        self.free = False
        self.waits: list[float | None] = []

    def request_json(self, request: str, timeout: float = 60.0, wait: float | None = None) -> Any:
        self.waits.append(wait)
        if not self.free:
            raise AgentBusy("held by a workload's command")
        return {"available": True, "background": True}


def test_a_reclaimer_the_agent_was_too_busy_to_report_is_asked_for_next_cycle() -> None:
    """Not 30 s later: the first overcommit guest, reading its disk when the
    controller started, was ballooned as if it could not trim."""
    reclaimers = GuestReclaimers(log=lambda _line: None, errors=[])
    agent: Any = BusyAgent()
    assert reclaimers.reclaimer("a", agent) is None
    agent.free = True
    known = reclaimers.reclaimer("a", agent)
    assert known is not None and known.background
    assert agent.waits == [RECLAIMER_WAIT, RECLAIMER_WAIT]  # a cycle never waits long


# -- virtio-mem ----------------------------------------------------------------

BASE = 512 * MiB
VMEM = 1 * GiB


class FakeVirtioMemBackend(FakeBackend):
    """A 512 MiB + 1 GiB virtio-mem guest that unplugs whatever is asked at once."""

    def __init__(self) -> None:
        super().__init__()
        self.actual = {}
        self.plugged = VMEM

    def sample(self) -> list[VmSample]:
        device = VirtioMem(BASE, self.plugged, self.plugged, 2 * MiB, VMEM)
        actual = BASE + self.plugged
        stats = GuestStats(age=0.0, total=actual, free=actual - 150 * MiB, available=actual)
        return [
            VmSample("v", BASE + VMEM, actual, stats, held=self.held.get("v"),
                     levers=(Lever.BALLOON, Lever.VIRTIO_MEM), virtio_mem=device)
        ]  # fmt: skip

    def set_target(self, vm: str, target: int) -> None:
        self.sent.append((vm, target))
        self.plugged = VirtioMem(BASE, 0, 0, 2 * MiB, VMEM).requested_for(target)


def test_loop_unplugs_an_idle_virtio_mem_guest_to_its_base_and_says_so(tmp_path: Path) -> None:
    backend = FakeVirtioMemBackend()
    ctl = controller(backend, tmp_path / "s.json")
    ctl.run(cycles=20)
    assert backend.plugged == 0 and backend.sent[-1] == ("v", BASE)
    status = load_status(tmp_path / "s.json")["vms"]["v"]
    assert status["lever"] == "virtio-mem" and status["virtio_mem"]["base"] == BASE
    text = "\n".join(format_status(load_status(tmp_path / "s.json")))
    assert "by virtio-mem (0 B plugged" in text


def test_a_virtio_mem_vm_an_operator_resized_is_left_there(tmp_path: Path) -> None:
    backend = FakeVirtioMemBackend()
    backend.held["v"] = BASE + VMEM  # thinvm resize v 1.5G
    ctl, lines = logged_controller(backend, tmp_path / "s.json", verbose=True)
    ctl.run(cycles=6)
    assert backend.sent == []
    assert any("'thinvm resize v auto' hands it back" in line for line in lines)
    del backend.held["v"]
    ctl.run(cycles=6)
    assert backend.sent and BASE + VMEM - backend.sent[0][1] <= 128 * MiB


class FakeQemu:
    """Just enough of a thinvm VM for GivenVmsBackend: QMP replies and a record."""

    def __init__(self, balloon_actual: int, plugged: int) -> None:
        self.config = VMConfig(
            name="q", memory=BASE, virtio_mem=VMEM, balloon=BalloonOptions(enabled=True)
        )
        self.balloon_actual, self.plugged = balloon_actual, plugged
        self.operator_target: int | None = None
        self.pid = 1
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.agent = self

    def alive(self) -> bool:
        return True

    def host_memory(self) -> Any:
        return type("HostMemory", (), {"rss": 100 * MiB, "anon_huge": 0})()

    def request_json(self, *_args: object, **_kw: object) -> Any:
        raise OSError("no agent here")

    def qmp(self, command: str, **args: Any) -> Any:
        if command in ("qom-set", "balloon"):
            self.sent.append((command, args))
            return {}
        device = {"id": VIRTIO_MEM_ID, "size": self.plugged, "requested-size": self.plugged,
                  "max-size": VMEM, "block-size": 2 * MiB}  # fmt: skip
        replies = {
            "query-balloon": {"actual": self.balloon_actual},
            "query-memory-devices": [{"type": "virtio-mem", "data": device}],
            "query-migrate": {},
            "query-status": {"status": "running"},
        }
        if command == "qom-get":
            return 1 if args["property"] == "guest-stats-polling-interval" else {}
        return replies[command]


def test_thinvm_backend_samples_virtio_mem_and_sets_its_requested_size() -> None:
    qemu = FakeQemu(balloon_actual=BASE, plugged=VMEM)
    backend = GivenVmsBackend([qemu])
    (sample,) = backend.sample()
    assert sample.levers == (Lever.BALLOON, Lever.VIRTIO_MEM)
    assert sample.lever is Lever.VIRTIO_MEM
    assert sample.actual == BASE + VMEM and sample.max_memory == BASE + VMEM
    assert sample.virtio_mem == VirtioMem(BASE, VMEM, VMEM, 2 * MiB, VMEM)
    backend.set_target("q", BASE + 257 * MiB)  # not a whole block: rounded down
    path = "/machine/peripheral/" + VIRTIO_MEM_ID
    assert qemu.sent == [
        ("qom-set", {"path": path, "property": "requested-size", "value": 256 * MiB})
    ]


def test_thinvm_backend_gives_back_a_balloon_left_inside_the_base() -> None:
    qemu = FakeQemu(balloon_actual=300 * MiB, plugged=0)
    backend = GivenVmsBackend([qemu])
    (sample,) = backend.sample()
    assert sample.actual == 300 * MiB  # what the guest keeps
    backend.set_target("q", BASE)
    assert qemu.sent[-1] == ("balloon", {"value": BASE})
    # Held by an operator: the size it has now is the size it is held at.
    qemu.operator_target = 300 * MiB
    (sample,) = backend.sample()
    assert sample.held == 300 * MiB


# -- what a trim could not take ----------------------------------------------


@pytest.mark.parametrize(
    ("reply", "floor"),
    [
        ({"stop": "timeout", "floor_bytes": 80 * MiB, "cache_after": 300 * MiB}, 80 * MiB),
        ({"stop": "max_bytes", "floor_bytes": 80 * MiB, "cache_after": 300 * MiB}, 80 * MiB),
        ({"stop": "floor", "floor_bytes": 80 * MiB, "cache_after": 81 * MiB}, 81 * MiB),
        ({"stop": "refaults", "floor_bytes": 80 * MiB, "cache_after": 150 * MiB}, 150 * MiB),
        ({"stop": "no_progress", "floor_bytes": 80 * MiB, "cache_after": 120 * MiB}, 120 * MiB),
        ({"stop": "error"}, 0),
    ],
)
def test_a_trim_says_which_cache_is_hot(reply: dict[str, object], floor: int) -> None:
    assert cache_floor_of(reply) == floor


def test_the_cache_floor_of_a_trim_holds_for_a_while() -> None:
    reclaimers = GuestReclaimers(log=lambda _line: None, errors=[])
    agent: Any = None  # not asked: the counters are fresh
    now = time.monotonic()
    reclaimers._known["a"] = (now, Reclaimer(available=True, background=True))
    reclaimers._cache_floors["a"] = (now, 150 * MiB)
    assert reclaimers.reclaimer("a", agent).cache_floor == 150 * MiB  # type: ignore[union-attr]
    reclaimers._cache_floors["a"] = (now - TRIM_FLOOR_SECONDS - 1, 150 * MiB)
    assert reclaimers.reclaimer("a", agent).cache_floor == 0  # type: ignore[union-attr]


class VmstatAgent:
    """A domain's agent that answers `cat /proc/vmstat` with canned text,
    or is busy with another client's request."""

    def __init__(self, text: str = "", busy: bool = False) -> None:
        self.text, self.busy, self.commands = text, busy, []

    def check(self, command: str, timeout: float = 300.0) -> Any:
        self.commands.append(command)
        if self.busy:
            raise AgentBusy("another client holds the agent")
        return type("Result", (), {"stdout": self.text})()


GUEST_VMSTAT = (
    "nr_free_pages 1000\noom_kill 2\nallocstall_dma32 3\nallocstall_normal 4\n"
    "pgscan_kswapd 500\npgscan_direct 60\npgsteal_kswapd 450\npgsteal_direct 50\n"
)


def test_libvirt_backend_reads_a_guests_stress_counters_through_its_agent() -> None:
    """libvirt passes on none of Linux 6.12's stall and reclaim statistics:
    with the agent's channel they come from the guest's /proc/vmstat, as
    the 6.12 driver computes them; a lying or busy guest gives none."""
    stats = (
        "Domain: 'web'\n  balloon.current=524288\n  balloon.maximum=524288\n"
        f"  balloon.last-update={int(time.time())}\n  balloon.available=500000\n"
        "  balloon.unused=200000\n  balloon.usable=300000\n"
    )
    backend = FakeVirsh({"web": live_xml_with_agent()}, stats)
    backend.reclaimers.reclaimer = lambda name, agent: None  # type: ignore[method-assign,assignment,return-value]
    agent = VmstatAgent(GUEST_VMSTAT)
    backend._agent = lambda name, xml: agent  # type: ignore[method-assign,assignment,return-value]
    (sample,) = backend.sample()
    assert sample.stats is not None and agent.commands == ["cat /proc/vmstat"]
    assert sample.stats.counters() == {
        "oom_kills": 2,
        "alloc_stalls": 7,
        "direct_scans": 60,
        "direct_reclaims": 50,
    }
    assert (sample.stats.async_scans, sample.stats.async_reclaims) == (500, 450)

    agent.text = "oom_kill -3\n"  # not a count: left out, the guest named
    (sample,) = backend.sample()
    assert sample.stats is not None and sample.stats.counters() == {}
    assert backend.sample_errors() == ["web: vmstat oom_kills -3 is not a count"]

    agent.busy = True  # a trim holds the channel: the balloon's figures alone
    (sample,) = backend.sample()
    assert sample.stats is not None and sample.stats.counters() == {}
    assert backend.sample_errors() == []


def test_stress_counters_the_balloon_sent_are_kept() -> None:
    """A 6.12 guest whose balloon statistics arrive keeps its own figures;
    vmstat only fills what is missing."""
    stress = stress_from_vmstat(parse_vmstat(GUEST_VMSTAT))
    sent = GuestStats(age=1.0, total=GiB, free=MiB, oom_kills=9)
    merged = sent.with_stress(stress)
    assert merged.oom_kills == 9 and merged.alloc_stalls == 7 and merged.direct_scans == 60
    assert stress_from_vmstat({}) == {}
