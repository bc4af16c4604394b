"""The balance loop: sample, decide, record, act; one per host.

Every cycle the controller samples the host and every VM, asks the policy
for targets, writes its state file (targets and reasons, before acting),
then sets the targets that changed and logs each with its reason.

Killing it at any moment leaves every guest with a valid target: QEMU
keeps the last `balloon` value it got, and a target is one QMP command,
sent whole or not at all.  The state file is written before the targets
are sent, so a restart knows every target that may have been sent; it
sends them again (idempotent) and carries on from the saved state.
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

from thinvm.balance.backends import HeldByOperator, HostSource, VmBackend, VmGone
from thinvm.balance.model import Decision, HostSample, VmLimits, VmSample, VmState
from thinvm.balance.policies import Inputs, Policy
from thinvm.errors import AgentBusy, ThinvmError
from thinvm.paths import cache_dir, write_json_atomic
from thinvm.units import format_size

STATE_VERSION = 1


def default_state_path() -> Path:
    return cache_dir() / "balance" / "state.json"


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

    # -- state file --------------------------------------------------------
    def resume(self) -> None:
        """Carry on from the state file of an earlier run of the same policy."""
        if self.state_path is None or not self.state_path.is_file():
            return
        try:
            saved = json.loads(self.state_path.read_text())
        except (OSError, ValueError) as exc:
            self.log(f"{_stamp()} state file {self.state_path} unreadable ({exc}): starting fresh")
            return
        if saved.get("version") != STATE_VERSION or saved.get("policy") != self.policy.name:
            self.log(f"{_stamp()} state file is for policy {saved.get('policy')!r}: starting fresh")
            return
        self.cycle = int(saved.get("cycle", 0)) + 1
        self.actions = int(saved.get("actions", 0))
        self.states = {
            name: VmState.from_json(vm["state"]) for name, vm in saved.get("vms", {}).items()
        }
        self.log(f"{_stamp()} resumed at cycle {self.cycle} with {len(self.states)} VMs")
        if saved.get("dry_run") or self.dry_run:
            return
        # A target may or may not have reached QEMU before the kill: send it again.
        for name, state in self.states.items():
            if state.target is None:
                continue
            try:
                self.backend.set_target(name, state.target)
                self.log(f"{_stamp()} {name}: resume: target {format_size(state.target)} re-sent")
            except ThinvmError as exc:
                self.log(f"{_stamp()} {name}: resume: {exc}")

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
                "state": state.to_json(),
            }
        write_json_atomic(
            self.state_path,
            {
                "version": STATE_VERSION,
                "policy": self.policy.name,
                "backend": self.backend.name,
                "pid": os.getpid(),
                "dry_run": self.dry_run,
                "interval": self.interval,
                "cycle": report.cycle,
                "time": time.time(),
                "finished": finished,
                "actions": self.actions,
                "host": asdict(report.host),
                "vms": vms,
                "errors": report.errors,
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
        managed = [s for s in samples if s.held is None]
        inputs = Inputs(
            self.cycle, self.interval, host, managed, self._limits(managed), self.states
        )
        plan = self.policy.decide(inputs)
        previous = dict(self.states)
        held = self._held(samples)
        states = {**plan.states, **{name: state for name, (state, _) in held.items()}}
        self.states = {s.name: states.get(s.name, VmState()) for s in samples}
        decisions = [*plan.decisions, *(decision for _, decision in held.values())]
        report = CycleReport(self.cycle, host, samples, decisions, 0)
        self._save(report, finished=False)  # before acting: a restart re-sends these
        by_name = {s.name: s for s in samples}
        for decision in report.decisions:
            self._act(decision, by_name[decision.vm], previous, report)
        if report.errors:
            self._save(report, finished=True)
        self.cycle += 1
        return report

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
        except (ThinvmError, OSError, TimeoutError) as exc:
            report.errors.append(f"{decision.vm}: {exc}")
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
        except (ThinvmError, OSError, TimeoutError) as exc:
            report.errors.append(f"{vm}: {what}: {exc}")
            self.log(f"{where}: FAILED to switch the {what}: {exc}")
            return
        self.log(f"{where}: switched the {what} (trim first)")

    def _trim(self, vm: str, size: int, where: str, report: CycleReport) -> None:
        if self.dry_run:
            self.log(f"{where}: would trim {format_size(size)}")
            return
        try:
            started = self.backend.trim(vm, size)
        except (ThinvmError, OSError, TimeoutError) as exc:
            report.errors.append(f"{vm}: trim: {exc}")
            self.log(f"{where}: FAILED to start a trim: {exc}")
            return
        if started:
            self.trims += 1
            self.log(f"{where}: trimming up to {format_size(size)} of cold cache")

    def run(self, cycles: int | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Cycle every `interval` seconds until `cycles` are done or `stop()`."""
        done = 0
        try:
            while cycles is None or done < cycles:
                started = time.monotonic()
                self.step()
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
        f"{alive}; cycle {data.get('cycle')} {age:.0f} s ago; {data.get('actions', 0)} targets set",
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
