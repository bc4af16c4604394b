"""The balance policies on recorded and constructed samples.

Every safety rule of the thinvm policy (docs/balance.md) has a test here;
the anchors' policies are checked against their published rules.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from thinvm.balance.model import (
    Backing,
    GuestStats,
    HostSample,
    Reclaimer,
    VmLimits,
    VmSample,
    VmState,
    parse_guest_stats,
)
from thinvm.balance.policies import (
    Inputs,
    MomPolicy,
    ProxmoxPolicy,
    ThinvmParams,
    ThinvmPolicy,
)
from thinvm.units import GiB, MiB
from thinvm.vm.resize import Lever, VirtioMem

DATA = Path(__file__).parent / "data" / "balance"
CALM_HOST = HostSample(total=24 * GiB, available=20 * GiB, psi_some_avg10=0.0, psi_full_avg10=0.0)


def stats(free: int, available: int | None = None, age: float = 1.0, **counters: int) -> GuestStats:
    return GuestStats(
        age=age,
        total=1 * GiB,
        free=free,
        available=free if available is None else available,
        **counters,
    )


def vm(
    name: str = "a", actual: int = 1 * GiB, st: GuestStats | None = None, **kw: object
) -> VmSample:
    return VmSample(name=name, max_memory=1 * GiB, actual=actual, stats=st, **kw)  # type: ignore[arg-type]


def run(
    policy: object,
    vms: list[VmSample],
    host: HostSample = CALM_HOST,
    states: dict[str, VmState] | None = None,
    cycle: int = 10,
    limits: dict[str, VmLimits] | None = None,
    interval: float = 2.0,
):  # type: ignore[no-untyped-def]
    inputs = Inputs(cycle, interval, host, vms, limits or {}, states or {})
    return policy.decide(inputs)  # type: ignore[attr-defined]


def settle(policy: ThinvmPolicy, sample: VmSample, cycles: int = 3, host: HostSample = CALM_HOST):  # type: ignore[no-untyped-def]
    """Run a few cycles on the same sample: the state a steady guest reaches."""
    states: dict[str, VmState] = {}
    plan = None
    for cycle in range(cycles):
        plan = run(policy, [sample], host=host, states=states, cycle=cycle)
        states = plan.states
    return plan, states


# -- recorded QMP replies ----------------------------------------------------


def test_parse_stats_of_a_6_12_guest_has_stall_counters() -> None:
    reply = json.loads((DATA / "guest-stats-6.12.json").read_text())
    parsed = parse_guest_stats(reply, now=reply["last-update"] + 3)
    assert parsed is not None
    assert parsed.age == 3
    assert parsed.free and parsed.free > 0
    assert parsed.total and parsed.total > parsed.free
    assert parsed.alloc_stalls is not None and parsed.direct_reclaims is not None
    assert parsed.oom_kills == 0
    assert set(parsed.counters()) == {
        "oom_kills",
        "alloc_stalls",
        "direct_scans",
        "direct_reclaims",
    }


def test_parse_stats_of_a_6_1_guest_leaves_new_counters_unset() -> None:
    reply = json.loads((DATA / "guest-stats-6.1.json").read_text())
    parsed = parse_guest_stats(reply, now=reply["last-update"])
    assert parsed is not None and parsed.free
    assert parsed.alloc_stalls is None and parsed.oom_kills is None
    assert parsed.counters() == {}


def test_parse_stats_before_the_first_report_is_none() -> None:
    reply = json.loads((DATA / "guest-stats-6.1.json").read_text())
    reply["last-update"] = 0
    assert parse_guest_stats(reply, now=1e9) is None


# -- thinvm: safety rules ----------------------------------------------------


def test_never_shrinks_on_stale_stats() -> None:
    policy = ThinvmPolicy()
    sample = vm(st=stats(free=900 * MiB, age=60.0))
    plan, _ = settle(policy, sample, cycles=5)
    (decision,) = plan.decisions
    assert decision.target is None or decision.target >= sample.actual
    assert "stats 60 s old" in decision.reason


def test_never_shrinks_without_stats() -> None:
    plan, _ = settle(ThinvmPolicy(), vm(st=None), cycles=5)
    assert plan.decisions[0].target is None
    assert "missing" in plan.decisions[0].reason


def test_stale_stats_give_a_shrunk_guest_memory_back() -> None:
    states = {"a": VmState(target=400 * MiB, last_actual=400 * MiB)}
    plan = run(ThinvmPolicy(), [vm(actual=400 * MiB, st=stats(100 * MiB, age=30))], states=states)
    assert plan.decisions[0].target is not None and plan.decisions[0].target > 400 * MiB


def test_idle_guest_shrinks_only_after_calm_seconds_and_by_at_most_one_step() -> None:
    policy = ThinvmPolicy()
    sample = vm(st=stats(free=800 * MiB))
    states: dict[str, VmState] = {}
    targets = []
    calm = policy.cycles(policy.params.calm_seconds, 2.0)  # 3 cycles of 2 s
    # The first report (1 s old) may predate a balloon move the controller
    # did not see; the second is the baseline calm counts from.
    for cycle in range(calm + 2):
        plan = run(policy, [sample], states=states, cycle=cycle)
        states = plan.states
        targets.append(plan.decisions[0].target)
    assert targets[:-1] == [None] * (calm + 1)  # hysteresis: not calm long enough
    assert targets[-1] == 1 * GiB - policy.params.inflate_step  # inflate slowly
    assert "step cap" in plan.decisions[0].reason


def test_a_report_from_before_the_balloon_moved_is_not_growth() -> None:
    """Seen with libvirt: ballooned 512 -> 320 MiB just before the
    controller started, its first report still counted the free memory
    the balloon then took; the next one, 190 MiB less free, looked like
    190 MiB of growth and the guest was deflated to 446 MiB."""
    policy = ThinvmPolicy()
    guest = dict(name="a", actual=320 * MiB)
    before = vm(st=stats(free=355 * MiB, age=1.5), **guest)  # type: ignore[arg-type]
    after = vm(st=stats(free=164 * MiB, age=0.5), **guest)  # type: ignore[arg-type]
    states: dict[str, VmState] = {}
    decisions = []
    for cycle, sample in enumerate([before, after, after, after, after, after]):
        plan = run(policy, [sample], states=states, cycle=cycle)
        states = plan.states
        decisions.append(plan.decisions[0])
    assert "predate the balloon's last move" in decisions[0].reason
    assert states["a"].peak_growth == 0
    grown = [d.target for d in decisions if d.target is not None and d.target > 320 * MiB]
    assert not grown, decisions
    # Calm from the first current report on, it shrinks by its free memory
    # beyond the headroom.
    assert [d.target for d in decisions if d.target is not None] == [278 * MiB], decisions


def test_the_balloon_moving_under_a_late_report_is_no_ground_to_shrink() -> None:
    policy = ThinvmPolicy()
    states = {"a": VmState(last_actual=1 * GiB, last_used=200 * MiB, calm_cycles=10)}
    # Inflated by 300 MiB since the last cycle; the report, 1 s old, still
    # shows the free memory the balloon has since taken.
    plan = run(policy, [vm(actual=724 * MiB, st=stats(free=800 * MiB))], states=states)
    assert plan.decisions[0].target is None, plan.decisions[0]
    assert plan.states["a"].last_used == 200 * MiB  # the last current baseline stays


def test_a_shrunk_guest_keeps_its_headroom_available_not_only_free() -> None:
    """A 1 GiB guest with THP keeps ~65 MiB of free memory as watermarks:
    shrunk to 123 MiB free it had 58 MiB available, counted as tight and
    was deflated again (CI, 2026-11-26: 274 -> 530 -> 786 MiB, then shrunk
    again, round after round)."""
    policy = ThinvmPolicy()
    headroom = policy._headroom(vm(), 0)
    state = VmState(target=402 * MiB, last_actual=402 * MiB, last_used=151 * MiB, calm_cycles=9)
    reserve = 65 * MiB
    guest = vm(actual=402 * MiB, st=stats(free=251 * MiB, available=251 * MiB - reserve))
    plan = run(policy, [guest], states={"a": state})
    target = plan.decisions[0].target
    assert target is not None and target < 402 * MiB
    available_then = 251 * MiB - reserve - (402 * MiB - target)
    assert headroom - 2 * MiB <= available_then <= headroom + 2 * MiB  # targets are whole 2 MiB
    assert "guest available" in plan.decisions[0].reason
    # There, with the same reserve, the guest is not tight: it stays.
    free = target - 151 * MiB
    settled = vm(actual=target, st=stats(free=free, available=free - reserve, age=0.5))
    states = {"a": plan.states["a"].but(last_actual=target, actual_steady_s=4.0)}
    plan = run(policy, [settled], states=states, cycle=11)
    assert plan.decisions[0].target is None, plan.decisions[0].reason


def test_a_low_report_from_before_a_deflate_does_not_deflate_again() -> None:
    policy = ThinvmPolicy()
    # Deflated 274 -> 530 MiB last cycle for 58 MiB available; this
    # report is older than that deflate.
    state = VmState(target=530 * MiB, last_actual=274 * MiB, last_used=151 * MiB)
    late = vm(actual=530 * MiB, st=stats(free=123 * MiB, available=58 * MiB))
    plan = run(policy, [late], states={"a": state}, cycle=11)
    assert plan.decisions[0].target is None, plan.decisions[0].reason


def test_no_shrinking_soon_after_a_grow() -> None:
    policy = ThinvmPolicy()
    state = VmState(target=300 * MiB, last_actual=300 * MiB, last_used=250 * MiB, calm_cycles=9)
    plan = run(policy, [vm(actual=300 * MiB, st=stats(free=50 * MiB))], states={"a": state})
    grown = plan.decisions[0].target
    assert grown is not None and grown > 300 * MiB
    states = plan.states
    cooldown = policy.cycles(policy.params.grow_cooldown_seconds, 2.0)
    # the guest frees everything at once: it still keeps its memory for the cooldown
    for cycle in range(11, 10 + cooldown):
        plan = run(policy, [vm(actual=grown, st=stats(free=grown - 100 * MiB))], states=states,
                   cycle=cycle)  # fmt: skip
        states = plan.states
        assert plan.decisions[0].target is None, plan.decisions[0].reason


def test_a_burst_of_growth_is_remembered_as_headroom() -> None:
    policy = ThinvmPolicy()
    state = VmState(last_used=200 * MiB, last_actual=600 * MiB, calm_cycles=9)
    # used jumped by 200 MiB: the guest must keep that much more free
    plan = run(policy, [vm(actual=600 * MiB, st=stats(free=200 * MiB))], states={"a": state})
    assert plan.states["a"].peak_growth == 200 * MiB
    states = plan.states
    # ten quiet cycles later (20 s, half-life 30 s) most of it is still remembered
    for cycle in range(11, 21):
        plan = run(policy, [vm(actual=600 * MiB, st=stats(free=200 * MiB))], states=states,
                   cycle=cycle)  # fmt: skip
        states = plan.states
    assert states["a"].peak_growth > 120 * MiB
    assert all(d.target is None for d in plan.decisions)  # 200 MiB free < its headroom


def test_one_shrink_in_flight_at_a_time() -> None:
    policy = ThinvmPolicy()
    sample = vm(actual=1 * GiB, st=stats(free=800 * MiB))
    state = VmState(target=896 * MiB, last_actual=1 * GiB, calm_cycles=5, last_used=224 * MiB)
    plan = run(policy, [sample], states={"a": state})
    assert plan.decisions[0].target is None
    assert "in flight" in plan.decisions[0].reason


def test_dead_band_ignores_small_changes() -> None:
    policy = ThinvmPolicy()
    headroom = max(policy.params.headroom_min, int(GiB * policy.params.headroom_fraction))
    # free is within the dead band of the headroom the guest keeps anyway
    sample = vm(actual=600 * MiB, st=stats(free=headroom + 8 * MiB))
    plan, _ = settle(policy, sample, cycles=4)
    assert plan.decisions[0].target is None
    assert plan.decisions[0].reason.startswith("hold")


def test_never_below_floor() -> None:
    policy = ThinvmPolicy()
    limits = {"a": VmLimits(floor=900 * MiB, ceiling=1 * GiB)}
    states: dict[str, VmState] = {}
    for cycle in range(6):
        plan = run(
            policy, [vm(st=stats(free=950 * MiB))], states=states, cycle=cycle, limits=limits
        )
        states = plan.states
        target = plan.decisions[0].target
        assert target is None or target >= 900 * MiB
    assert states["a"].target == 900 * MiB


def test_guest_below_floor_is_restored_even_without_spare() -> None:
    host = HostSample(total=4 * GiB, available=100 * MiB)
    limits = {"a": VmLimits(floor=512 * MiB, ceiling=1 * GiB)}
    plan = run(
        ThinvmPolicy(), [vm(actual=300 * MiB, st=stats(200 * MiB))], host=host, limits=limits
    )
    assert plan.decisions[0].target == 512 * MiB


def test_ceiling_caps_growth() -> None:
    limits = {"a": VmLimits(floor=256 * MiB, ceiling=700 * MiB)}
    sample = vm(actual=600 * MiB, st=stats(free=5 * MiB, alloc_stalls=9))
    state = VmState(counters={"alloc_stalls": 1}, target=600 * MiB, last_actual=600 * MiB)
    plan = run(ThinvmPolicy(), [sample], states={"a": state}, limits=limits)
    assert plan.decisions[0].target == 700 * MiB


@pytest.mark.parametrize(
    "counter", ["alloc_stalls", "direct_reclaims", "direct_scans", "oom_kills"]
)
def test_backs_off_at_once_on_guest_stall_or_reclaim(counter: str) -> None:
    policy = ThinvmPolicy()
    # The guest still has free memory by its report, but it stalled.
    before = VmState(
        target=512 * MiB, last_actual=512 * MiB, calm_cycles=9, counters={counter: 3},
        last_used=300 * MiB,
    )  # fmt: skip
    sample = vm(actual=512 * MiB, st=stats(free=212 * MiB, **{counter: 4}))
    plan = run(policy, [sample], states={"a": before}, cycle=20)
    decision = plan.decisions[0]
    assert decision.target is not None
    assert decision.target >= 512 * MiB + int(GiB * policy.params.stress_boost_fraction)
    assert counter.replace("_", " ") in decision.reason
    # ... and it does not shrink again during the cooldown, though it is idle now.
    states = plan.states
    idle = vm(actual=decision.target, st=stats(free=700 * MiB, **{counter: 4}))
    cooldown = policy.cycles(policy.params.stress_cooldown_seconds, 2.0)
    for cycle in range(21, 20 + cooldown):
        plan = run(policy, [idle], states=states, cycle=cycle)
        states = plan.states
        assert plan.decisions[0].target is None, plan.decisions[0].reason


def test_6_1_guest_nearly_out_of_memory_counts_as_stressed() -> None:
    before = VmState(target=400 * MiB, last_actual=400 * MiB, calm_cycles=9, last_used=380 * MiB)
    plan = run(
        ThinvmPolicy(), [vm(actual=400 * MiB, st=stats(free=20 * MiB))], states={"a": before}
    )
    assert plan.decisions[0].target is not None and plan.decisions[0].target > 400 * MiB
    assert "below half its headroom" in plan.decisions[0].reason


def test_deflate_is_fast_inflate_is_slow() -> None:
    policy = ThinvmPolicy()
    grow_state = VmState(target=300 * MiB, last_actual=300 * MiB, last_used=250 * MiB)
    grow = run(policy, [vm(actual=300 * MiB, st=stats(free=50 * MiB, available=50 * MiB))],
               states={"a": grow_state}).decisions[0]  # fmt: skip
    # the guest grew by 0 MiB, is not stalled, but has less than its headroom: grows fully
    assert grow.target is not None and grow.target - 300 * MiB > policy.params.inflate_step
    shrink_state = VmState(calm_cycles=9, last_used=124 * MiB, last_actual=1 * GiB)
    shrink = run(policy, [vm(st=stats(free=900 * MiB))], states={"a": shrink_state}).decisions[0]
    assert shrink.target == 1 * GiB - policy.params.inflate_step


def test_growth_never_takes_more_than_the_host_can_spare() -> None:
    policy = ThinvmPolicy()
    host = HostSample(total=4 * GiB, available=400 * MiB)  # reserve is 328 MiB
    reserve = max(
        policy.params.host_reserve_min, int(4 * GiB * policy.params.host_reserve_fraction)
    )
    state = VmState(target=300 * MiB, last_actual=300 * MiB, counters={"alloc_stalls": 0})
    sample = vm(actual=300 * MiB, st=stats(free=10 * MiB, alloc_stalls=5))
    decision = run(policy, [sample], host=host, states={"a": state}).decisions[0]
    assert decision.target is not None
    assert decision.target - 300 * MiB <= 400 * MiB - reserve
    # with nothing to spare, not even a stalled guest grows past its floor
    broke = HostSample(total=4 * GiB, available=reserve - 10 * MiB)
    decision = run(policy, [sample], host=broke, states={"a": state}).decisions[0]
    assert decision.target is None and "host cannot spare" in decision.reason


def test_scarce_memory_goes_to_stalled_guests_first_then_by_shares() -> None:
    policy = ThinvmPolicy()
    host = HostSample(total=8 * GiB, available=int(8 * GiB * 0.08) + 300 * MiB)
    stalled = vm("s", actual=300 * MiB, st=stats(free=10 * MiB, alloc_stalls=2))
    # short of their headroom, not stalled
    hungry = [vm(n, actual=300 * MiB, st=stats(free=80 * MiB)) for n in ("x", "y")]
    states = {
        "s": VmState(target=300 * MiB, last_actual=300 * MiB, counters={"alloc_stalls": 1}),
        "x": VmState(target=300 * MiB, last_actual=300 * MiB, last_used=270 * MiB),
        "y": VmState(target=300 * MiB, last_actual=300 * MiB, last_used=270 * MiB),
    }
    limits = {
        "s": VmLimits(256 * MiB, 1 * GiB),
        "x": VmLimits(256 * MiB, 1 * GiB, shares=3000),
        "y": VmLimits(256 * MiB, 1 * GiB, shares=1000),
    }
    plan = run(policy, [stalled, *hungry], host=host, states=states, limits=limits)
    grants = {d.vm: (d.target or 300 * MiB) - 300 * MiB for d in plan.decisions}
    assert grants["s"] >= int(GiB * policy.params.stress_boost_fraction)
    assert grants["x"] > grants["y"]
    assert sum(grants.values()) <= 300 * MiB


def test_host_pressure_reclaims_from_idle_guests_not_the_busy_one() -> None:
    policy = ThinvmPolicy()
    host = HostSample(total=4 * GiB, available=200 * MiB, psi_some_avg10=25.0, psi_full_avg10=3.0)
    # idle: a lot of page cache, little free; busy: using more every cycle
    idle = vm("idle", actual=1 * GiB, st=stats(free=100 * MiB, available=700 * MiB))
    busy = vm("busy", actual=1 * GiB, st=stats(free=300 * MiB, available=350 * MiB))
    states = {
        "idle": VmState(calm_cycles=5, last_used=924 * MiB, last_actual=1 * GiB),
        "busy": VmState(calm_cycles=0, last_used=500 * MiB, last_actual=1 * GiB),
    }
    plan = run(policy, [idle, busy], host=host, states=states)
    by_vm = {d.vm: d for d in plan.decisions}
    assert by_vm["idle"].target == 1 * GiB - policy.params.inflate_step_pressure
    assert by_vm["busy"].target is None


def test_calm_host_lets_guests_keep_their_page_cache() -> None:
    # same idle guest, calm host: only its free memory beyond headroom goes
    sample = vm(actual=1 * GiB, st=stats(free=100 * MiB, available=700 * MiB))
    plan, _ = settle(ThinvmPolicy(), sample, cycles=4)
    assert plan.decisions[0].target is None


def test_migrating_vm_is_left_alone() -> None:
    plan, _ = settle(ThinvmPolicy(), vm(st=stats(free=900 * MiB), migrating=True), cycles=5)
    assert plan.decisions[0].target is None and "migrating" in plan.decisions[0].reason


@pytest.mark.parametrize("backing", [Backing.HUGETLBFS, Backing.PINNED])
def test_unballoonable_backing_is_left_alone(backing: Backing) -> None:
    plan, _ = settle(ThinvmPolicy(), vm(st=stats(free=900 * MiB), backing=backing), cycles=5)
    assert plan.decisions[0].target is None


def test_shares_zero_opts_out() -> None:
    limits = {"a": VmLimits(256 * MiB, 1 * GiB, shares=0)}
    plan = run(ThinvmPolicy(), [vm(st=stats(free=900 * MiB))], limits=limits)
    assert plan.decisions[0].target is None and "shares 0" in plan.decisions[0].reason


def test_dead_driver_is_noticed_cancelled_and_not_asked_again() -> None:
    params = ThinvmParams(stuck_limit=3, retry_after=10)
    policy = ThinvmPolicy(params)
    sample = vm(actual=1 * GiB, st=stats(free=900 * MiB))
    states = {"a": VmState(target=600 * MiB, last_actual=1 * GiB, calm_cycles=9, last_used=0)}
    decisions = []
    for cycle in range(20, 40):
        plan = run(policy, [sample], states=states, cycle=cycle)
        states = plan.states
        decisions.append(plan.decisions[0])
    cancel = [d for d in decisions if d.target is not None]
    assert cancel[0].target == 1 * GiB and "did not follow" in cancel[0].reason
    assert decisions.index(cancel[0]) == params.stuck_limit - 1
    # after cancelling it stays quiet until the retry cycle
    quiet = decisions[params.stuck_limit : params.stuck_limit + params.retry_after - 1]
    assert all(d.target is None for d in quiet)


def test_a_slow_but_moving_driver_is_not_given_up() -> None:
    policy = ThinvmPolicy(ThinvmParams(stuck_limit=2))
    states = {"a": VmState(target=600 * MiB, last_actual=1 * GiB)}
    for cycle, actual in enumerate((980 * MiB, 950 * MiB, 900 * MiB, 850 * MiB)):
        plan = run(
            policy,
            [vm(actual=actual, st=stats(free=actual - 300 * MiB))],
            states=states,
            cycle=cycle,
        )
        states = plan.states
        assert "did not follow" not in plan.decisions[0].reason


def test_state_round_trips_through_json() -> None:
    _plan, states = settle(ThinvmPolicy(), vm(st=stats(free=800 * MiB, alloc_stalls=1)), cycles=3)
    text = json.dumps({k: v.to_json() for k, v in states.items()})
    assert {k: VmState.from_json(v) for k, v in json.loads(text).items()} == states


# -- Proxmox pvestatd --------------------------------------------------------


def pve_host(used_fraction: float, total: int = 10 * GiB) -> HostSample:
    return HostSample(total=total, available=int(total * (1 - used_fraction)))


def test_proxmox_shrinks_at_most_100_mib_per_10_s_above_80_percent() -> None:
    vms = [vm(n, actual=1 * GiB, st=stats(free=700 * MiB)) for n in ("a", "b")]
    plan = run(ProxmoxPolicy(), vms, host=pve_host(0.95), interval=10.0)
    assert [d.target for d in plan.decisions] == [1 * GiB - 100 * MiB] * 2
    plan = run(ProxmoxPolicy(), vms, host=pve_host(0.95), interval=2.0)
    assert [d.target for d in plan.decisions] == [1 * GiB - 20 * MiB] * 2


def test_proxmox_dead_band_of_10_mib() -> None:
    total = 10 * GiB
    host = HostSample(total=total, available=int(total * 0.2) + 5 * MiB)  # goal = -5 MiB
    plan = run(ProxmoxPolicy(), [vm(actual=512 * MiB, st=stats(300 * MiB))], host=host)
    assert plan.decisions[0].target is None


def test_proxmox_grows_tight_guests_first_and_never_below_floor() -> None:
    limits = {n: VmLimits(floor=512 * MiB, ceiling=1 * GiB) for n in ("tight", "roomy")}
    tight = vm("tight", actual=600 * MiB, st=stats(free=100 * MiB))  # <= 25% of floor
    roomy = vm("roomy", actual=600 * MiB, st=stats(free=400 * MiB))
    total = 10 * GiB
    host = HostSample(total=total, available=int(total * 0.2) + 50 * MiB)  # goal = +50 MiB
    plan = run(ProxmoxPolicy(), [tight, roomy], host=host, limits=limits, interval=10.0)
    by_vm = {d.vm: d.target for d in plan.decisions}
    assert by_vm["tight"] == 650 * MiB and by_vm["roomy"] is None
    plan = run(ProxmoxPolicy(), [tight, roomy], host=pve_host(0.99), limits=limits, interval=10)
    assert all(d.target is None or d.target >= 512 * MiB for d in plan.decisions)


def test_proxmox_skips_migrating_and_statless_vms_but_ignores_stats_age() -> None:
    vms = [
        vm("m", st=stats(700 * MiB), migrating=True),
        vm("n", st=None),
        vm("old", st=stats(700 * MiB, age=3600)),
    ]
    plan = run(ProxmoxPolicy(), vms, host=pve_host(0.95), interval=10.0)
    by_vm = {d.vm: d.target for d in plan.decisions}
    assert by_vm == {"m": None, "n": None, "old": 1 * GiB - 100 * MiB}


# -- oVirt MOM ---------------------------------------------------------------


def test_mom_shrinks_5_percent_per_cycle_under_pressure() -> None:
    host = HostSample(total=10 * GiB, available=int(10 * GiB * 0.15))
    plan = run(MomPolicy(), [vm(actual=1 * GiB, st=stats(free=800 * MiB))], host=host, interval=10)
    assert plan.decisions[0].target == int(1 * GiB * 0.95)


def test_mom_shrink_stops_at_used_plus_scaled_free() -> None:
    host = HostSample(total=10 * GiB, available=int(10 * GiB * 0.10))  # half the threshold
    sample = vm(actual=1000 * MiB, st=stats(free=120 * MiB))
    plan = run(MomPolicy(), [sample], host=host, interval=10)
    # used 880 MiB + 10% of 1000 MiB = 980 MiB > 95% of 1000 MiB
    assert plan.decisions[0].target == int(880 * MiB + 0.1 * 1000 * MiB)


def test_mom_critical_pressure_squeezes_below_used() -> None:
    host = HostSample(total=10 * GiB, available=int(10 * GiB * 0.02))
    limits = {"a": VmLimits(floor=100 * MiB, ceiling=1 * GiB)}
    sample = vm(actual=600 * MiB, st=stats(free=10 * MiB))
    plan = run(MomPolicy(), [sample], host=host, interval=10, limits=limits)
    assert plan.decisions[0].target is not None and plan.decisions[0].target < 590 * MiB


def test_mom_grows_5_percent_without_pressure_and_skips_tiny_changes() -> None:
    plan = run(MomPolicy(), [vm(actual=600 * MiB, st=stats(free=400 * MiB))], interval=10)
    assert plan.decisions[0].target == int(600 * MiB * 1.05)
    plan = run(MomPolicy(), [vm(actual=1 * GiB - 1 * MiB, st=stats(free=400 * MiB))], interval=10)
    assert plan.decisions[0].target is None  # 1 MiB < 0.25%


def test_mom_averages_the_last_ten_samples() -> None:
    host = HostSample(total=10 * GiB, available=int(10 * GiB * 0.10))
    states = {"a": VmState(history=((600 * MiB, 500 * MiB),) * 9)}
    plan = run(
        MomPolicy(), [vm(actual=600 * MiB, st=stats(free=0))], host=host, states=states, interval=10
    )
    assert plan.states["a"].history[-1] == (600 * MiB, 0)
    assert len(plan.states["a"].history) == 10
    # the average free (450 MiB) still lets it shrink the full 5 %
    assert plan.decisions[0].target == int(600 * MiB * 0.95)


def test_recorded_6_12_stall_makes_the_policy_deflate_at_once() -> None:
    """A real 6.12 guest ballooned to 400 MiB, then touching all its free memory.

    Its report after the touch shows 34 allocation stalls and one OOM kill
    (the toucher); the next cycle must give memory back, not hold.
    """
    recorded = json.loads((DATA / "guest-stats-6.12-stall.json").read_text())
    actual = recorded["actual"]
    policy = ThinvmPolicy()
    states: dict[str, VmState] = {}
    for cycle, key in enumerate(("before", "before", "after")):
        reply = recorded[key]
        sample = VmSample(
            "g", 1 * GiB, actual, parse_guest_stats(reply, now=reply["last-update"] + 1)
        )
        plan = run(policy, [sample], states=states, cycle=cycle)
        states = plan.states
    decision = plan.decisions[0]
    assert decision.target is not None and decision.target > actual
    assert "alloc stalls +34" in decision.reason and "oom kills +1" in decision.reason


def test_calm_host_leaves_a_reporting_guests_free_memory_to_reporting() -> None:
    sample = VmSample("a", 1 * GiB, 1 * GiB, stats(free=800 * MiB), reporting=True)
    plan, _ = settle(ThinvmPolicy(), sample, cycles=6)
    assert plan.decisions[0].target is None
    assert "free page reporting" in plan.decisions[0].reason


def test_reporting_guest_is_shrunk_under_pressure_and_given_back_when_calm() -> None:
    policy = ThinvmPolicy()
    sample = VmSample("a", 1 * GiB, 1 * GiB, stats(free=800 * MiB), reporting=True)
    squeezed = HostSample(total=4 * GiB, available=100 * MiB, psi_some_avg10=30.0)
    plan, states = settle(policy, sample, cycles=5, host=squeezed)
    assert states["a"].target is not None and states["a"].target < 1 * GiB
    shrunk = states["a"].target
    shrunk_sample = VmSample("a", 1 * GiB, shrunk, stats(free=shrunk - 224 * MiB), reporting=True)
    plan = run(policy, [shrunk_sample], states=states, cycle=6)
    assert plan.decisions[0].target == shrunk + policy.params.inflate_step


# -- trim first --------------------------------------------------------------

RECLAIMER_OFF = Reclaimer(available=True, background=False)
RECLAIMER_ON = Reclaimer(available=True, background=True, reclaimed_bytes=300 * MiB)
# Pressure the guests' reclaimers can relieve: over the reserve, not critical.
PRESSED = HostSample(total=4 * GiB, available=250 * MiB, psi_some_avg10=25.0, psi_full_avg10=0.0)
CRITICAL = HostSample(total=4 * GiB, available=100 * MiB, psi_some_avg10=40.0, psi_full_avg10=5.0)


def cached_guest(reclaimer: Reclaimer | None, reporting: bool = True) -> VmSample:
    """An idle guest holding 600 MiB of page cache, little of it free."""
    st = stats(free=100 * MiB, available=700 * MiB, caches=600 * MiB)
    return VmSample("a", 1 * GiB, 1 * GiB, st, reporting=reporting, reclaimer=reclaimer)


def test_a_reporting_guest_with_a_reclaimer_gets_it_switched_on_once() -> None:
    policy = ThinvmPolicy()
    plan = run(policy, [cached_guest(RECLAIMER_OFF)])
    assert plan.decisions[0].reclaim is True and "trim first" in plan.decisions[0].reason
    plan = run(policy, [cached_guest(RECLAIMER_ON)], states=plan.states)
    assert plan.decisions[0].reclaim is None


@pytest.mark.parametrize(
    "sample",
    [
        cached_guest(None),  # no agent, an old one, a libvirt domain
        cached_guest(Reclaimer(available=False, background=False)),  # no memory.reclaim
        cached_guest(RECLAIMER_OFF, reporting=False),  # the host would get nothing back
    ],
)
def test_no_trimming_where_it_cannot_return_memory(sample: VmSample) -> None:
    assert run(ThinvmPolicy(), [sample]).decisions[0].reclaim is None
    assert run(ThinvmPolicy(ThinvmParams(trim=False)), [sample]).decisions[0].reclaim is None


def test_pressure_a_trimming_guest_relieves_itself_is_not_ballooned() -> None:
    policy = ThinvmPolicy()
    calm = VmState(calm_cycles=10, last_used=924 * MiB, last_actual=1 * GiB)
    trimming = run(policy, [cached_guest(RECLAIMER_ON)], host=PRESSED, states={"a": calm})
    assert trimming.decisions[0].target is None
    assert "trims its cold memory" in trimming.decisions[0].reason
    # The same guest without a reclaimer: the balloon takes its cache.
    plain = run(policy, [cached_guest(None)], host=PRESSED, states={"a": calm})
    assert plain.decisions[0].target == 1 * GiB - policy.params.inflate_step_pressure


def test_critical_host_never_balloons_a_trimming_guest() -> None:
    """What reporting and trimming leave is the working set: ballooned, a
    guest that grows again while the host has nothing to spare OOMs (seen
    in overcommit trial runs)."""
    policy = ThinvmPolicy()
    calm = VmState(calm_cycles=10, last_used=824 * MiB, last_actual=1 * GiB)
    st = stats(free=400 * MiB, available=800 * MiB, caches=400 * MiB)
    trimming = VmSample("a", 1 * GiB, 1 * GiB, st, reporting=True, reclaimer=RECLAIMER_ON)
    plan = run(policy, [trimming], host=CRITICAL, states={"a": calm})
    assert plan.decisions[0].target is None
    assert "trims its cold memory" in plan.decisions[0].reason
    assert plan.decisions[0].trim is not None  # the cache goes by trimming instead
    # Without a reclaimer the balloon takes memory (a full step).
    plain = replace(trimming, reclaimer=None)
    plan = run(policy, [plain], host=CRITICAL, states={"a": calm})
    assert plan.decisions[0].target == 1 * GiB - policy.params.inflate_step_pressure


def test_working_set_estimate_leaves_out_cache_above_the_floor() -> None:
    policy = ThinvmPolicy()
    plan = run(policy, [cached_guest(RECLAIMER_OFF)])
    # used 924 MiB, cache 600 MiB of which the floor (64 MiB on 1 GiB) stays
    assert plan.states["a"].working_set == (924 - (600 - 64)) * MiB
    assert policy.working_set(vm(st=None)) is None


def test_under_pressure_a_calm_trimming_guest_is_asked_to_trim_its_cold_cache_now() -> None:
    policy = ThinvmPolicy()
    calm = VmState(calm_cycles=10, last_used=924 * MiB, last_actual=1 * GiB)
    plan = run(policy, [cached_guest(RECLAIMER_ON)], host=PRESSED, states={"a": calm})
    assert plan.decisions[0].trim == policy.params.trim_step  # 536 MiB cold, one step
    # A calm host: the background reclaimer is enough.
    plan = run(policy, [cached_guest(RECLAIMER_ON)], states={"a": calm})
    assert plan.decisions[0].trim is None


def test_cache_a_trim_could_not_take_is_hot_and_not_asked_for_again() -> None:
    """A guest whose hot cache sits above the floor the balloon statistics
    allow for was asked to trim 23 MiB every second for a minute."""
    policy = ThinvmPolicy()
    calm = VmState(calm_cycles=10, last_used=924 * MiB, last_actual=1 * GiB)
    stopped = replace(RECLAIMER_ON, cache_floor=590 * MiB)  # of the 600 MiB cached
    plan = run(policy, [cached_guest(stopped)], host=PRESSED, states={"a": calm})
    assert plan.decisions[0].trim is None
    assert plan.states["a"].working_set == (924 - 10) * MiB
    # Cache read since then is cold again: only that much is asked for.
    partly = replace(RECLAIMER_ON, cache_floor=400 * MiB)
    plan = run(policy, [cached_guest(partly)], host=PRESSED, states={"a": calm})
    assert plan.decisions[0].trim == 200 * MiB


def test_a_stalling_guests_cache_is_not_trimmed() -> None:
    policy = ThinvmPolicy()
    st = stats(free=100 * MiB, available=700 * MiB, caches=600 * MiB, alloc_stalls=9)
    sample = VmSample("a", 1 * GiB, 1 * GiB, st, reporting=True, reclaimer=RECLAIMER_ON)
    before = VmState(calm_cycles=10, last_used=924 * MiB, counters={"alloc_stalls": 1})
    plan = run(policy, [sample], host=PRESSED, states={"a": before})
    assert plan.decisions[0].trim is None and "alloc stalls +8" in plan.decisions[0].reason


# -- thinvm: virtio-mem ------------------------------------------------------

BASE = 512 * MiB
VMEM = 1 * GiB


def vmem_guest(
    plugged: int = VMEM,
    used: int = 150 * MiB,
    block: int = 2 * MiB,
    balloon_actual: int | None = BASE,
    age: float = 1.0,
    **kw: object,
) -> VmSample:
    """A 512 MiB + 1 GiB virtio-mem guest that uses `used` and has the rest free."""
    device = VirtioMem(BASE, plugged, plugged, block, VMEM)
    actual = (BASE if balloon_actual is None else balloon_actual) + plugged
    st = GuestStats(age=age, total=actual, free=actual - used, available=actual - used)
    levers = (Lever.VIRTIO_MEM,) if balloon_actual is None else (Lever.BALLOON, Lever.VIRTIO_MEM)
    return VmSample(
        "v", BASE + VMEM, actual, st if balloon_actual is not None else None,
        levers=levers, virtio_mem=device, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def follow(policy: ThinvmPolicy, sample: VmSample, cycles: int, **kw: object) -> list[int]:
    """Cycles of a guest that plugs and unplugs whatever the targets ask."""
    states: dict[str, VmState] = {}
    targets = []
    for cycle in range(cycles):
        plan = run(policy, [sample], states=states, cycle=cycle, **kw)  # type: ignore[arg-type]
        states = plan.states
        target = plan.decisions[0].target
        if target is not None:
            targets.append(target)
            assert sample.virtio_mem is not None
            plugged = sample.virtio_mem.requested_for(target)
            used = sample.actual - sample.stats.free if sample.stats and sample.actual else 0
            sample = vmem_guest(plugged=plugged, used=used, block=sample.virtio_mem.block_size)
    return targets


def test_virtio_mem_requested_size_is_whole_blocks_above_the_base_within_its_maximum() -> None:
    device = VirtioMem(BASE, 0, 0, 2 * MiB, VMEM)
    assert device.requested_for(BASE + 300 * MiB) == 300 * MiB
    assert device.requested_for(BASE + 301 * MiB) == 300 * MiB  # rounded down
    assert device.requested_for(256 * MiB) == 0  # never into the base memory
    assert device.requested_for(4 * GiB) == VMEM
    assert VirtioMem(BASE, 0, 0, 128 * MiB, VMEM).round(BASE + 300 * MiB) == BASE + 256 * MiB


def test_virtio_mem_limits_keep_the_base_memory_and_whole_blocks() -> None:
    sample = vmem_guest(block=128 * MiB)
    assert sample.lever is Lever.VIRTIO_MEM
    assert sample.fit(VmLimits(256 * MiB, 4 * GiB)) == VmLimits(BASE, BASE + VMEM)
    # A floor above the base is rounded up to a whole block.
    assert sample.fit(VmLimits(700 * MiB, BASE + VMEM)).floor == BASE + 256 * MiB
    assert vm().fit(VmLimits(256 * MiB, GiB)) == VmLimits(256 * MiB, GiB)  # balloon: as given


def test_idle_virtio_mem_guest_is_unplugged_step_by_step_down_to_its_base_only() -> None:
    policy = ThinvmPolicy()
    targets = follow(policy, vmem_guest(), 40, limits={"v": VmLimits(256 * MiB, BASE + VMEM)})
    assert targets[-1] == BASE  # the floor is the base memory, not 256 MiB
    steps = [a - b for a, b in zip([BASE + VMEM, *targets], targets, strict=False)]
    assert all(0 < step <= policy.params.inflate_step for step in steps), steps
    assert all((t - BASE) % (2 * MiB) == 0 for t in targets)


def test_virtio_mem_blocks_larger_than_a_step_are_unplugged_one_block_at_a_time() -> None:
    policy = ThinvmPolicy()
    targets = follow(policy, vmem_guest(block=256 * MiB), 6)
    assert targets[0] == BASE + VMEM - 256 * MiB


def test_virtio_mem_guest_is_never_unplugged_on_stale_or_missing_stats() -> None:
    plan, _ = settle(ThinvmPolicy(), vmem_guest(age=60.0), cycles=6)
    assert plan.decisions[0].target is None and "60 s old" in plan.decisions[0].reason
    # Without a balloon there are no statistics at all: left alone, not even plugged.
    plan, _ = settle(ThinvmPolicy(), vmem_guest(plugged=0, balloon_actual=None), cycles=6)
    assert plan.decisions[0].target is None and "left alone" in plan.decisions[0].reason


def test_a_stalling_virtio_mem_guest_is_plugged_at_once_within_its_maximum() -> None:
    policy = ThinvmPolicy()
    sample = vmem_guest(plugged=0, used=500 * MiB)
    sample = replace(sample, stats=replace(sample.stats, alloc_stalls=5))  # type: ignore[type-var]
    state = VmState(
        target=BASE, last_actual=BASE, last_used=500 * MiB, counters={"alloc_stalls": 1}
    )
    plan = run(policy, [sample], states={"v": state})
    target = plan.decisions[0].target
    # max(headroom, a quarter of 1.5 GiB) more, in one step
    assert target == BASE + 384 * MiB and "deflate at once" in plan.decisions[0].reason
    plan = run(policy, [vmem_guest(plugged=VMEM - 64 * MiB, used=1400 * MiB)],
               states={"v": state.but(target=None)})  # fmt: skip
    assert plan.decisions[0].target == BASE + VMEM  # not beyond what the device has


def test_a_virtio_mem_guest_grows_only_with_memory_the_host_can_spare() -> None:
    policy = ThinvmPolicy()
    sample = vmem_guest(plugged=0, used=500 * MiB, block=128 * MiB)
    state = VmState(target=BASE, last_actual=BASE, last_used=400 * MiB)
    # The host has 64 MiB beyond its reserve: less than one 128 MiB block.
    host = HostSample(total=4 * GiB, available=int(4 * GiB * 0.08) + 64 * MiB)
    plan = run(policy, [sample], host=host, states={"v": state})
    assert plan.decisions[0].target is None
    assert "whole virtio-mem block" in plan.decisions[0].reason


def test_migrating_virtio_mem_vm_is_left_alone() -> None:
    plan, _ = settle(ThinvmPolicy(), vmem_guest(migrating=True), cycles=6)
    assert plan.decisions[0].target is None and "migrating" in plan.decisions[0].reason


def test_a_virtio_mem_driver_that_does_not_unplug_is_given_up() -> None:
    policy = ThinvmPolicy()
    sample = vmem_guest()
    state = VmState(target=BASE + 896 * MiB, last_actual=sample.actual, last_used=150 * MiB)
    states = {"v": state}
    decisions = []
    for cycle in range(10, 10 + policy.params.stuck_limit):
        plan = run(policy, [sample], states=states, cycle=cycle)
        states = plan.states
        decisions.append(plan.decisions[0])
    assert decisions[-1].target == BASE + VMEM  # cancelled: requested-size = size
    assert "did not follow" in decisions[-1].reason
    plan = run(policy, [sample], states=states, cycle=20)
    assert plan.decisions[0].target is None and "asking again" in plan.decisions[0].reason


def test_a_balloon_left_inflated_inside_the_base_is_given_back() -> None:
    # 'thinvm balloon v 300M' earlier, handed back: below the base, the floor.
    plan = run(ThinvmPolicy(), [vmem_guest(plugged=0, balloon_actual=300 * MiB)])
    assert plan.decisions[0].target == BASE and "below its floor" in plan.decisions[0].reason


def test_a_trimming_virtio_mem_guest_is_never_unplugged_even_when_the_host_is_critical() -> None:
    """The trim-first rule holds for virtio-mem as for the balloon: reporting
    has the guest's free memory already, so an unplug gains the host
    nothing, and a regrow would wait for memory the host may not have."""
    policy = ThinvmPolicy()
    calm = VmState(calm_cycles=10, last_used=150 * MiB, last_actual=BASE + VMEM)
    trimming = vmem_guest(reporting=True, reclaimer=RECLAIMER_ON)
    for host in (CALM_HOST, PRESSED, CRITICAL):
        plan = run(policy, [trimming], host=host, states={"v": calm})
        assert plan.decisions[0].target is None, host
    # Reporting alone leaves it whole while the host is calm ...
    reporting = vmem_guest(reporting=True)
    assert run(policy, [reporting], states={"v": calm}).decisions[0].target is None
    # ... and under pressure virtio-mem takes a step of its free memory.
    plan = run(policy, [reporting], host=PRESSED, states={"v": calm})
    step = policy.params.inflate_step_pressure
    assert plan.decisions[0].target == BASE + VMEM - step


def test_shares_zero_leaves_a_virtio_mem_vm_alone() -> None:
    limits = {"v": VmLimits(BASE, BASE + VMEM, shares=0)}
    plan = run(ThinvmPolicy(), [vmem_guest()], limits=limits)
    assert plan.decisions[0].target is None and "shares 0" in plan.decisions[0].reason
