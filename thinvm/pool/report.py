"""What `thinvm pool status` shows: slots, what they hold, pressure, the cgroup."""

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from thinvm.host.cgroups import CgroupUsage, cgroup_usage
from thinvm.pool.files import allocated
from thinvm.pool.model import Policy, Pressure
from thinvm.pool.probes import owner_alive, read_pressure
from thinvm.pool.store import Pool
from thinvm.units import format_size


@dataclass(frozen=True)
class SlotStatus:
    index: int
    size: int
    state: str
    held: int  # bytes the file holds; less than size once punched
    vm: str
    pid: int | None
    error: str


@dataclass(frozen=True)
class PoolStatus:
    root: str
    kind: str
    directory: str
    page_size: int
    daemon_pid: int | None
    policy: Policy
    pressure: Pressure
    slots: list[SlotStatus]
    cgroup: CgroupUsage | None
    hugepages_added: int
    note: str

    @property
    def held(self) -> int:
        return sum(s.held for s in self.slots)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["held"] = self.held
        return data


def status(root: str | Path | None = None) -> PoolStatus:
    pool = Pool(root)
    state = pool.read()
    cfg = state.config
    daemon = state.daemon if state.daemon is not None and owner_alive(state.daemon) else None
    slots = [
        SlotStatus(
            s.index,
            s.size,
            s.state,
            allocated(s.path),
            s.vm if s.state == "leased" else "",
            s.owner.pid if s.owner is not None else None,
            s.error,
        )
        for s in state.slots
    ]
    return PoolStatus(
        root=str(pool.root),
        kind=cfg.kind,
        directory=cfg.directory,
        page_size=cfg.page_size,
        daemon_pid=daemon.pid if daemon else None,
        policy=cfg.policy,
        pressure=read_pressure(cfg.policy),
        slots=slots,
        cgroup=cgroup_usage(cfg.cgroup) if cfg.cgroup else None,
        hugepages_added=state.hugepages_added,
        note=state.note,
    )


def format_status(st: PoolStatus) -> list[str]:
    daemon = f"daemon pid {st.daemon_pid}" if st.daemon_pid else "no daemon"
    psi = st.pressure.psi_some_avg10
    lines = [
        f"pool {st.root}: {st.kind} ({format_size(st.page_size)} pages) in {st.directory}, "
        f"{daemon}",
        f"holds {format_size(st.held)} of budget {format_size(st.policy.budget)}; "
        f"MemAvailable {format_size(st.pressure.mem_available)} "
        f"(watermark {format_size(st.policy.watermark)}); PSI some avg10 "
        + (f"{psi:.2f}%" if psi is not None else "n/a")
        + f" (threshold {st.policy.psi_threshold:g}%)",
    ]
    if st.cgroup is not None:
        cg = st.cgroup
        usage = format_size(cg.usage) if cg.usage is not None else "?"
        limit = format_size(cg.limit) if cg.limit is not None else "none"
        cpu = f", CPU {cg.cpu_seconds:.2f} s" if cg.cpu_seconds is not None else ""
        lines.append(
            f"cgroup {cg.path}: {usage} charged, limit {limit}, "
            f"limit hit {cg.failcnt or 0} times{cpu}"
        )
    if st.hugepages_added:
        lines.append(f"huge pages added to the kernel's pool: {st.hugepages_added}")
    for s in st.slots:
        line = (
            f"  slot {s.index}: {format_size(s.size):>10}  {s.state:9} holds {format_size(s.held)}"
        )
        if s.state in ("leased", "free") and s.held < s.size:
            line += f" ({format_size(s.size - s.held)} punched: balloon or free page reporting)"
        if s.state == "leased":
            line += f", VM {s.vm or '?'} (pid {s.pid})"
        if s.error:
            line += f"  [{s.error}]"
        lines.append(line)
    if st.note:
        lines.append(f"last: {st.note}")
    return lines
