"""Live migration between two QEMU processes over loopback TCP."""

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.units import GiB
from thinvm.vm.machine import VM

Progress = Callable[[dict[str, Any]], None]

# QEMU's default max-bandwidth (128 MiB/s) caps a loopback migration far
# below what the link does; benchmarks and the demo lift it so that they
# measure the migration, not the cap.
UNCAPPED: dict[str, Any] = {"max-bandwidth": 100 * GiB}
# query-migrate statuses of a migration under way.
MIGRATING = ("setup", "active", "pre-switchover", "device", "postcopy-active")
# Runstates of a VM at either end of one: an incoming destination, and a
# source that finished and waits in `postmigrate` for its switchover.
MIGRATION_RUNSTATES = ("inmigrate", "finish-migrate", "postmigrate")


@dataclass(frozen=True)
class MigrationResult:
    """The final `query-migrate` numbers, plus what we measured ourselves."""

    status: str
    total_time_ms: int
    downtime_ms: int
    setup_time_ms: int
    transferred: int
    normal_pages: int
    zero_pages: int
    dirty_sync_count: int
    wall_seconds: float
    sparse_skipped: int = 0
    sparse_zero: int = 0
    postcopy_requests: int = 0
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_query(cls, info: dict[str, Any], wall: float) -> "MigrationResult":
        ram = info.get("ram", {})
        return cls(
            status=info["status"],
            total_time_ms=int(info.get("total-time", 0)),
            downtime_ms=int(info.get("downtime", 0)),
            setup_time_ms=int(info.get("setup-time", 0)),
            transferred=int(ram.get("transferred", 0)),
            normal_pages=int(ram.get("normal", 0)),
            zero_pages=int(ram.get("duplicate", 0)),
            dirty_sync_count=int(ram.get("dirty-sync-count", 0)),
            wall_seconds=wall,
            sparse_skipped=int(ram.get("sparse-skipped", 0)),
            sparse_zero=int(ram.get("sparse-zero", 0)),
            postcopy_requests=int(ram.get("postcopy-requests", 0)),
            raw=info,
        )

    @property
    def postcopy_bytes(self) -> int:
        """RAM sent after the switch to postcopy (0 for a precopy migration)."""
        return int(self.raw.get("ram", {}).get("postcopy-bytes", 0))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def set_capabilities(vm: VM, caps: dict[str, bool]) -> None:
    if caps:
        vm.qmp(
            "migrate-set-capabilities",
            capabilities=[{"capability": k, "state": v} for k, v in caps.items()],
        )


def set_parameters(vm: VM, params: dict[str, Any]) -> None:
    if params:
        vm.qmp("migrate-set-parameters", **params)


def downtime_limit_ms(vm: VM) -> int:
    """The VM's `downtime-limit` migration parameter (QEMU's default is 300
    ms): how long, at most, a migration from it plans to stop the guest."""
    return int(vm.qmp("query-migrate-parameters")["downtime-limit"])


def in_progress(vm: VM) -> bool:
    """Whether `vm` is in a migration: one under way out of it, or its
    runstate is a migration's (a target set on it now would be lost)."""
    status = vm.qmp("query-migrate").get("status", "none")
    runstate = vm.qmp("query-status")["status"]
    return status in MIGRATING or runstate in MIGRATION_RUNSTATES


def start_incoming(dst: VM, port: int) -> str:
    uri = f"tcp:127.0.0.1:{port}"
    dst.qmp("migrate-incoming", uri=uri)
    return uri


class MigrationStatusError(ThinvmError):
    """A migration ended (failed, cancelled) or ran out of time short of
    the status waited for."""

    def __init__(self, status: str, wanted: tuple[str, ...], timed_out: bool) -> None:
        super().__init__(f"migration is {status!r}, expected one of {', '.join(wanted)}")
        self.status = status
        self.timed_out = timed_out


# query-migrate statuses a migration does not leave.
ENDED = ("completed", "failed", "cancelled")


def wait_status(
    vm: VM,
    wanted: tuple[str, ...],
    timeout: float = 60.0,
    progress: Progress | None = None,
    interval: float = 0.02,
) -> dict[str, Any]:
    """Poll `vm`'s query-migrate until its status is one of `wanted`, each
    reply shown to `progress`; returns the last reply.

    The one migration wait loop.  MigrationStatusError once it ends
    otherwise (failed or cancelled, unless `wanted` has them) or at
    `timeout`; the migration is left as it is.
    """
    deadline = time.monotonic() + timeout
    while True:
        info: dict[str, Any] = vm.qmp("query-migrate")
        status = str(info.get("status", "none"))
        if progress is not None:
            progress(info)
        if status in wanted:
            return info
        timed_out = time.monotonic() > deadline
        if status in ("failed", "cancelled") or timed_out:
            raise MigrationStatusError(status, wanted, timed_out)
        time.sleep(interval)


def wait_migration(
    src: VM, timeout: float, progress: Progress | None = None, interval: float = 0.1
) -> dict[str, Any]:
    """Wait until the migration ends, reporting progress; one that takes
    longer than `timeout` is cancelled, so that the source keeps the guest."""
    try:
        return wait_status(src, ENDED, timeout, progress, interval)
    except MigrationStatusError as exc:
        if not exc.timed_out:
            raise
        src.qmp("migrate_cancel")
        raise ThinvmError(f"migration did not finish within {timeout:.0f} s (cancelled)") from exc


def start_postcopy(src: VM, timeout: float = 60.0) -> None:
    """Switch a running migration (postcopy-ram on both sides) to postcopy.

    Returns once the source has stopped the guest and handed it over; the
    destination runs it (or stays paused, if started with -S) while pages
    keep arriving.
    """
    src.qmp("migrate-start-postcopy")
    try:
        wait_status(src, ("postcopy-active", "completed"), timeout, interval=0.05)
    except MigrationStatusError as exc:
        raise ThinvmError(f"migration did not switch to postcopy (status {exc.status})") from exc


def pause_and_recover(src: VM, dst: VM, timeout: float = 60.0) -> None:
    """Break a postcopy migration's channel and resume it on a new one.

    This is what an operator does after a network failure in postcopy:
    both sides pause, the destination listens again (`migrate-recover`)
    and the source resumes, sending what the destination's received map
    says is missing.  The destination is only ever asked out of band: its
    main thread may itself wait on a page that can only come once the
    migration resumes.

    Only a destination that runs the guest can pause: one still loading
    the switchover package (devices, discard list) fails the incoming
    migration on a broken channel, as upstream QEMU does, so wait for it.
    """
    wait_destination_status(dst, "running", timeout)
    src.qmp("migrate-pause")
    wait_status(src, ("postcopy-paused",), timeout)
    uri = f"tcp:127.0.0.1:{free_port()}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            dst.qmp("migrate-recover", uri=uri, oob=True)
            break
        except ThinvmError as exc:
            # The destination notices the broken channel a little later.
            if "paused" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    src.qmp("migrate", uri=uri, resume=True)
    wait_status(src, ("postcopy-active", "completed"), timeout)


def _postcopy_after(src: VM, seconds: float, progress: Progress | None) -> Progress:
    """A progress callback that switches to postcopy `seconds` into the migration."""
    switch_at = time.monotonic() + seconds
    switched = False

    def poll(info: dict[str, Any]) -> None:
        nonlocal switched
        if not switched and info.get("status") == "active" and time.monotonic() >= switch_at:
            src.qmp("migrate-start-postcopy")
            switched = True
        if progress is not None:
            progress(info)

    return poll


def migrate_to_uri(
    src: VM,
    uri: str,
    *,
    caps: dict[str, bool] | None = None,
    params: dict[str, Any] | None = None,
    timeout: float = 600.0,
    progress: Progress | None = None,
    postcopy_after: float | None = None,
) -> MigrationResult:
    """Migrate src to an already listening destination; the source survives a failure.

    With `postcopy_after` (seconds; needs postcopy-ram on both sides) the
    migration switches to postcopy that long after it starts, unless it
    finished first.  Once in postcopy a failure can no longer keep the
    guest on the source.
    """
    set_capabilities(src, caps or {})
    set_parameters(src, params or {})
    if postcopy_after is not None:
        progress = _postcopy_after(src, postcopy_after, progress)
    start = time.monotonic()
    src.qmp("migrate", uri=uri)
    info = wait_migration(src, timeout, progress)
    result = MigrationResult.from_query(info, time.monotonic() - start)
    if result.status != "completed":
        reason = info.get("error-desc", result.status)
        raise ThinvmError(f"migration to {uri} failed: {reason}; the source VM keeps running")
    return result


def migrate(
    src: VM,
    dst: VM,
    *,
    caps: dict[str, bool] | None = None,
    params: dict[str, Any] | None = None,
    timeout: float = 600.0,
    progress: Progress | None = None,
    resume: bool = True,
    postcopy_after: float | None = None,
) -> MigrationResult:
    """Migrate src into dst (started with incoming=True).

    With resume=True, wait until the guest runs and its agent answers on
    the destination.  With resume=False the destination must have been
    started paused (-S) and stays so, e.g. to compare memory byte for byte.
    """
    set_capabilities(dst, caps or {})
    uri = start_incoming(dst, free_port())
    try:
        result = migrate_to_uri(
            src,
            uri,
            caps=caps,
            params=params,
            timeout=timeout,
            progress=progress,
            postcopy_after=postcopy_after,
        )
    except ThinvmError as exc:
        # The source often only sees a broken pipe; the reason is here.
        reason = destination_error(dst)
        raise ThinvmError(f"{exc}; destination: {reason}" if reason else str(exc)) from exc
    if resume:
        wait_destination_status(dst, "running")
        dst.wait_agent(timeout=60)
    else:
        wait_destination_status(dst, "paused")
    return result


def destination_error(dst: VM) -> str | None:
    """Why an incoming migration failed, as the destination saw it."""
    deadline = time.monotonic() + 5
    while dst.alive() and time.monotonic() < deadline:
        try:
            info = dst.qmp("query-migrate")
        except ThinvmError:
            return None
        if info.get("status") == "failed":
            return str(info.get("error-desc", "failed"))
        time.sleep(0.1)
    return None


def wait_destination_status(dst: VM, status: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (current := dst.qmp("query-status")["status"]) != status:
        if time.monotonic() > deadline:
            raise ThinvmError(f"destination VM is {current!r} after migration, not {status!r}")
        time.sleep(0.05)


def wait_destination_running(dst: VM, timeout: float = 30.0) -> None:
    wait_destination_status(dst, "running", timeout)


def describe_progress(info: dict[str, Any]) -> str:
    ram = info.get("ram", {})
    total = ram.get("total", 0) or 1
    remaining = ram.get("remaining", 0)
    done = 100.0 * (total - remaining) / total
    return (
        f"{info.get('status', '?'):>10} {done:5.1f}%  sent {ram.get('transferred', 0) / 2**20:8.1f}"
        f" MiB  zero pages {ram.get('duplicate', 0):>8}  pass {ram.get('dirty-sync-count', 0)}"
    )


def save_guest_memory(vm: VM, path: str) -> None:
    """Write all of a (paused) guest's RAM to a host file with pmemsave."""
    vm.qmp("pmemsave", val=0, size=vm.config.memory, filename=path, timeout=300)
