"""Reading libvirt's events into a migration's trace (thinvm.fleet.trace)."""

import json
import threading
from datetime import datetime

from thinvm.fleet import migrate
from thinvm.fleet.cluster import Host
from thinvm.fleet.trace import Mark, Trace, parse_event


def at(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f%z").timestamp()


def test_a_timestamped_virsh_event_becomes_a_mark() -> None:
    line = "2026-11-28 09:45:01.125+0000: event 'lifecycle' for domain 'vm1': Suspended Migrated\n"
    mark = parse_event(line, "h1", "vm1")
    assert mark == Mark(at("2026-11-28 09:45:01.125+0000"), "h1", "lifecycle: Suspended Migrated")


def test_older_virsh_without_quotes_and_events_without_detail() -> None:
    line = "2026-11-28 09:45:02.000+0000: event 'job-completed' for domain vm1:"
    assert parse_event(line, "h2", "vm1") == Mark(
        at("2026-11-28 09:45:02.000+0000"), "h2", "job-completed"
    )


def test_other_domains_and_other_lines_are_not_marks() -> None:
    other = "2026-11-28 09:45:01.125+0000: event 'lifecycle' for domain 'vm2': Started Booted"
    assert parse_event(other, "h1", "vm1") is None
    assert parse_event("events received: 3", "h1", "vm1") is None
    assert parse_event("", "h1", "vm1") is None


def test_steps_order_every_mark_and_give_each_gap() -> None:
    trace = Trace(
        [
            Mark(100.50, "h1", "lifecycle: Suspended Migrated"),
            Mark(100.00, "thinvm", "virsh migrate called"),
            Mark(100.75, "h2", "lifecycle: Resumed Migrated"),
            Mark(101.00, "thinvm", "virsh migrate returned"),
        ]
    )
    steps = trace.steps()
    assert [(s["t_s"], s["gap_s"], s["where"]) for s in steps] == [
        (0.0, 0.0, "thinvm"),
        (0.5, 0.5, "h1"),
        (0.75, 0.25, "h2"),
        (1.0, 0.25, "thinvm"),
    ]
    lines = trace.lines()
    assert len(lines) == 5 and "Resumed Migrated" in lines[3]
    assert Trace().steps() == []


def test_phases_cut_a_migration_where_both_sides_agree() -> None:
    trace = Trace(
        [
            Mark(99.90, "thinvm", "checks: route, live XML"),
            Mark(100.00, "thinvm", "virsh migrate called"),
            Mark(100.40, "h1", "migration-iteration: iteration: '1'"),
            Mark(100.45, "h1", "migration-iteration: iteration: '2'"),
            Mark(101.00, "h1", "lifecycle: Suspended Migrated"),
            Mark(101.05, "h2", "lifecycle: Started Migrated"),
            Mark(101.06, "h2", "lifecycle: Resumed Migrated"),
            Mark(101.50, "h1", "lifecycle: Stopped Migrated"),
            Mark(101.80, "thinvm", "virsh migrate returned"),
            Mark(101.85, "thinvm", "job statistics read"),
        ]
    )
    assert trace.phases("h1", "h2") == {
        "trace_checks_ms": 100.0,
        "trace_setup_ms": 400.0,
        "trace_live_ms": 600.0,
        "trace_paused_ms": 60.0,
        "trace_finish_ms": 740.0,
        "trace_stats_ms": 50.0,
    }


def test_phases_leave_out_what_the_trace_did_not_see() -> None:
    # No iteration event (a QEMU without the events capability), and the
    # destination's events lost: only the phases both of whose ends exist.
    trace = Trace(
        [
            Mark(100.00, "thinvm", "virsh migrate called"),
            Mark(101.00, "h1", "lifecycle: Suspended Migrated"),
            Mark(101.80, "thinvm", "virsh migrate returned"),
        ]
    )
    assert trace.phases("h1", "h2") == {}
    # Events of the wrong host do not count for the source.
    assert Trace([Mark(1.0, "h2", "lifecycle: Suspended Migrated")]).phases("h1", "h2") == {}


class _Answers:
    """A virsh session answering query-migrate-capabilities, then one
    query-migrate reply per call."""

    def __init__(self, syncs: list[int]) -> None:
        self.syncs = syncs
        self.asked = 0

    def run(self, *args: str, timeout: float = 30.0) -> str:
        if "query-migrate-capabilities" in args[-1]:
            return json.dumps({"return": [{"capability": "multifd", "state": True}]})
        syncs = self.syncs[min(self.asked, len(self.syncs) - 1)]
        self.asked += 1
        ram = {"dirty-sync-count": syncs, "sparse-skipped": 1000 * syncs}
        return json.dumps({"return": {"status": "active", "ram": ram}})


def test_the_poller_stops_once_the_first_pass_is_over() -> None:
    """sparse-skipped is final after the first pass: no query-migrate of
    ours shares QEMU's monitor with libvirt at the switchover."""
    poller = object.__new__(migrate._SourcePoller)  # no virsh session of its own
    threading.Thread.__init__(poller, daemon=True)
    host = Host("h1", 1, "10.0.0.1", "uuid", "patched", "/tmp/h1", "ns-h1")
    poller.host, poller.name, poller.trace = host, "vm1", Trace()
    poller.stop, poller.ram, poller.caps, poller.polls = threading.Event(), {}, {}, 0
    session = _Answers([1, 1, 2, 3])
    poller._poll(session)  # type: ignore[arg-type]
    assert poller.polls == 3 and session.asked == 3
    assert poller.ram["sparse-skipped"] == 2000 and poller.caps == {"multifd": True}
    assert [m.what for m in poller.trace.marks] == ["counters read: first pass over, polling stops"]
