"""Running the worker: spawn it (daemon or one-shot), wake it, wait on it, stop the pool."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from thinvm.host.cgroups import remove_cgroup
from thinvm.host.hugepages import nr_hugepages, set_nr_hugepages
from thinvm.paths import REPO
from thinvm.pool.files import punch
from thinvm.pool.model import Owner, PoolError, PoolState, Slot, choose_slot
from thinvm.pool.owned import UnsafePath, open_directory, open_slot, remove_slot
from thinvm.pool.probes import owner_alive
from thinvm.pool.store import LOCK_FILE, LOG_FILE, Pool
from thinvm.units import format_size

# Workers this process spawned, reaped as they exit (no zombies).
_children: list[subprocess.Popen[bytes]] = []


def _reap_children() -> None:
    for child in list(_children):
        if child.poll() is not None:
            _children.remove(child)


def _spawn_worker(root: Path, once: bool) -> subprocess.Popen[bytes]:
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "thinvm.pool", "serve", str(root)]
    if once:
        cmd.append("--once")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with open(root / LOG_FILE, "ab") as log:
        child = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
            env=env,
        )
    _reap_children()
    _children.append(child)
    return child


def kick(root: Path, daemon: Owner | None) -> None:
    """Have dirty slots scrubbed now: wake the daemon, or start a one-shot worker."""
    if daemon is not None and owner_alive(daemon):
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon.pid, signal.SIGUSR1)
            return
    _spawn_worker(root, once=True)


def spawn_daemon(root: str | Path | None, timeout: float = 30.0) -> int:
    """Start the daemon in the background; returns its pid once it runs."""
    pool = Pool(root)
    state = pool.read()
    if state.daemon is not None and owner_alive(state.daemon):
        raise PoolError(f"a pool daemon runs already (pid {state.daemon.pid})")
    child = _spawn_worker(pool.root, once=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon = pool.read().daemon
        if daemon is not None and daemon.pid == child.pid:
            return child.pid
        if child.poll() is not None:
            raise PoolError(f"the pool daemon exited at start: {_log_tail(pool)}")
        time.sleep(0.05)
    raise PoolError(f"the pool daemon did not start within {timeout:.0f} s: {_log_tail(pool)}")


def _log_tail(pool: Pool) -> str:
    try:
        return pool.log_file.read_text(errors="replace").strip()[-600:]
    except OSError:
        return "(no log)"


def wait_until(
    root: str | Path | None,
    ready: Callable[[PoolState], bool],
    timeout: float,
    what: str,
) -> PoolState:
    pool = Pool(root)
    deadline = time.monotonic() + timeout
    while True:
        state = pool.read()
        if ready(state):
            return state
        if time.monotonic() > deadline:
            raise PoolError(f"timed out after {timeout:.0f} s waiting for {what} ({state.note})")
        time.sleep(0.1)


def wait_free(root: str | Path | None, memory: int | None = None, timeout: float = 600.0) -> None:
    """Until a free slot holds `memory`, or (None) until every slot is free."""
    if memory is None:
        wait_until(root, lambda s: all(x.state == "free" for x in s.slots), timeout, "all slots")
    else:
        wait_until(
            root,
            lambda s: choose_slot(s.slots, memory) is not None,
            timeout,
            f"a free slot of {format_size(memory)}",
        )


@dataclass(frozen=True)
class StopReport:
    removed: int
    left_to_vms: list[str]
    warnings: list[str] = field(default_factory=list)  # what was left alone, and why


def _remove_slots(directory: str, slots: list[Slot]) -> tuple[int, list[str]]:
    """Punch (unless leased) and unlink every slot: how many, and what was left alone, why.

    In a directory that is not the pool's alone nothing is touched: its
    owner could have put anything behind a slot's name.
    """
    try:
        with open_directory(directory):
            pass
    except FileNotFoundError:
        return len(slots), []
    except UnsafePath as exc:
        return 0, [
            f"slot files in {directory} left alone: it {exc.problem}; "
            "see what is in it and remove it by hand"
        ]
    warnings = []
    for slot in slots:
        try:
            if slot.state != "leased":
                _punch_all(slot.path)
        except UnsafePath as exc:
            warnings.append(f"{exc}; its name is removed")
        except OSError:
            pass  # gone already, or its memory goes back with the unlink
        with contextlib.suppress(OSError):
            remove_slot(slot.path)
    return len(slots), warnings


def _punch_all(path: str) -> None:
    fd = open_slot(path)
    try:
        punch(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def stop(root: str | Path | None, *, force: bool = False, timeout: float = 60.0) -> StopReport:
    """Stop the daemon and give every slot's memory back; undo what the pool set up.

    Slots leased to running VMs stop the stop, unless `force`: then their
    files are unlinked now and their memory goes back when their QEMU exits.
    """
    pool = Pool(root)
    if not pool.exists():
        raise PoolError(f"no warm pool at {pool.root}")
    state = pool.read()
    leased = [
        s
        for s in state.slots
        if s.state == "leased" and s.owner is not None and owner_alive(s.owner)
    ]
    if leased and not force:
        names = ", ".join(
            f"slot {s.index} to {s.vm or 'a VM'} (pid {s.owner.pid})" for s in leased if s.owner
        )
        raise PoolError(f"slots are leased: {names}; stop those VMs first, or pass --force")
    _stop_workers(pool, state, timeout)
    with pool._flock():
        state = pool._load()
        cfg = state.config
        removed, warnings = _remove_slots(cfg.directory, state.slots)
        if cfg.manage_hugepages and state.hugepages_added:
            before = nr_hugepages(cfg.page_size)
            set_nr_hugepages(cfg.page_size, before - state.hugepages_added)
            state.hugepages_added = 0
        with contextlib.suppress(OSError):  # fails, as it should, while files are left in it
            os.rmdir(cfg.directory)
        if cfg.mounted is not None:
            if subprocess.run(["umount", cfg.mounted], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", cfg.mounted], capture_output=True)
            with contextlib.suppress(OSError):
                os.rmdir(cfg.mounted)
        if cfg.cgroup is not None:
            remove_cgroup(cfg.cgroup)
        report = StopReport(removed, [s.vm for s in leased], warnings)
        pool.state_file.unlink()
    for name in (LOCK_FILE, LOG_FILE):
        with contextlib.suppress(OSError):
            (pool.root / name).unlink()
    with contextlib.suppress(OSError):
        pool.root.rmdir()
    return report


def _stop_workers(pool: Pool, state: PoolState, timeout: float) -> None:
    """SIGTERM the daemon and any one-shot worker, and wait for them to go."""
    workers = [state.daemon] if state.daemon else []
    workers += [s.owner for s in state.slots if s.state in ("filling", "scrubbing") and s.owner]
    for owner in workers:
        if owner is not None and owner_alive(owner):
            with contextlib.suppress(ProcessLookupError):
                os.kill(owner.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for owner in workers:
        while owner is not None and owner_alive(owner):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(owner.pid, signal.SIGKILL)
            time.sleep(0.05)
            _reap_children()
    for child in list(_children):
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)
    _reap_children()
