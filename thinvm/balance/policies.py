"""Balloon policies: pure functions from one cycle's samples to targets.

Three policies share one interface so they can be measured side by side:

- `thinvm` (ours): host PSI and MemAvailable plus the guest's own free
  memory and, on Linux 6.12 guests, its stall/reclaim/OOM counters.
  Deflates fast and inflates slowly, never shrinks on stale stats,
  never grows a guest with memory the host does not have.
- `proxmox`: pve-manager's pvestatd auto-ballooning (PVE/AutoBalloon.pm
  `compute_alg1`, PVE/Service/pvestatd.pm `auto_balloning`).
- `mom`: oVirt MOM's doc/balloon.rules.

A policy sees only data (thinvm.balance.model); the daemon does the I/O.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from thinvm.balance.model import (
    Backing,
    Decision,
    HostSample,
    Plan,
    VmLimits,
    VmSample,
    VmState,
)
from thinvm.units import MiB, format_size
from thinvm.vm.resize import Lever


@dataclass(frozen=True)
class Inputs:
    """Everything a policy decides from, for one cycle."""

    cycle: int
    interval: float  # seconds between cycles
    host: HostSample
    vms: Sequence[VmSample]
    limits: Mapping[str, VmLimits]
    states: Mapping[str, VmState]

    def limits_of(self, vm: VmSample) -> VmLimits:
        """The VM's limits, as its lever can keep them (VmSample.fit)."""
        return vm.fit(self.limits.get(vm.name) or VmLimits.default_for(vm.max_memory))

    def state_of(self, vm: VmSample) -> VmState:
        return self.states.get(vm.name) or VmState()


class Policy(Protocol):
    name: str

    def decide(self, inputs: Inputs) -> Plan: ...


def _mib(size: float) -> str:
    return format_size(size)


# ---------------------------------------------------------------------------
# thinvm


@dataclass(frozen=True)
class ThinvmParams:
    """Tuning of the thinvm policy; every default is explained in docs/balance.md."""

    stale_after: float = 0.0  # 0: three intervals plus two seconds
    host_reserve_fraction: float = 0.08  # of the host total, kept free
    host_reserve_min: int = 128 * MiB
    psi_some_high: float = 10.0  # host memory some avg10 (%): pressure
    psi_full_high: float = 2.0  # host memory full avg10 (%): critical
    headroom_fraction: float = 0.12  # of the guest's RAM, kept free in it
    headroom_min: int = 96 * MiB
    inflate_step: int = 128 * MiB  # most a guest shrinks per cycle
    inflate_step_pressure: int = 256 * MiB  # ... when the host is under pressure
    stress_boost_fraction: float = 0.25  # of the guest's RAM, given at a stall
    dead_band: int = 16 * MiB  # smaller changes are not worth a request
    calm_seconds: float = 6.0  # quiet time before a guest may shrink
    grow_cooldown_seconds: float = 10.0  # no shrinking this soon after a grow
    stress_cooldown_seconds: float = 30.0  # ... or after a stall
    growth_half_life: float = 30.0  # seconds: how long a burst of growth is remembered
    stuck_limit: int = 5  # cycles a target may go unfollowed
    retry_after: int = 60  # cycles before asking an unresponsive driver again
    tolerance: int = 8 * MiB  # |actual - target| that counts as reached
    # A guest with free page reporting is shrunk only under host pressure.
    leave_reported_free: bool = True
    # Trim first: a reporting guest whose agent has a reclaimer runs it in
    # the background (pressure-gated in the guest, docs/working-set.md), so
    # its cold page cache goes back to the host through reporting; the
    # balloon then shrinks it only when the host is critical.
    trim: bool = True
    # The reclaimer's page cache floor, as the agent computes it (without
    # the active-file part the balloon statistics do not carry).
    cache_floor_min: int = 64 * MiB
    cache_floor_fraction: float = 1 / 32
    # Under host pressure a trimming guest with cold cache is also asked to
    # trim now, at most this much per cycle: the background reclaimer takes
    # about 1 % of the guest's memory a second, too slow for a squeeze.
    trim_step: int = 256 * MiB
    trim_min: int = 16 * MiB  # less cold cache than this is not worth a request


@dataclass(frozen=True)
class _HostView:
    reserve: int
    spare: int  # available beyond the reserve; negative: reclaim this much
    pressure: bool
    critical: bool
    why: str


def _host_view(host: HostSample, params: ThinvmParams) -> _HostView:
    reserve = max(params.host_reserve_min, int(host.total * params.host_reserve_fraction))
    spare = host.available - reserve
    some = host.psi_some_avg10 or 0.0
    full = host.psi_full_avg10 or 0.0
    critical = full >= params.psi_full_high or host.available < reserve // 2
    pressure = critical or some >= params.psi_some_high or spare < 0
    why = (
        f"host available {_mib(host.available)}, reserve {_mib(reserve)}, "
        f"PSI some {some:.1f}% full {full:.1f}%"
    )
    return _HostView(reserve, spare, pressure, critical, why)


@dataclass
class _Want:
    """One VM's wish for this cycle, before the host budget is applied."""

    vm: VmSample
    limits: VmLimits
    state: VmState
    desired: int | None  # None: leave the target alone
    reason: str
    stressed: bool = False
    may_shrink: bool = False
    cancel: bool = False  # the driver did not follow: set target = actual


@dataclass(frozen=True)
class _Seen:
    """What one cycle's guest statistics say, and the VM's state after them."""

    state: VmState
    bumped: dict[str, int]  # stress counters that grew since the last cycle
    tight: bool  # available memory below half the headroom
    report_current: bool  # the report is newer than the balloon's last move
    available: int
    headroom: int


class ThinvmPolicy:
    name = "thinvm"

    def __init__(self, params: ThinvmParams | None = None) -> None:
        self.params = params or ThinvmParams()

    def stale_after(self, interval: float) -> float:
        return self.params.stale_after or 3 * interval + 2.0

    @staticmethod
    def cycles(seconds: float, interval: float) -> int:
        """A duration in whole cycles (at least one)."""
        return max(1, math.ceil(seconds / interval - 1e-9))

    def decide(self, inputs: Inputs) -> Plan:
        host = _host_view(inputs.host, self.params)
        wants = [self._want(inputs, vm, host) for vm in inputs.vms]
        reclaim = {vm.name: self._reclaim_wish(vm, inputs.limits_of(vm)) for vm in inputs.vms}
        decisions: dict[str, Decision] = {}
        states: dict[str, VmState] = {}
        self._grant_growth(wants, host, decisions)
        for want in wants:
            if want.vm.name not in decisions:
                decisions[want.vm.name] = self._shrink_or_hold(want, host, inputs.cycle)
            decision = decisions[want.vm.name]
            state = want.state
            if (
                decision.acts
                and decision.target is not None
                and decision.target > (_current_target(want) if want.vm.actual is not None else 0)
            ):
                # Hysteresis: a guest that just got memory keeps it a while.
                until = inputs.cycle + self.cycles(
                    self.params.grow_cooldown_seconds, inputs.interval
                )
                state = state.but(cooldown_until=max(state.cooldown_until, until))
            target = decision.target if decision.acts else state.target
            if reclaim[want.vm.name] is not None:
                decision = replace(
                    decision,
                    reclaim=reclaim[want.vm.name],
                    reason=f"{decision.reason}; trim first: guest reclaimer on",
                )
            trim_now = self._trim_now(want, host)
            if trim_now:
                decision = replace(
                    decision,
                    trim=trim_now,
                    reason=f"{decision.reason}; host short: trim {_mib(trim_now)} of cold cache",
                )
            decisions[want.vm.name] = decision
            states[want.vm.name] = state.but(
                target=target,
                reason=decision.reason,
                working_set=self.working_set(want.vm) or state.working_set,
            )
        return Plan([decisions[vm.name] for vm in inputs.vms], states)

    # -- trimming ----------------------------------------------------------
    def _trims(self, vm: VmSample) -> bool:
        """Whether the guest's own reclaimer returns its cold memory: it
        runs (or is being switched on) and reporting hands it to the host."""
        rec = vm.reclaimer
        return self.params.trim and vm.reporting and rec is not None and rec.available

    def _reclaim_wish(self, vm: VmSample, limits: VmLimits) -> bool | None:
        if _unmanaged(vm, limits) or not self._trims(vm):
            return None
        assert vm.reclaimer is not None
        return None if vm.reclaimer.background else True

    def _trim_now(self, want: _Want, host: _HostView) -> int:
        """Bytes to trim at once: under host pressure, from a calm trimming
        guest's cold cache (never from a stressed one: its cache is hot)."""
        if not host.pressure or want.stressed or not self._trims(want.vm):
            return 0
        if _unmanaged(want.vm, want.limits):
            return 0
        cold = self._cold_cache(want.vm)
        if cold < self.params.trim_min:
            return 0
        return min(cold, self.params.trim_step)

    def _cold_cache(self, vm: VmSample) -> int:
        """Page cache above the reclaimer's floor: what a trim could take.

        The floor computed here lacks the active file list (the balloon
        statistics do not carry it); a recent trim that could go no lower
        says where the floor really is."""
        stats = vm.stats
        if stats is None or not stats.caches:
            return 0
        total = stats.total or vm.max_memory
        floor = max(self.params.cache_floor_min, int(total * self.params.cache_floor_fraction))
        if vm.reclaimer is not None:
            floor = max(floor, vm.reclaimer.cache_floor)
        return max(0, stats.caches - floor)

    def working_set(self, vm: VmSample) -> int | None:
        """What the guest would keep after trimming: used memory minus the
        page cache above the reclaimer's floor.  Before the reclaimer ran
        this counts all such cache as cold; once it ran (and backed off
        where the guest refaulted) the cache left is the hot part, so the
        estimate converges on the working set."""
        stats = vm.stats
        if vm.actual is None or stats is None or stats.free is None:
            return None
        return max(0, vm.actual - stats.free - self._cold_cache(vm))

    # -- per VM ------------------------------------------------------------
    def _want(self, inputs: Inputs, vm: VmSample, host: _HostView) -> _Want:
        limits = inputs.limits_of(vm)
        early, state = self._before_stats(inputs, vm, limits, inputs.state_of(vm))
        if early is not None:
            return early
        seen = self._observe(inputs, vm, state)
        if seen.bumped or seen.tight:
            return self._stressed(inputs, vm, limits, seen)
        return self._steady(inputs, vm, limits, host, seen)

    def _before_stats(
        self, inputs: Inputs, vm: VmSample, limits: VmLimits, state: VmState
    ) -> tuple[_Want | None, VmState]:
        """The wishes that need no guest statistics (a VM left alone, a
        driver that does not follow, statistics missing or stale), or None
        and the state after the follow check."""
        p = self.params
        skip = _unmanaged(vm, limits)
        if skip:
            return _Want(vm, limits, state, None, skip), state
        assert vm.actual is not None
        if state.given_up_until > inputs.cycle:
            why = f"driver did not follow; asking again at cycle {state.given_up_until}"
            return _Want(vm, limits, state, None, why), state
        state, stuck = self._follow_check(vm.actual, state, inputs.cycle)
        if stuck is not None:
            why = (
                f"driver did not follow target {_mib(state.target or 0)} for "
                f"{p.stuck_limit} cycles: cancelled (target = actual); asking again at "
                f"cycle {state.given_up_until}"
            )
            return _Want(vm, limits, state, stuck, why, cancel=True), state
        stats = vm.stats
        if stats is None or stats.age > self.stale_after(inputs.interval):
            age = "missing" if stats is None else f"{stats.age:.0f} s old"
            state = state.but(calm_cycles=0, last_actual=vm.actual, actual_steady_s=0.0)
            give_back = min(limits.ceiling, vm.actual + self._headroom(vm, 0))
            why = f"stats {age}: never shrink; give back"
            return _Want(vm, limits, state, give_back, why), state
        return None, state

    def _observe(self, inputs: Inputs, vm: VmSample, state: VmState) -> _Seen:
        """What this cycle's statistics say about the guest, and its state after."""
        p = self.params
        stats, actual = vm.stats, vm.actual
        assert stats is not None and stats.free is not None and actual is not None
        deltas = {
            k: v - state.counters[k] for k, v in stats.counters().items() if k in state.counters
        }
        bumped = {k: d for k, d in deltas.items() if d > 0}
        # `actual` is the balloon now, the statistics are the guest's last
        # report (up to a stats period old): a report sent before the
        # balloon reached its size counts free memory the balloon has since
        # taken or given.  Such a report says nothing about growth (seen:
        # a guest just ballooned 512 -> 320 MiB looked as if it had grown
        # by 190 MiB and was deflated) and is no ground for shrinking.
        steady = 0.0 if actual != state.last_actual else state.actual_steady_s + inputs.interval
        report_current = stats.age <= steady
        used = actual - stats.free
        growth = used - state.last_used if report_current and state.last_used is not None else 0
        # A guest that grew in a burst may grow as much again: remember the
        # largest recent burst, forgetting it with a half-life.
        decay = 0.5 ** (inputs.interval / p.growth_half_life)
        peak = max(growth, int(state.peak_growth * decay), 0)
        available = stats.available if stats.available is not None else stats.free
        if not report_current and state.last_actual is not None and actual > state.last_actual:
            # The report predates a deflate (ours, last cycle): the guest
            # has that much more now.  Without this one low report deflated
            # a guest twice, 274 -> 530 -> 786 MiB (CI, 2026-11-26).
            available += actual - state.last_actual
        tight = available < self._headroom(vm, 0) // 2
        busy = growth > p.dead_band
        known = state.last_used is not None  # a first sample says nothing about trends
        if bumped or tight or busy:
            calm = 0
        elif not report_current:
            calm = state.calm_cycles  # a late report shows neither calm nor growth
        else:
            calm = state.calm_cycles + 1 if known else 0
        state = state.but(
            counters=stats.counters(),
            last_used=used if report_current else state.last_used,
            last_actual=actual,
            actual_steady_s=steady,
            calm_cycles=calm,
            peak_growth=peak,
        )
        return _Seen(state, bumped, tight, report_current, available, self._headroom(vm, peak))

    def _stressed(self, inputs: Inputs, vm: VmSample, limits: VmLimits, seen: _Seen) -> _Want:
        """The guest's counters show stress or it is short of memory: deflate now."""
        p = self.params
        assert vm.actual is not None
        if seen.bumped:
            grown = (f"{k.replace('_', ' ')} +{d}" for k, d in seen.bumped.items())
            why = "guest " + ", ".join(grown)
        else:
            why = f"guest available {_mib(seen.available)} below half its headroom"
        boost = max(seen.headroom, int(vm.max_memory * p.stress_boost_fraction))
        cooldown = self.cycles(p.stress_cooldown_seconds, inputs.interval)
        state = seen.state.but(cooldown_until=inputs.cycle + cooldown)
        return _Want(vm, limits, state, min(limits.ceiling, vm.actual + boost),
                     f"{why}: deflate at once", stressed=True)  # fmt: skip

    def _steady(
        self, inputs: Inputs, vm: VmSample, limits: VmLimits, host: _HostView, seen: _Seen
    ) -> _Want:
        """No stress: shrink to the guest's spare memory less its headroom,
        or, where reporting returns free memory anyway, give back."""
        p = self.params
        stats, state, headroom, available = vm.stats, seen.state, seen.headroom, seen.available
        assert stats is not None and stats.free is not None and vm.actual is not None
        # When the host is calm the guest keeps its page cache; under
        # pressure only its free memory plus what it can drop counts.
        # Either way no more than `available`: it is free memory less the
        # kernel's reserves (the high watermarks: ~65 MiB in a 1 GiB guest
        # with THP, which raises min_free_kbytes), and a guest shrunk to
        # its headroom of *free* memory had only half of it available,
        # counted as tight and was deflated again, 256 MiB at a time.
        spare = available if host.pressure else min(stats.free, available)
        desired = _clamp(vm.actual - (spare - headroom), limits, vm)
        kind = "available" if host.pressure or available < stats.free else "free"
        reason = f"guest {kind} {_mib(spare)}, keeps {_mib(headroom)} headroom"
        calm_enough = state.calm_cycles >= self.cycles(p.calm_seconds, inputs.interval)
        may_shrink = seen.report_current and calm_enough and inputs.cycle >= state.cooldown_until
        if not seen.report_current:
            reason = f"{reason}; stats {stats.age:.0f} s old predate the balloon's last move"
        if vm.reporting and p.leave_reported_free and (self._trims(vm) or not host.pressure):
            # Free page reporting already gives the host the guest's free
            # memory, and the guest's reclaimer its cold memory; a balloon
            # would only make the guest wait for it when it grows.  Give
            # back what earlier pressure took, a step a cycle, as far as
            # the host can spare it.  A trimming guest is never ballooned,
            # even when the host is critical: what is left is its working
            # set, and a guest that grows again while the host has nothing
            # to spare would OOM (5 to 17 guest OOM kills per overcommit
            # trial run when this ballooned trimming guests).  The same
            # holds for virtio-mem: an unplug of its free memory gains the
            # host nothing reporting has not, and its regrow waits for the
            # host to spare memory just as a deflate does.
            current = state.target if state.target is not None else vm.actual
            give_back = min(limits.ceiling, max(desired, current + p.inflate_step))
            why = "host calm" if not host.pressure else "guest trims its cold memory"
            why = f"{why} and free page reporting on: give back ({reason})"
            return _Want(vm, limits, state, give_back, why)
        return _Want(vm, limits, state, desired, reason, may_shrink=may_shrink)

    def _headroom(self, vm: VmSample, growth: int) -> int:
        p = self.params
        base = max(p.headroom_min, int(vm.max_memory * p.headroom_fraction))
        return base + growth

    def _follow_check(self, actual: int, state: VmState, cycle: int) -> tuple[VmState, int | None]:
        """Count cycles our target goes unfollowed; give up after stuck_limit.

        A guest whose balloon driver is absent, wedged or cannot free the
        memory leaves `actual` where it is.  Asking on is useless and, for a
        guest that is out of memory, harmful: cancel by setting the target
        to `actual`, and do not ask again for retry_after cycles.
        """
        p = self.params
        if state.target is None or abs(actual - state.target) <= p.tolerance:
            return state.but(stuck_cycles=0), None
        moved = state.last_actual is None or abs(actual - state.last_actual) > p.tolerance
        stuck = 0 if moved else state.stuck_cycles + 1
        if stuck < p.stuck_limit:
            return state.but(stuck_cycles=stuck), None
        given_up = state.but(stuck_cycles=0, given_up_until=cycle + p.retry_after)
        return given_up, actual

    # -- the host budget ---------------------------------------------------
    def _grant_growth(
        self, wants: list[_Want], host: _HostView, decisions: dict[str, Decision]
    ) -> None:
        """Deflate fast, but only with memory the host has to spare.

        Stuck-driver cancellations and restoring a floor always go through;
        then stressed guests, then the rest; when the spare memory does not
        cover every request it is split by shares.
        """
        spare = max(0, host.spare)
        growing: list[_Want] = []
        for want in wants:
            if want.desired is None or want.vm.actual is None:
                continue
            current = _current_target(want)
            if want.cancel:
                decisions[want.vm.name] = Decision(want.vm.name, want.desired, want.reason)
            elif current < want.limits.floor:
                decisions[want.vm.name] = Decision(
                    want.vm.name, want.limits.floor, f"below its floor: restore {want.reason}"
                )
            elif want.desired > current + self.params.dead_band:
                growing.append(want)
        for group in ([w for w in growing if w.stressed], [w for w in growing if not w.stressed]):
            spare = self._split(group, spare, host, decisions)

    def _split(
        self, group: list[_Want], spare: int, host: _HostView, decisions: dict[str, Decision]
    ) -> int:
        asks = {w.vm.name: (w.desired or 0) - _current_target(w) for w in group}
        total = sum(asks.values())
        shares = sum(w.limits.shares for w in group) or 1
        for want in group:
            ask = asks[want.vm.name]
            grant = ask if total <= spare else min(ask, spare * want.limits.shares // shares)
            name = want.vm.name
            if grant <= self.params.dead_band:
                decisions[name] = Decision(
                    name, None, f"{want.reason}; host cannot spare {_mib(ask)} ({host.why})"
                )
                continue
            target = _clamp(_current_target(want) + grant, want.limits, want.vm)
            if want.vm.virtio_mem is not None and target <= _current_target(want):
                decisions[name] = Decision(
                    name, None, f"{want.reason}; host cannot spare a whole virtio-mem block"
                )
                continue
            note = f"; {_mib(grant)} of {_mib(ask)} asked ({host.why})" if grant < ask else ""
            decisions[name] = Decision(name, target, f"grow: {want.reason}{note}")
            spare -= target - _current_target(want)
        return max(0, spare)

    def _shrink_or_hold(self, want: _Want, host: _HostView, cycle: int) -> Decision:
        p, name = self.params, want.vm.name
        if want.desired is None or want.vm.actual is None:
            return Decision(name, None, want.reason)
        current = _current_target(want)
        if want.desired >= current - p.dead_band:
            return Decision(name, None, f"hold: {want.reason}")
        if not want.may_shrink:
            return Decision(name, None, f"hold (waiting for calm): {want.reason}")
        target = want.state.target
        if target is not None and abs(want.vm.actual - target) > p.tolerance:
            return Decision(name, None, f"hold: {_mib(target)} still in flight")
        step = p.inflate_step_pressure if host.pressure else p.inflate_step
        new = _clamp(max(want.desired, current - step), want.limits, want.vm)
        if new >= current - p.dead_band:
            return Decision(name, None, f"hold at floor: {want.reason}")
        capped = " (step cap)" if new > want.desired else ""
        return Decision(name, new, f"shrink{capped}: {want.reason}")


def _unmanaged(vm: VmSample, limits: VmLimits) -> str:
    """Why the controller leaves this VM alone, or ''."""
    if limits.shares == 0:
        return "shares 0: not managed"
    if vm.actual is None:
        return "no balloon or virtio-mem device"
    if Lever.BALLOON not in vm.levers:
        # Statistics come from the balloon: without them the rules could
        # never shrink the guest, only plug memory into it.
        return "virtio-mem without a balloon: no guest statistics; left alone"
    if vm.migrating:
        return "migrating: left alone"
    if vm.backing is Backing.PINNED:
        return "RAM pinned (VFIO/mlock): a balloon frees nothing"
    if vm.backing is Backing.HUGETLBFS:
        return "hugetlbfs RAM: the balloon frees only whole huge pages; left alone"
    return ""


def _current_target(want: _Want) -> int:
    """Where the guest is heading: our last target, else where it is."""
    assert want.vm.actual is not None
    return want.state.target if want.state.target is not None else want.vm.actual


def _clamp(size: int, limits: VmLimits, vm: VmSample) -> int:
    """Within the limits, in what the VM's lever moves: whole 2 MiB units of
    balloon, or whole virtio-mem blocks above the base memory."""
    if size >= limits.ceiling:
        return limits.ceiling
    return max(limits.floor, vm.round(size))


# ---------------------------------------------------------------------------
# Proxmox VE pvestatd


PVE_TARGET = 0.80  # "try to use ~80% host memory"
PVE_MAXCHANGE = 100 * MiB  # per VM per pvestatd round
PVE_ROUND = 10.0  # seconds between pvestatd rounds
PVE_DEADBAND = 10 * MiB  # |goal| below this: do nothing
PVE_DEFAULT_SHARES = 1000


class ProxmoxPolicy:
    """pvestatd's auto-ballooning, rule for rule.

    Host memused = total - available; goal = 80% of total - memused.
    VMs with a running driver, a floor (`balloon_min`), shares != 0, not
    locked for migration and reporting free memory take part; those with
    free memory <= 25% of their floor grow first and shrink last.  Memory
    is split by shares above the floors, at most 100 MiB per VM per 10 s
    (scaled to our interval so the rate is the same).
    """

    name = "proxmox"

    def decide(self, inputs: Inputs) -> Plan:
        host = inputs.host
        memused = host.total - host.available
        goal = int(host.total * PVE_TARGET - memused)
        maxchange = max(1, int(PVE_MAXCHANGE * inputs.interval / PVE_ROUND))
        comfortable, tight, others = self._partition(inputs)
        res: dict[str, int] = {}
        if goal > PVE_DEADBAND:
            rest = self._change(inputs, res, tight, goal, maxchange)
            if rest:
                self._change(inputs, res, comfortable, rest, maxchange)
        elif goal < -PVE_DEADBAND:
            rest = self._change(inputs, res, comfortable, goal, maxchange)
            if rest:
                self._change(inputs, res, tight, rest, maxchange)
        why = f"host used {_mib(memused)} of {_mib(host.total)}, goal {_mib(goal)}"
        decisions, states = [], {}
        for vm in inputs.vms:
            state = inputs.state_of(vm)
            if vm.name in others:
                decision = Decision(vm.name, None, others[vm.name])
            elif vm.name in res and res[vm.name] != vm.actual:
                decision = Decision(vm.name, res[vm.name], f"share of {why}")
            else:
                decision = Decision(vm.name, None, f"no change ({why})")
            decisions.append(decision)
            target = decision.target if decision.acts else state.target
            states[vm.name] = state.but(target=target, reason=decision.reason)
        return Plan(decisions, states)

    def _partition(self, inputs: Inputs) -> tuple[list[VmSample], list[VmSample], dict[str, str]]:
        comfortable, tight, others = [], [], {}
        for vm in inputs.vms:
            limits = inputs.limits_of(vm)
            if not vm.actual:
                others[vm.name] = "balloon driver not running"
            elif not limits.floor:
                others[vm.name] = "no balloon floor configured"
            elif vm.migrating:
                others[vm.name] = "locked for migration"
            elif limits.shares == 0:
                others[vm.name] = "shares 0"
            elif vm.stats is None or vm.stats.free is None:
                others[vm.name] = "no free memory reported"
            elif vm.stats.free > limits.floor * 0.25:
                comfortable.append(vm)
            else:
                tight.append(vm)
        return comfortable, tight, others

    def _change(
        self, inputs: Inputs, res: dict[str, int], vms: list[VmSample], nbytes: int, maxchange: int
    ) -> int:
        """compute_alg1's change_func: move `nbytes` across `vms` by shares."""
        rest, repeat, progress = nbytes, True, 1
        done: set[str] = set()
        while rest and repeat and progress:
            repeat, progress = False, 0
            live = [vm for vm in vms if vm.name not in done]
            alloc_old = 0
            shares_total = 0
            for vm in live:
                limits = inputs.limits_of(vm)
                balloon = res.get(vm.name, vm.actual or 0)
                alloc_old += balloon - limits.floor
                shares_total += limits.shares or PVE_DEFAULT_SHARES
            alloc_new = alloc_old + rest
            changes = 0
            for vm in live:
                limits = inputs.limits_of(vm)
                actual = vm.actual or 0
                shares = limits.shares or PVE_DEFAULT_SHARES
                desired = limits.floor + int(alloc_new / shares_total * shares)
                if desired > vm.max_memory:
                    desired, repeat = vm.max_memory, True
                elif desired < limits.floor:
                    desired, repeat = limits.floor, True
                if nbytes > 0 and desired - actual > 0:
                    balloon = min(desired, actual + maxchange)
                elif desired - actual < 0:
                    balloon = max(desired, actual - maxchange)
                else:
                    done.add(vm.name)
                    continue
                diff = balloon - actual
                if diff != 0:
                    old = res.get(vm.name, actual)
                    res[vm.name] = balloon
                    change = balloon - old
                    if change != 0:
                        changes += change
                        progress += abs(diff)
                        repeat = True
            rest -= changes
        return rest


# ---------------------------------------------------------------------------
# oVirt MOM


MOM_PRESSURE_THRESHOLD = 0.20
MOM_PRESSURE_CRITICAL = 0.05
MOM_MIN_GUEST_FREE = 0.20
MOM_MAX_CHANGE = 0.05  # of balloon_cur per 10 s policy cycle
MOM_MIN_CHANGE = 0.0025
MOM_ROUND = 10.0
MOM_HISTORY = 10  # StatAvg: mean of the last sample-history-length samples


class MomPolicy:
    """oVirt MOM's balloon.rules, rule for rule.

    host_free_percent = host free / host total.  Below 20% every guest
    shrinks toward used + free% x cur, where free% scales with host
    pressure (negative when critical: below 5% the guest is made to
    swap); otherwise every ballooned guest grows by 5% a cycle.  Changes
    below 0.25% of balloon_cur are skipped.  Guests without statistics
    are not in MOM's guest list.  The 5% cap is per 10 s, scaled to our
    interval.
    """

    name = "mom"

    def decide(self, inputs: Inputs) -> Plan:
        host = inputs.host
        host_free = host.available / host.total if host.total else 0.0
        max_change = MOM_MAX_CHANGE * min(1.0, inputs.interval / MOM_ROUND)
        decisions, states = [], {}
        for vm in inputs.vms:
            state = inputs.state_of(vm)
            limits = inputs.limits_of(vm)
            if vm.actual is None or vm.stats is None or vm.stats.free is None:
                decision = Decision(vm.name, None, "no statistics: not a MOM guest")
            else:
                history = (*state.history, (vm.actual, vm.stats.free))[-MOM_HISTORY:]
                state = state.but(history=history)
                if host_free < MOM_PRESSURE_THRESHOLD:
                    decision = self._shrink(vm, limits, history, host_free, max_change)
                else:
                    decision = self._grow(vm, limits, history, host_free, max_change)
            decisions.append(decision)
            target = decision.target if decision.acts else state.target
            states[vm.name] = state.but(target=target, reason=decision.reason)
        return Plan(decisions, states)

    @staticmethod
    def _used(history: tuple[tuple[int, int], ...]) -> float:
        cur = sum(a for a, _ in history) / len(history)
        unused = sum(f for _, f in history) / len(history)
        return cur - unused

    def _shrink(
        self,
        vm: VmSample,
        limits: VmLimits,
        history: tuple[tuple[int, int], ...],
        host_free: float,
        max_change: float,
    ) -> Decision:
        cur = vm.actual or 0
        if host_free <= MOM_PRESSURE_CRITICAL:
            guest_free = -0.05 + host_free
        else:
            guest_free = MOM_MIN_GUEST_FREE * (host_free / MOM_PRESSURE_THRESHOLD)
        balloon_min = max(limits.floor, self._used(history) + guest_free * cur)
        size = max(cur * (1 - max_change), balloon_min)
        why = f"host free {host_free:.0%} < {MOM_PRESSURE_THRESHOLD:.0%}: shrink"
        return self._control(vm, limits, size, why)

    def _grow(
        self,
        vm: VmSample,
        limits: VmLimits,
        history: tuple[tuple[int, int], ...],
        host_free: float,
        max_change: float,
    ) -> Decision:
        cur = vm.actual or 0
        if cur >= limits.ceiling:
            return Decision(vm.name, None, f"host free {host_free:.0%}: at its maximum")
        balloon_min = max(limits.floor, self._used(history) + MOM_MIN_GUEST_FREE * cur)
        size = min(cur * (1 + max_change), limits.ceiling)
        size = max(size, balloon_min)
        return self._control(vm, limits, size, f"host free {host_free:.0%}: grow")

    @staticmethod
    def _control(vm: VmSample, limits: VmLimits, size: float, why: str) -> Decision:
        cur = vm.actual or 0
        target = int(size)
        if target > limits.ceiling:
            return Decision(vm.name, None, f"{why}: {_mib(target)} above the maximum")
        if abs(target - cur) <= MOM_MIN_CHANGE * cur:
            return Decision(vm.name, None, f"{why}: change below {MOM_MIN_CHANGE:.2%}")
        return Decision(vm.name, target, why)


POLICIES: dict[str, type[ThinvmPolicy] | type[ProxmoxPolicy] | type[MomPolicy]] = {
    "thinvm": ThinvmPolicy,
    "proxmox": ProxmoxPolicy,
    "mom": MomPolicy,
}


def make_policy(name: str) -> Policy:
    from thinvm.errors import ThinvmError

    if name not in POLICIES:
        raise ThinvmError(f"unknown policy {name!r}: choose {', '.join(POLICIES)}")
    return POLICIES[name]()
