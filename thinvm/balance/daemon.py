"""The balance loop: sample, decide, record, act; one per host.

Every cycle the controller samples the host and every VM, asks the policy
for targets, writes its state file (targets and reasons, before acting),
then sets the targets that changed and logs each with its reason.

Killing it at any moment leaves every guest with a valid target: QEMU
keeps the last `balloon` value it got, and a target is one QMP command,
sent whole or not at all.  The state file is written before the targets
are sent, so a restart knows every target that may have been sent.  It
sends one again only to the same VM (the same QEMU process or libvirt
domain run, the same size), and only once a first sample shows the guest
can afford it; it carries on from the saved state.

One VM's failure (its QEMU, its guest, its state file) is that VM's error
for the cycle: logged with its name, counted in the state file, and the
other VMs are served.  A failure of the whole cycle (the host source, the
VM listing, the state file) is logged and the next cycle tries again.
"""

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from thinvm.balance.backends import (
    HeldByOperator,
    HostSource,
    VmBackend,
    VmGone,
    describe_error,
)
from thinvm.balance.model import Backing, Decision, HostSample, VmLimits, VmSample, VmState
from thinvm.balance.policies import Inputs, Policy
from thinvm.errors import AgentBusy, ThinvmError
from thinvm.host.locks import FileLock
from thinvm.paths import cache_dir, write_json_atomic
from thinvm.units import MiB, format_size

STATE_VERSION = 1
# A remembered target is re-sent after a restart only to a guest whose
# fresh statistics (no older than STATS_FRESH_INTERVALS cycles plus
# STATS_FRESH_SLACK seconds) show that it keeps this much free memory
# after the shrink: the thinvm policy's default headroom.
RESUME_HEADROOM_MIN = 96 * MiB
RESUME_HEADROOM_FRACTION = 0.12
STATS_FRESH_INTERVALS = 3
STATS_FRESH_SLACK = 2.0
RESUME_TOLERANCE = 8 * MiB  # |actual - target| that counts as there already
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

# RAM a balloon must never touch, whatever the policy (docs/balance.md).
LEFT_ALONE = {
    Backing.HUGETLBFS: (
        "RAM on hugetlbfs: left alone (a balloon frees only whole huge pages, and "
        "deflating after the host reused them can kill QEMU with SIGBUS)"
    ),
    Backing.PINNED: "RAM pinned (locked or VFIO): left alone (a balloon frees nothing)",
}


def default_state_path() -> Path:
    return cache_dir() / "balance" / "state.json"


def lock_path(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".lock")


def claim_state(state_path: Path) -> FileLock:
    """The controller's exclusive lock on its state file, held until the
    process exits (the kernel drops it then, even on SIGKILL).  Two
    controllers with one state file would drive the same VMs against each
    other and overwrite each other's state.  The holder writes its pid into
    the lock file, so a second one can say who it is."""
    path = lock_path(state_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    if not lock.try_acquire():
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = f" (pid {int(path.read_text().split()[0])})"
        raise ThinvmError(
            f"another 'thinvm balance run'{holder} holds {path}: stop it first, or give "
            "this one its own --state"
        )
    path.write_text(f"{os.getpid()}\n")
    return lock


def boot_id() -> str | None:
    """This boot of the host: pids and process start times count from it."""
    with contextlib.suppress(OSError):
        return BOOT_ID.read_text().strip()
    return None


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class CycleReport:
    cycle: int
    host: HostSample
    samples: list[VmSample]
    decisions: list[Decision]
    actions: int  # targets actually sent
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SavedVm:
    """What a state file says about one VM: whose state it is, and that state."""

    identity: str | None
    max_memory: int | None
    state: VmState


@dataclass
class Controller:
    """One balance loop over one backend and one host budget."""

    backend: VmBackend
    host: HostSource
    policy: Policy
    interval: float = 5.0
    state_path: Path | None = None
    dry_run: bool = False
    limits: Mapping[str, VmLimits] = field(default_factory=dict)
    default_limits: Callable[[int], VmLimits] = VmLimits.default_for
    log: Callable[[str], None] = print
    verbose: bool = False
    cycle: int = 0
    states: dict[str, VmState] = field(default_factory=dict)
    actions: int = 0
    trims: int = 0  # trims started
    error_count: int = 0  # per-VM errors and failed cycles, since the state file began
    # The state file's VMs, until the first cycle after resume() has
    # checked each against its sample.
    resumed: dict[str, SavedVm] | None = None

    # -- state file --------------------------------------------------------
    def resume(self) -> None:
        """Carry on from the state file of an earlier run of the same policy.

        Nothing is sent here: the first cycle checks each remembered VM
        against its first sample (_check_resumed)."""
        if self.state_path is None or not self.state_path.is_file():
            return
        try:
            saved = json.loads(self.state_path.read_text())
            if not isinstance(saved, dict):
                raise ValueError("not a JSON object")
            if saved.get("version") != STATE_VERSION or saved.get("policy") != self.policy.name:
                self.log(
                    f"{_stamp()} state file is for policy {saved.get('policy')!r}: starting fresh"
                )
                return
            cycle, actions = int(saved.get("cycle", 0)) + 1, int(saved.get("actions", 0))
            errors = int(saved.get("error_count", 0))
            vms = {name: _saved_vm(vm) for name, vm in saved.get("vms", {}).items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            self.log(
                f"{_stamp()} state file {self.state_path} unreadable ({describe_error(exc)}): "
                "starting fresh"
            )
            return
        if saved.get("dry_run"):
            # A dry run sent none of the targets it remembers.
            vms = {
                name: SavedVm(vm.identity, vm.max_memory, vm.state.but(target=None))
                for name, vm in vms.items()
            }
        if saved.get("boot_id") != boot_id():
            # Pids and start times count from a boot, and a domain's id
            # from its libvirtd: after a reboot they say nothing.
            vms = {name: SavedVm(None, vm.max_memory, vm.state) for name, vm in vms.items()}
        self.cycle, self.actions, self.error_count = cycle, actions, errors
        self.states = {name: vm.state for name, vm in vms.items()}
        self.resumed = vms
        self.log(f"{_stamp()} resumed at cycle {self.cycle} with {len(self.states)} VMs")

    def _check_resumed(self, samples: list[VmSample], report: CycleReport) -> None:
        """The first cycle after resume(): each remembered VM against its sample.

        A VM that is not the one the state file names (re-created under
        the same name, restarted, resized, or of a state file that does not
        say) starts afresh.  The same VM gets its remembered target again
        (the kill may have come between writing and sending it) if that
        is within its limits and, for a shrink, its statistics show the
        free memory for it; else the policy carries on from where it is."""
        assert self.resumed is not None
        limits = self._limits(samples)
        for sample in samples:
            saved = self.resumed.get(sample.name)
            if saved is None:
                continue
            where = f"{_stamp()} cycle {self.cycle} {sample.name}: resume:"
            different = _not_the_same(saved, sample)
            if different:
                self.states[sample.name] = VmState()
                self.log(f"{where} saved state dropped: {different}")
                continue
            target = saved.state.target
            if (
                target is None
                or sample.held is not None
                or sample.actual is None
                or sample.backing in LEFT_ALONE
            ):
                continue
            if abs(sample.actual - target) <= RESUME_TOLERANCE:
                self.log(f"{where} at its target {format_size(target)} already")
                continue
            why_not = self._unaffordable(sample, target, limits[sample.name])
            if why_not:
                self.states[sample.name] = saved.state.but(target=None)
                self.log(f"{where} target {format_size(target)} not re-sent: {why_not}")
                continue
            self._resend(sample.name, target, where, report)
        self.resumed = None

    def _unaffordable(self, sample: VmSample, target: int, limits: VmLimits) -> str:
        """Why `sample`'s guest cannot take `target` now, or ''."""
        assert sample.actual is not None
        limits = sample.fit(limits)
        if not limits.floor <= target <= limits.ceiling:
            return (
                f"outside its limits ({format_size(limits.floor)} to {format_size(limits.ceiling)})"
            )
        if target >= sample.actual:
            return ""  # giving memory back is always safe
        stats = sample.stats
        fresh = STATS_FRESH_INTERVALS * self.interval + STATS_FRESH_SLACK
        if stats is None or stats.free is None or stats.age > fresh:
            return "no current statistics from the guest"
        headroom = max(RESUME_HEADROOM_MIN, int(sample.max_memory * RESUME_HEADROOM_FRACTION))
        left = stats.free - (sample.actual - target)
        if left < headroom:
            return (
                f"the guest has {format_size(stats.free)} free at {format_size(sample.actual)}, "
                f"which would leave it less than {format_size(headroom)}"
            )
        return ""

    def _resend(self, vm: str, target: int, where: str, report: CycleReport) -> None:
        if self.dry_run:
            self.log(f"{where} would re-send target {format_size(target)}")
            return
        try:
            self.backend.set_target(vm, target)
        except Exception as exc:
            self.states[vm] = self.states[vm].but(target=None)
            report.errors.append(f"{vm}: resume: {describe_error(exc)}")
            self.log(f"{where} FAILED to re-send target {format_size(target)}: {exc}")
            return
        self.log(f"{where} target {format_size(target)} re-sent")

    def _save(self, report: CycleReport, finished: bool) -> None:
        if self.state_path is None:
            return
        decisions = {d.vm: d for d in report.decisions}
        vms = {}
        for sample in report.samples:
            state = self.states.get(sample.name, VmState())
            decision = decisions.get(sample.name)
            vms[sample.name] = {
                "actual": sample.actual,
                "max_memory": sample.max_memory,
                "lever": str(sample.lever) if sample.actual is not None else None,
                "virtio_mem": asdict(sample.virtio_mem) if sample.virtio_mem else None,
                "target": state.target,
                "reason": decision.reason if decision else state.reason,
                "acted": bool(decision and decision.acts),
                "stats_age": sample.stats.age if sample.stats else None,
                "host_rss": sample.host_rss,
                "working_set": state.working_set,
                "reclaimer": asdict(sample.reclaimer) if sample.reclaimer else None,
                "identity": sample.identity,
                "state": state.to_json(),
            }
        write_json_atomic(
            self.state_path,
            {
                "version": STATE_VERSION,
                "policy": self.policy.name,
                "backend": self.backend.name,
                "pid": os.getpid(),
                "boot_id": boot_id(),
                "dry_run": self.dry_run,
                "interval": self.interval,
                "cycle": report.cycle,
                "time": time.time(),
                "finished": finished,
                "actions": self.actions,
                "host": asdict(report.host),
                "vms": vms,
                "errors": report.errors,
                "error_count": self.error_count,
            },
        )

    # -- one cycle ---------------------------------------------------------
    def _limits(self, samples: list[VmSample]) -> dict[str, VmLimits]:
        return {
            s.name: self.limits.get(s.name) or self.default_limits(s.max_memory) for s in samples
        }

    def step(self) -> CycleReport:
        host = self.host.sample()
        samples = self.backend.sample()
        report = CycleReport(self.cycle, host, samples, [], 0)
        for error in self.backend.sample_errors():
            report.errors.append(error)
            self.log(f"{_stamp()} cycle {self.cycle} {error}")
        if self.resumed is not None:
            self._check_resumed(samples, report)
        left_alone = {**self._left_alone(samples), **self._held(samples)}
        managed = [s for s in samples if s.name not in left_alone]
        inputs = Inputs(
            self.cycle, self.interval, host, managed, self._limits(managed), self.states
        )
        plan = self.policy.decide(inputs)
        previous = dict(self.states)
        states = {**plan.states, **{name: state for name, (state, _) in left_alone.items()}}
        self.states = {s.name: states.get(s.name, VmState()) for s in samples}
        report.decisions = [*plan.decisions, *(decision for _, decision in left_alone.values())]
        self._save(report, finished=False)  # before acting: a restart may re-send these
        by_name = {s.name: s for s in samples}
        for decision in report.decisions:
            self._act(decision, by_name[decision.vm], previous, report)
        self.error_count += len(report.errors)
        if report.errors:
            self._save(report, finished=True)
        self.cycle += 1
        return report

    def _left_alone(self, samples: list[VmSample]) -> dict[str, tuple[VmState, Decision]]:
        """VMs whose RAM no balloon may touch (LEFT_ALONE), whatever the policy."""
        alone = {}
        for sample in samples:
            reason = LEFT_ALONE.get(sample.backing)
            if reason is not None:
                state = self.states.get(sample.name, VmState()).but(reason=reason)
                alone[sample.name] = (state, Decision(sample.name, None, reason))
        return alone

    def _held(self, samples: list[VmSample]) -> dict[str, tuple[VmState, Decision]]:
        """VMs an operator set a target for: no policy touches them.

        Their state remembers that target as the last one, so that when
        they are handed back the policy carries on from where they are.
        """
        held = {}
        for sample in samples:
            if sample.held is None:
                continue
            command = "resize" if sample.virtio_mem is not None else "balloon"
            reason = (
                f"held at {format_size(sample.held)} by an operator (thinvm balloon or "
                f"resize); 'thinvm {command} {sample.name} auto' hands it back"
            )
            state = self.states.get(sample.name, VmState()).but(
                # Trends start afresh when the VM is handed back.
                target=sample.held,
                last_actual=sample.actual,
                last_used=None,
                calm_cycles=0,
                reason=reason,
            )
            held[sample.name] = (state, Decision(sample.name, None, reason))
        return held

    def _act(
        self,
        decision: Decision,
        sample: VmSample,
        previous: dict[str, VmState],
        report: CycleReport,
    ) -> None:
        where = f"{_stamp()} cycle {report.cycle} {decision.vm}"
        if decision.reclaim is not None:
            self._switch_reclaim(decision.vm, decision.reclaim, where, report)
        if decision.trim:
            self._trim(decision.vm, decision.trim, where, report)
        if not decision.acts:
            if self.verbose:
                self.log(f"{where}: {decision.reason}")
            return
        assert decision.target is not None
        change = f"{format_size(sample.actual or 0)} -> {format_size(decision.target)}"
        if self.dry_run:
            self.log(f"{where}: would set {change}: {decision.reason}")
            return
        try:
            self.backend.set_target(decision.vm, decision.target)
        except VmGone as exc:
            # Stopped or migrated since the sample (`thinvm down`,
            # `migrate`): nothing to manage, and not a failure.
            self.log(f"{where}: not set {change}: {exc}")
            return
        except HeldByOperator as exc:
            # Not a failure: the operator's target stands, as it will next cycle.
            self.states[decision.vm] = self.states[decision.vm].but(
                target=previous.get(decision.vm, VmState()).target
            )
            self.log(f"{where}: not set {change}: {exc}")
            return
        except Exception as exc:  # one VM's failure, whatever it is (see the module doc)
            report.errors.append(f"{decision.vm}: {describe_error(exc)}")
            self.states[decision.vm] = self.states[decision.vm].but(
                target=previous.get(decision.vm, VmState()).target
            )
            self.log(f"{where}: FAILED to set {change}: {exc}")
            return
        report.actions += 1
        self.actions += 1
        self.log(f"{where}: set {change}: {decision.reason}")

    def _switch_reclaim(self, vm: str, on: bool, where: str, report: CycleReport) -> None:
        what = f"guest reclaimer {'on' if on else 'off'}"
        if self.dry_run:
            self.log(f"{where}: would switch the {what}")
            return
        try:
            self.backend.set_reclaim(vm, on)
        except AgentBusy:
            # Busy with a workload's command: the policy asks again next cycle.
            if self.verbose:
                self.log(f"{where}: {what} not yet: its agent is busy")
            return
        except Exception as exc:
            report.errors.append(f"{vm}: {what}: {describe_error(exc)}")
            self.log(f"{where}: FAILED to switch the {what}: {exc}")
            return
        self.log(f"{where}: switched the {what} (trim first)")

    def _trim(self, vm: str, size: int, where: str, report: CycleReport) -> None:
        if self.dry_run:
            self.log(f"{where}: would trim {format_size(size)}")
            return
        try:
            started = self.backend.trim(vm, size)
        except Exception as exc:
            report.errors.append(f"{vm}: trim: {describe_error(exc)}")
            self.log(f"{where}: FAILED to start a trim: {exc}")
            return
        if started:
            self.trims += 1
            self.log(f"{where}: trimming up to {format_size(size)} of cold cache")

    def _step_or_log(self) -> None:
        """A cycle; one that fails as a whole is logged and counted, and the
        next one tries again (a hung libvirtd, a full disk, a cgroup that
        is not there yet).  Per-VM failures never get here (step())."""
        try:
            self.step()
        except (ThinvmError, OSError) as exc:
            self.error_count += 1
            self.log(f"{_stamp()} cycle {self.cycle} FAILED: {describe_error(exc)}")
            self.cycle += 1

    def run(self, cycles: int | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Cycle every `interval` seconds until `cycles` are done or `stop()`."""
        done = 0
        try:
            while cycles is None or done < cycles:
                started = time.monotonic()
                self._step_or_log()
                done += 1
                if (cycles is not None and done >= cycles) or (stop and stop()):
                    break
                remaining = self.interval - (time.monotonic() - started)
                deadline = time.monotonic() + max(0.0, remaining)
                while time.monotonic() < deadline:
                    if stop and stop():
                        return
                    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        finally:
            self.backend.close()


def _saved_vm(vm: dict[str, Any]) -> SavedVm:
    identity, max_memory = vm.get("identity"), vm.get("max_memory")
    return SavedVm(
        identity=str(identity) if identity is not None else None,
        max_memory=int(max_memory) if max_memory is not None else None,
        state=VmState.from_json(vm["state"]),
    )


def _not_the_same(saved: SavedVm, sample: VmSample) -> str:
    """Why `sample` is not the VM the state file remembers, or ''."""
    if saved.identity is None or sample.identity is None:
        return "the state file cannot tell whether this is the VM it was written for"
    if saved.identity != sample.identity:
        return f"another VM under this name ({saved.identity} then, {sample.identity} now)"
    if saved.max_memory != sample.max_memory:
        old = format_size(saved.max_memory) if saved.max_memory is not None else "unknown"
        return f"its RAM changed ({old} then, {format_size(sample.max_memory)} now)"
    return ""


# -- status ------------------------------------------------------------------


def load_status(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ThinvmError(f"no balance state at {path}: start 'thinvm balance run' first")
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise ThinvmError(f"balance state {path} is not JSON: {exc}") from exc
    return data


def _running(pid: int | None) -> bool:
    if not pid:
        return False
    with contextlib.suppress(OSError):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"balance" in cmdline
    return False


def format_status(data: dict[str, Any], now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    age = now - float(data.get("time", now))
    alive = "running" if _running(data.get("pid")) else "not running"
    mode = " (dry run)" if data.get("dry_run") else ""
    host = data.get("host", {})
    lines = [
        f"policy {data.get('policy')}{mode}, backend {data.get('backend')}, pid {data.get('pid')} "
        f"{alive}; cycle {data.get('cycle')} {age:.0f} s ago; {data.get('actions', 0)} targets "
        f"set, {data.get('error_count', 0)} errors",
        f"host: {format_size(host.get('available', 0))} available of "
        f"{format_size(host.get('total', 0))}, swap used {format_size(host.get('swap_used', 0))}, "
        f"PSI some {host.get('psi_some_avg10')} full {host.get('psi_full_avg10')}",
    ]
    for name, vm in sorted(data.get("vms", {}).items()):
        actual = vm.get("actual")
        target = vm.get("target")
        lines.append(
            f"  {name}: actual {format_size(actual) if actual is not None else '-'}, "
            f"target {format_size(target) if target is not None else 'never set'} "
            f"of {format_size(vm.get('max_memory', 0))}{_by_lever(vm)}: {vm.get('reason', '')}"
        )
        lines.append(f"    {_working_set_line(vm)}")
    return lines


def _by_lever(vm: dict[str, Any]) -> str:
    vmem = vm.get("virtio_mem")
    if not vmem:
        return ""
    return (
        f" by virtio-mem ({format_size(vmem['plugged'])} plugged, "
        f"{format_size(vmem['requested'])} requested above {format_size(vmem['base'])} base)"
    )


def _working_set_line(vm: dict[str, Any]) -> str:
    ws = vm.get("working_set")
    rss = vm.get("host_rss")
    line = f"working set ~{format_size(ws)}" if ws is not None else "working set unknown"
    if rss is not None:
        line += f", host RSS {format_size(rss)}"
    rec = vm.get("reclaimer")
    if not rec:
        return f"{line}; no guest reclaimer reachable"
    if not rec.get("available"):
        return f"{line}; guest reclaimer unavailable"
    mode = "on" if rec.get("background") else "off"
    return (
        f"{line}; guest reclaimer {mode}: {format_size(rec.get('reclaimed_bytes', 0))} "
        f"reclaimed, {rec.get('backoffs', 0)} backoffs, {rec.get('refault_pages', 0)} refaults"
    )
